#!/usr/bin/env bash
# Allocations per request of one or more canarygate builds, counted in the
# whole process (the request path, hyper, the audit threads) by uprobes on
# mimalloc's entry points while the load generator saturates one simulated
# provider.
#
#   bench/allocs.sh BIN...        # streams, 5 s per build
#
# Every allocation traps into the kernel while the probes are on, so this
# run's throughput and CPU mean nothing; what it measures is the count per
# request, which does not depend on speed. Each build serves the `default`
# preset (echo-first, durable audit) with its own data directory; the probes
# are removed on exit.
#
# Needs perf (Debian: linux-perf), root (uprobes) and the load generator
# (built here). Environment knobs [defaults]:
#   ALLOCS_SECONDS  seconds of load per build [5]
#   ALLOCS_MODE     stream or non-stream [stream]
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
# shellcheck source=bench/common.sh
. bench/common.sh
[ $# -ge 1 ] || { sed -n '2,8p' "$0" >&2; exit 2; }
command -v perf >/dev/null || { echo "perf is missing (Debian: apt-get install linux-perf)" >&2; exit 1; }
seconds=${ALLOCS_SECONDS:-5} mode=${ALLOCS_MODE:-stream}
build_load_generator
start_work
remove_probes() { perf probe -q -d 'cgalloc:*' 2>/dev/null || true; }
trap 'remove_probes; cleanup' EXIT
remove_probes

# mimalloc's Rust allocator calls these for every allocation (mimalloc
# crate, `GlobalAlloc for MiMalloc`): aligned allocation, zeroed
# allocation, reallocation.
entry_points=(mi_malloc_aligned mi_zalloc_aligned mi_realloc_aligned)
index=0
for bin in "$@"; do
  # A copy per build, so two arguments naming one file get probes each.
  canarygate=$work/canarygate-$index
  cp "$(realpath "$bin")" "$canarygate"
  events=()
  for function in "${entry_points[@]}"; do
    perf probe -q -x "$canarygate" -a "cgalloc:${function}_$index=$function"
    events+=("cgalloc:${function}_$index")
  done
  [ "$index" -gt 0 ] || start_sim
  start_canarygate_server "build-$index" preset:default
  "$load" --target "x=$started_url/v1" --modes "$mode" --rounds 1 --seconds 2 --no-latency >/dev/null
  perf stat -x, -e "$(IFS=,; echo "${events[*]}")" -p "$started_pid" -o "$work/allocs-$index.csv" &
  counting=$!
  # The load generator's one check request counts too.
  requests=$("$load" --target "x=$started_url/v1" --modes "$mode" --rounds 1 \
    --seconds "$seconds" --no-latency | grep -oE '\(([0-9]+) ok' | head -n 1 | tr -dc 0-9)
  kill -INT "$counting"
  wait "$counting" || true
  awk -F, -v bin="$bin" -v requests="$((requests + 1))" '
    /cgalloc:/ { split($3, name, ":"); sub(/_[0-9]+$/, "", name[2]); count[name[2]] = $1; total += $1 }
    END {
      printf "%s: %d requests; per request: %.0f allocations (mi_malloc_aligned %.0f, mi_zalloc_aligned %.0f), %.0f reallocations\n",
        bin, requests, (count["mi_malloc_aligned"] + count["mi_zalloc_aligned"]) / requests,
        count["mi_malloc_aligned"] / requests, count["mi_zalloc_aligned"] / requests,
        count["mi_realloc_aligned"] / requests
    }' "$work/allocs-$index.csv"
  index=$((index + 1))
done
