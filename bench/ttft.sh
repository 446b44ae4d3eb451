#!/usr/bin/env bash
# Time to the first visible token of a streamed chat on a model decoding 50
# tokens/s: direct to the simulated provider, and through canarygate (the
# `default` preset: echo-first release, so the client's first token waits for
# the canary echo), in the same run, sample by sample in turns.
#
#   bench/ttft.sh
#   CANARYGATE_BEFORE_BIN=/path/to/older/canarygate bench/ttft.sh
#
# With CANARYGATE_BEFORE_BIN (optional; no such binary is in the repository)
# it also measures that older canarygate, run the same way (`serve` with its
# own embedded default preset and `--upstream`). An older canarygate asks for
# its own canary format, which only its own simulator follows, so it runs
# against the older binary's `sim-provider` at the same speed, and its ratio
# is taken against direct to that simulator (measured in the same run too).
#
# Environment knobs (defaults in brackets):
#   CANARYGATE_BIN          canarygate binary [build target/release/canarygate]
#   CANARYGATE_BEFORE_BIN   an older canarygate to compare with [none]
#   TTFT_DECODE_TPS         the simulated model's decode speed, tokens/s [50]
#   TTFT_SAMPLES            samples per target [30]
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
decode_tps=${TTFT_DECODE_TPS:-50}
export TTFT_SAMPLES=${TTFT_SAMPLES:-30}

# shellcheck source=bench/common.sh
. bench/common.sh
log() { printf '[ttft] %s\n' "$*" >&2; }

log "building the client"
cargo build --release --quiet -p canarygate-bench --bin canarygate-bench-ttft
client=$root/target/release/canarygate-bench-ttft
build_canarygate
before=${CANARYGATE_BEFORE_BIN:-}
if [ -n "$before" ] && ! [ -x "$before" ]; then
  echo "CANARYGATE_BEFORE_BIN=$before is not an executable" >&2
  exit 1
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/canarygate-ttft.XXXXXX")
pids=()
cleanup() {
  local pid
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

export CANARYGATE_LOG=${CANARYGATE_LOG:-warn}

# Starts "$@" with its output in $work/$name.log; prints the URL it announces
# on its first line ("... listening on URL").
start() {
  local name=$1 i line
  shift
  "$@" >"$work/$name.log" 2>"$work/$name.err" &
  pids+=("$!")
  for i in $(seq 1 400); do
    line=$(head -n 1 "$work/$name.log" 2>/dev/null || true)
    case "$line" in
      *"listening on "*) echo "${line##* }"; return 0 ;;
    esac
    kill -0 "${pids[-1]}" 2>/dev/null || break
    sleep 0.05
  done
  echo "$name did not start:" >&2
  cat "$work/$name.log" "$work/$name.err" >&2
  exit 1
}

sim=$(start sim "$canarygate" sim-provider --listen 127.0.0.1:0 --decode-tps "$decode_tps")
proxy=$(start canarygate "$canarygate" serve --listen 127.0.0.1:0 --data "$work/data" --upstream "$sim/v1")
targets=(--target "direct=$sim/v1" --target "canarygate=$proxy/v1,vs=direct")
if [ -n "$before" ]; then
  before_sim=$(start before-sim "$before" sim-provider --listen 127.0.0.1:0 --decode-tps "$decode_tps")
  before_proxy=$(start before "$before" serve --listen 127.0.0.1:0 --data "$work/before-data" --upstream "$before_sim/v1")
  targets+=(--target "direct-to-before-sim=$before_sim/v1" --target "canarygate-before=$before_proxy/v1,vs=direct-to-before-sim")
fi
log "decode $decode_tps tokens/s, $TTFT_SAMPLES samples per target; canarygate: $canarygate${before:+; before: $before}"
"$client" "${targets[@]}"
