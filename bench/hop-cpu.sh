#!/usr/bin/env bash
# Where one request's CPU goes on this machine, for nginx and for canarygate
# in front of the same simulated provider: the proxy's, the provider's and
# the load generator's, per request, from `perf stat -e task-clock` on each
# process, in alternating rounds of saturation.
#
#   bench/hop-cpu.sh           # 3 rounds of 6 s, streams of 64 tokens
#
# All three share this machine's cores, so the throughput each proxy gets
# at saturation follows the sum (bench/README.md, "Where a stream's CPU
# goes"): the script prints each part, the sum, the throughput ratio the
# sums predict against the one measured, and the ratio canarygate would get
# if its own CPU per request were nginx's (what the provider's extra work
# for canarygate's requests leaves: the output tokens a request gets for its
# echo, which answers that run to their limit use up). canarygate serves
# the `default` preset (echo-first, durable audit).
#
# Needs perf (Debian: linux-perf), nginx, and the load generator (built here).
# Environment knobs [defaults]:
#   HOP_ROUNDS      rounds [3]
#   HOP_SECONDS     seconds of saturation per proxy and round [6]
#   HOP_MODE        stream or non-stream [stream]
#   HOP_MAX_TOKENS  answer length in tokens [64]
#   CANARYGATE_BIN  canarygate binary [build target/release/canarygate]
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
# shellcheck source=bench/common.sh
. bench/common.sh
[ $# -eq 0 ] || { sed -n '2,16p' "$0" >&2; exit 2; }
command -v perf >/dev/null || { echo "perf is missing (Debian: apt-get install linux-perf)" >&2; exit 1; }
install_missing nginx nginx
nginx_bin=$(command -v nginx || echo /usr/sbin/nginx)
rounds=${HOP_ROUNDS:-3} seconds=${HOP_SECONDS:-6} mode=${HOP_MODE:-stream}
build_canarygate
build_load_generator
start_work
start_sim
start_nginx nginx
start_canarygate_server canarygate preset:default
declare -A url pid
url[nginx]=$nginx_url pid[nginx]=$nginx_pid
url[canarygate]=$started_url pid[canarygate]=$started_pid
load_args=(--modes "$mode" --rounds 1 --no-latency --max-tokens "${HOP_MAX_TOKENS:-64}")
for name in nginx canarygate; do
  "$load" --target "$name=${url[$name]}/v1" "${load_args[@]}" --seconds 2 >/dev/null
done

msec() { awk '/task-clock/ { gsub(",", "", $1); print $1 }' "$1"; }
# Prints one line per proxy and round: round, name, requests, then the
# proxy's, the provider's and the load generator's CPU in ms.
for round in $(seq 1 "$rounds"); do
  for name in nginx canarygate; do
    # The proxy's process tree (nginx's workers are its children).
    tree=$( (echo "${pid[$name]}"; pgrep -P "${pid[$name]}" || true) | paste -sd, -)
    perf stat -e task-clock -p "$tree" -o "$work/proxy.perf" &
    proxy_perf=$!
    perf stat -e task-clock -p "$sim_pid" -o "$work/sim.perf" &
    sim_perf=$!
    requests=$(perf stat -e task-clock -o "$work/load.perf" -- \
      "$load" --target "$name=${url[$name]}/v1" "${load_args[@]}" --seconds "$seconds" \
      | grep -oE '\(([0-9]+) ok' | head -n 1 | tr -dc 0-9)
    kill -INT "$proxy_perf" "$sim_perf"
    wait "$proxy_perf" "$sim_perf" || true
    echo "$round $name $requests $(msec "$work/proxy.perf") $(msec "$work/sim.perf") $(msec "$work/load.perf")"
  done
done | python3 -c '
import statistics, sys
rows = {"nginx": [], "canarygate": []}
for line in sys.stdin:
    round_, name, requests, proxy_ms, sim_ms, load_ms = line.split()
    n = int(requests)
    proxy, sim, load = (float(ms) * 1000 / n for ms in (proxy_ms, sim_ms, load_ms))
    rows[name].append((n, proxy, sim, load, proxy + sim + load))
    print(f"round {round_} {name:10}: {n} requests; µs per request: proxy {proxy:.0f}, provider {sim:.0f}, load generator {load:.0f}, sum {proxy + sim + load:.0f}")
med = {name: [statistics.median(column) for column in zip(*values)] for name, values in rows.items()}
for name, (n, proxy, sim, load, total) in med.items():
    print(f"median {name:10}: {n:.0f} requests; µs per request: proxy {proxy:.0f}, provider {sim:.0f}, load generator {load:.0f}, sum {total:.0f}")
ng, cg = med["nginx"], med["canarygate"]
print(f"canarygate / nginx: requests {cg[0] / ng[0]:.2f}, as the sums predict {ng[4] / cg[4]:.2f}; proxy CPU {cg[1] / ng[1]:.2f}, provider CPU {cg[2] / ng[2]:.2f}")
print(f"requests if canarygate used nginx'"'"'s CPU per request: {ng[4] / (ng[1] + cg[2] + cg[3]):.2f} of nginx'"'"'s")
'
