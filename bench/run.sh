#!/usr/bin/env bash
# Proxy overhead benchmark: canarygate against a direct hop, nginx as a plain
# reverse proxy, and the LiteLLM proxy, side by side on this machine.
#
#   bench/run.sh            # full run (3 rounds; about 10-15 minutes on 2 cores)
#   bench/run.sh --quick    # 1 round of short phases, to see that it all works
#
# Starts on 127.0.0.1: the simulated provider (`canarygate sim-provider`, no
# model latency), then, all pointed at it: nginx (Debian package; config
# generated below), canarygate with the `default` preset (echo-first), the
# same with `[audit] durability = "background"` (echo-first-bg), the `strict`
# preset (verdict-first), and with checks off (`[verify] enabled = false`),
# and LiteLLM (PyPI, in bench/.venv). Then runs the load generator
# (bench/, `canarygate-bench`) over all of them, non-streaming and streaming,
# every answer 64 tokens: saturation throughput, CPU per request of each
# proxy's process tree (from /proc), and p50/p99 latency at a fixed rate below
# every system's saturation (LiteLLM's sets it), then at a higher rate below
# every system's but LiteLLM's, with canarygate's own time per request over
# each of those phases (from its /metrics); each round in a different order;
# medians over the rounds. Each round first times the disk's sync where the
# data directories are (300 x 4 KiB append + fdatasync), and the report sets
# canarygate's own p99 against that round's sync p99, the floor of a durable
# answer. Prints markdown tables and writes bench/results/latest.json.
#
# Installs what is missing: nginx (apt-get, as root), LiteLLM (pip, in
# bench/.venv). Uses $CANARYGATE_BIN, or builds `cargo build --release --bin
# canarygate`.
#
# Environment knobs (defaults in brackets):
#   CANARYGATE_BIN                 canarygate binary [build target/release/canarygate]
#   BENCH_TARGETS                  comma-separated subset of
#                                  direct,nginx,canarygate-echo-first,canarygate-echo-first-bg,
#                                  canarygate-verdict-first,canarygate-off,litellm [all]
#   CANARYGATE_BEFORE_BIN          an earlier canarygate binary, measured beside this one as
#                                  canarygate-echo-first-before and canarygate-echo-first-bg-before
#                                  (for the targets of those names that are wanted) [none]
#   BENCH_QUICK=1                  same as --quick
#   CANARYGATE_BENCH_SECONDS       saturation phase length, s [3; quick 1]
#   CANARYGATE_BENCH_ROUNDS        rounds [3; quick 1]
#   CANARYGATE_BENCH_CONCURRENCY   connections at saturation, every target [32]
#   CANARYGATE_BENCH_RATE          non-streaming latency rate, req/s [auto: half the slowest saturation, rounded down to 1 digit]
#   CANARYGATE_BENCH_STREAM_RATE   streaming latency rate, req/s [auto, likewise]
#   CANARYGATE_BENCH_FAST_RATE     rate of the second latency phase, without LiteLLM
#                                  [auto: a quarter of the slowest saturation but LiteLLM's, likewise; -1: none]
#   CANARYGATE_BENCH_LATENCY_SECONDS  latency phase length, s [max(seconds, 200 requests), at most 10; quick 2]
#   CANARYGATE_BENCH_MODES         non-stream,stream [both]
#   CANARYGATE_BENCH_MAX_TOKENS    answer length in tokens [64]
#   CANARYGATE_BENCH_CLIENT_THREADS  load generator threads [1]
#   CANARYGATE_BENCH_SYNC_SAMPLES  disk sync probes per round [300]
#   CANARYGATE_BENCH_LOADED_SYNC_RATE  disk syncs/s timed during each canarygate latency phase [200; 0: none]
#   BENCH_NGINX_WORKERS            nginx worker_processes [number of CPUs]
#   BENCH_LITELLM_WORKERS          LiteLLM (uvicorn) worker processes [number of CPUs]
#   BENCH_LITELLM_CONCURRENCY      LiteLLM's own saturation concurrency [CANARYGATE_BENCH_CONCURRENCY]
#   BENCH_LITELLM_VERSION          LiteLLM version from PyPI [1.106.12]
#   BENCH_OUT                      results directory [bench/results]
#   BENCH_NOTE                     text about the machine, copied into the results
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
# shellcheck source=bench/common.sh
. bench/common.sh

bench_options run.sh "$@"

all_targets=direct,nginx,canarygate-echo-first,canarygate-echo-first-bg,canarygate-verdict-first,canarygate-off,litellm
targets=${BENCH_TARGETS:-$all_targets}
wants() { case ",$targets," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
for t in ${targets//,/ }; do
  case ",$all_targets," in *",$t,"*) ;; *) echo "unknown target $t (known: $all_targets)" >&2; exit 2 ;; esac
done

nginx_workers=${BENCH_NGINX_WORKERS:-$cpus}
litellm_workers=${BENCH_LITELLM_WORKERS:-$cpus}
litellm_version=${BENCH_LITELLM_VERSION:-1.106.12}

# --- install what is missing -------------------------------------------------
if wants nginx; then
  install_missing nginx nginx "(or leave nginx out of BENCH_TARGETS)"
fi
nginx_bin=$(command -v nginx || echo /usr/sbin/nginx)

venv=bench/.venv
if wants litellm; then
  if ! "$venv/bin/python" -c "import litellm, sys; from importlib.metadata import version; sys.exit(version('litellm') != '$litellm_version')" 2>/dev/null; then
    log "installing litellm[proxy]==$litellm_version in $venv (pip; a few minutes the first time)"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check "litellm[proxy]==$litellm_version"
  fi
fi

build_binaries

# --- start the servers -------------------------------------------------------
start_work
# shellcheck disable=SC2119 # (the sim takes no further arguments here)
start_sim

# The data directories are under $work: time the disk's sync there.
bench_args=(--upstream-pid "$sim_pid" --sync-probe-dir "$work")
add_target() { bench_args+=(--target "$1"); }

wants direct && add_target "direct=$sim_url/v1"

if wants nginx; then
  start_nginx nginx
  add_target "nginx=$nginx_url/v1,pid=$nginx_pid"
fi

start_canarygate() {
  start_canarygate_server "$1" "$2"
  add_target "$1=$started_url/v1,pid=$started_pid,metrics"
}

wants canarygate-echo-first && start_canarygate canarygate-echo-first preset:default
if wants canarygate-echo-first-bg; then
  # All checks on, with the audit record committed in the background instead
  # of before the answer ([audit] durability = "background").
  { cat policies/presets/default.toml; printf '\n[audit]\ndurability = "background"\n'; } \
    >"$work/echo-first-bg.toml"
  start_canarygate canarygate-echo-first-bg "$work/echo-first-bg.toml"
fi
wants canarygate-verdict-first && start_canarygate canarygate-verdict-first preset:strict
if [ -n "${CANARYGATE_BEFORE_BIN:-}" ]; then
  # An earlier build beside this one, in the same run and the same rounds:
  # the "before" of a change's numbers.
  current_bin=$canarygate
  canarygate=$CANARYGATE_BEFORE_BIN
  wants canarygate-echo-first && start_canarygate canarygate-echo-first-before preset:default
  wants canarygate-echo-first-bg && start_canarygate canarygate-echo-first-bg-before "$work/echo-first-bg.toml"
  canarygate=$current_bin
fi
if wants canarygate-off; then
  cat >"$work/checks-off.toml" <<EOF
# The default preset with verification off: a plain proxy (no canaries, no
# checks), with the same auth, limits, routing and audit log.
[auth]
mode = "passthrough"

[limits]
max_body_bytes = 8388608
max_concurrent_requests = 1024

[[providers]]
name = "openai"
base_url = "https://api.openai.com/v1"
context_window = 128000

[[routes]]
model = "*"
provider = "openai"

[verify]
enabled = false
EOF
  start_canarygate canarygate-off "$work/checks-off.toml"
fi

if wants litellm; then
  litellm_port=$(free_port)
  litellm_key="sk-bench-$(python3 -c 'import secrets; print(secrets.token_hex(16))')"
  cat >"$work/litellm.yaml" <<EOF
# One model, the simulated provider as an OpenAI-compatible upstream. No
# database, no callbacks, no telemetry, no message logging.
model_list:
  - model_name: gpt-4o-mini
    litellm_params:
      model: openai/gpt-4o-mini
      api_base: $sim_url/v1
      api_key: sk-bench-upstream
litellm_settings:
  telemetry: false
  callbacks: []
  success_callback: []
  failure_callback: []
  turn_off_message_logging: true
  drop_params: true
general_settings:
  master_key: os.environ/LITELLM_MASTER_KEY
  disable_spend_logs: true
  disable_error_logs: true
EOF
  # Offline: the bundled model cost map, no admin UI, no .env loading.
  LITELLM_MASTER_KEY=$litellm_key LITELLM_LOCAL_MODEL_COST_MAP=True LITELLM_LOG=ERROR \
    LITELLM_MODE=PRODUCTION DISABLE_ADMIN_UI=True NO_DOCS=True \
    "$venv/bin/litellm" --config "$work/litellm.yaml" --host 127.0.0.1 --port "$litellm_port" \
    --num_workers "$litellm_workers" >"$work/litellm.log" 2>&1 &
  litellm_pid=$!
  pids+=("$litellm_pid")
  log "litellm $litellm_version: http://127.0.0.1:$litellm_port (pid $litellm_pid, $litellm_workers workers; starting takes a while)"
  spec="litellm=http://127.0.0.1:$litellm_port/v1,pid=$litellm_pid,slow"
  [ -n "${BENCH_LITELLM_CONCURRENCY:-}" ] && spec="$spec,concurrency=$BENCH_LITELLM_CONCURRENCY"
  add_target "$spec"
  # Every target gets the same bearer token: LiteLLM's master key (the sim,
  # nginx and canarygate in passthrough mode take any).
  export CANARYGATE_BENCH_API_KEY=$litellm_key
  # Each worker starts on its own (tens of seconds each); wait for all of them.
  for _ in $(seq 1 600); do
    [ "$(grep -c "Proxy initialized" "$work/litellm.log" || true)" -ge "$litellm_workers" ] && break
    if ! kill -0 "$litellm_pid" 2>/dev/null; then
      echo "LiteLLM exited; its log:" >&2
      cat "$work/litellm.log" >&2
      exit 1
    fi
    sleep 0.5
  done
  log "litellm: $(grep -c "Proxy initialized" "$work/litellm.log" || true) worker(s) up"
fi

wants nginx && bench_args+=(--reference nginx)
wants litellm && bench_args+=(--reference litellm)

note="$(machine_note), nginx $("$nginx_bin" -v 2>&1 | sed 's/.*nginx\///'), $nginx_workers worker(s); LiteLLM $litellm_version, $litellm_workers worker(s). ${BENCH_NOTE:-}"

status=0
run_load_generator "" "$note" || status=$?
finish_run "$status"
