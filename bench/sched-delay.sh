#!/usr/bin/env bash
# Run-queue waits under a fixed-rate load: how long each thread of
# canarygate, of the simulated provider and of the load generator waited for
# a CPU after it was woken, from the scheduler's own trace.
#
#   bench/sched-delay.sh [BIN]        # 3,000 whole answers/s for 5 s
#
# A durable answer waits for its journal sync and then for its task to run
# again; on a busy host the second wait is the scheduler's. This records
# `perf sched` over one open-loop phase of the load generator and prints,
# per thread group, how often its threads were switched in, their
# scheduling delay (wakeup to running) at p50 / p99 / p99.9 / max, and the
# CPU time they ran; then the phase's own time and journal syncs as the
# load generator reports them. BIN: the canarygate binary [build
# target/release/canarygate]; it serves the `default` preset (echo-first,
# durable audit).
#
# Needs perf (Debian: linux-perf) with access to the scheduler's
# tracepoints (root). Environment knobs [defaults]:
#   SCHED_RATE     requests/s [3000]
#   SCHED_SECONDS  seconds traced, all in the fixed-rate phase [5]
#   SCHED_MODE     non-stream or stream [non-stream]
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
# shellcheck source=bench/common.sh
. bench/common.sh
command -v perf >/dev/null || { echo "perf is missing (Debian: apt-get install linux-perf)" >&2; exit 1; }
rate=${SCHED_RATE:-3000} seconds=${SCHED_SECONDS:-5} mode=${SCHED_MODE:-non-stream}
if [ $# -ge 1 ]; then
  canarygate=$(realpath "$1")
else
  log "building canarygate"
  cargo build --release --quiet --bin canarygate
  canarygate=$root/target/release/canarygate
fi
build_load_generator
start_work

start_sim
start_canarygate_server canarygate preset:default
target="canarygate=$started_url/v1,pid=$started_pid,metrics"
phase() {
  "$load" --target "$target" --modes "$mode" --rounds 1 --seconds 1 --rate "$rate" \
    --stream-rate "$rate" --fast-rate -1 --latency-seconds "$1"
}
phase 1 >/dev/null # warm-up: connections, the journal's first segments
# The load generator saturates before its fixed-rate phase (a 1 s warm-up,
# 0.25 s, then 1 s measured, at --seconds 1): the trace starts after that
# and ends before the phase does, so it holds the fixed rate only.
(sleep 3 && perf sched record -o "$work/sched.data" -- sleep "$((seconds - 1))") 2>"$work/perf.err" &
perf_pid=$!
phase "$((seconds + 1))" | grep -E "^ +$mode +canarygate" || true
wait "$perf_pid"
perf sched timehist -i "$work/sched.data" 2>/dev/null |
  CANARYGATE_PID=$started_pid SIM_PID=$sim_pid python3 -c '
import os, re, sys
owners = {os.environ["CANARYGATE_PID"]: "canarygate", os.environ["SIM_PID"]: "provider"}
groups = {}
for line in sys.stdin:
    fields = line.split()
    if len(fields) < 6 or not re.fullmatch(r"\d+\.\d+", fields[0]):
        continue
    task = re.fullmatch(r"(.*)\[(\d+)(?:/(\d+))?\]", fields[2])
    if not task:
        continue
    name, pid = task.group(1), task.group(3) or task.group(2)
    try:
        delay, ran = float(fields[4]), float(fields[5])
    except ValueError:
        continue
    owner = owners.get(pid, "load generator" if name.startswith("canarygate-benc") else None)
    if owner is None:
        owner, name = "kernel and others", name.split("/")[0].split(":")[0]
    group = groups.setdefault((owner, name), [[], 0.0])
    group[0].append(delay)
    group[1] += ran
def at(values, q):
    return values[min(len(values) - 1, int(q * len(values)))]
total = sum(ran for _, ran in groups.values())
print(f"traced: {total / 1000:.2f} s of CPU time")
print("| process | threads | switched in | delay p50 ms | p99 ms | p99.9 ms | max ms | ran ms |")
print("|---|---|---:|---:|---:|---:|---:|---:|")
for (owner, name), (delays, ran) in sorted(groups.items(), key=lambda item: -item[1][1])[:10]:
    delays.sort()
    print(f"| {owner} | {name} | {len(delays)} | {at(delays, .5):.3f} | {at(delays, .99):.3f} | "
          f"{at(delays, .999):.3f} | {delays[-1]:.3f} | {ran:.0f} |")
'
