#!/usr/bin/env bash
# CPU per request of two canarygate builds, and of the provider they call,
# in alternating rounds of saturation on one simulated provider.
#
#   bench/cpu-ab.sh BEFORE_BIN AFTER_BIN      # 3 rounds of 6 s, streams
#
# On loopback the kernel's TCP work is charged to whichever process runs it,
# so a change that moves when canarygate reads can move CPU between it and
# the provider without saving any (bench/README.md, 12-05): this prints both
# and their total, per request, from `perf stat -e task-clock` on each
# process, then the medians and AFTER / BEFORE. The provider does the same
# work for every request, so canarygate's CPU over the provider's in the same
# round ("canarygate / provider") cancels the host's own slowdowns, which
# move both by the same factor (seen here: 10 % between rounds). Both builds serve the
# `default` preset (echo-first, durable audit, or the background audit with
# AB_AUDIT), each with its own data directory; the provider is AFTER's
# `sim-provider`.
#
# Needs perf (Debian: linux-perf) and the load generator (built here).
# Environment knobs [defaults]:
#   AB_ROUNDS    rounds [3]
#   AB_SECONDS   seconds of saturation per build and round [6]
#   AB_MODE      stream or non-stream [stream]
#   AB_SIM_ARGS  further sim-provider arguments, e.g. `--decode-tps 1000` []
#   AB_AUDIT     durable or background: the audit's durability [durable]
#   AB_AFTER_INSTANCES  N > 1 runs AFTER as N processes of one worker thread
#                each, the load spread over them and their CPU summed: what
#                a thread per core would save, estimated (bench/README.md,
#                12-07) [1]
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
# shellcheck source=bench/common.sh
. bench/common.sh
[ $# -eq 2 ] || { sed -n '2,8p' "$0" >&2; exit 2; }
command -v perf >/dev/null || { echo "perf is missing (Debian: apt-get install linux-perf)" >&2; exit 1; }
before_bin=$(realpath "$1") after_bin=$(realpath "$2")
rounds=${AB_ROUNDS:-3} seconds=${AB_SECONDS:-6} mode=${AB_MODE:-stream}
build_load_generator
start_work

canarygate=$after_bin
# shellcheck disable=SC2086 # AB_SIM_ARGS is a list of arguments
start_sim ${AB_SIM_ARGS:-}
config=preset:default
case ${AB_AUDIT:-durable} in
  durable) ;;
  background)
    config=$work/background.toml
    { cat policies/presets/default.toml; printf '\n[audit]\ndurability = "background"\n'; } >"$config"
    ;;
  *) echo "AB_AUDIT must be durable or background" >&2; exit 2 ;;
esac
# url[NAME]: the load generator's target URL (URL1/v1|URL2/v1 for a pool);
# pid[NAME]: the processes perf counts (PID1,PID2).
declare -A url pid
instances=${AB_AFTER_INSTANCES:-1}
for name in before after; do
  bin=${name}_bin
  canarygate=${!bin}
  if [ "$name" = after ] && [ "$instances" -gt 1 ]; then
    # (`pids` is common.sh's list of what to stop at the end.)
    pool_urls=() pool_pids=()
    for n in $(seq 1 "$instances"); do
      start_canarygate_server "after$n" "$config" --worker-threads 1
      pool_urls+=("$started_url/v1") pool_pids+=("$started_pid")
    done
    url[$name]=$(IFS='|'; echo "${pool_urls[*]}")
    pid[$name]=$(IFS=','; echo "${pool_pids[*]}")
  else
    start_canarygate_server "$name" "$config"
    pid[$name]=$started_pid
    url[$name]=$started_url/v1
  fi
  "$load" --target "$name=${url[$name]}" --modes "$mode" --rounds 1 --seconds 2 --no-latency >/dev/null
done

# Prints one line per build and round; each line ends with its numbers.
for round in $(seq 1 "$rounds"); do
  for name in before after; do
    perf stat -e task-clock -p "${pid[$name]}" -o "$work/target.perf" &
    target_perf=$!
    perf stat -e task-clock -p "$sim_pid" -o "$work/sim.perf" &
    sim_perf=$!
    requests=$("$load" --target "$name=${url[$name]}" --modes "$mode" --rounds 1 \
      --seconds "$seconds" --no-latency | grep -oE '\(([0-9]+) ok' | head -n 1 | tr -dc 0-9)
    kill -INT "$target_perf" "$sim_perf"
    wait "$target_perf" "$sim_perf" || true
    msec() { awk '/task-clock/ { gsub(",", "", $1); print $1 }' "$1"; }
    echo "$round $name $requests $(msec "$work/target.perf") $(msec "$work/sim.perf")"
  done
done | python3 -c '
import statistics, sys
rows = {"before": [], "after": []}
for line in sys.stdin:
    round_, name, requests, target_ms, sim_ms = line.split()
    n = int(requests)
    target, sim = float(target_ms) * 1000 / n, float(sim_ms) * 1000 / n
    rows[name].append((target, sim, target + sim, target / sim))
    print(f"round {round_} {name:6}: {n} requests, canarygate {target:.0f} µs, provider {sim:.0f} µs, total {target + sim:.0f} µs per request, canarygate / provider {target / sim:.3f}")
medians = {name: [statistics.median(column) for column in zip(*values)] for name, values in rows.items()}
for name, (target, sim, total, relative) in medians.items():
    print(f"median {name:6}: canarygate {target:.0f} µs, provider {sim:.0f} µs, total {total:.0f} µs per request, canarygate / provider {relative:.3f}")
ratios = [a / b for a, b in zip(medians["after"], medians["before"])]
print("after / before: canarygate {:.3f}, provider {:.3f}, total {:.3f}, canarygate / provider {:.3f}".format(*ratios))
'
