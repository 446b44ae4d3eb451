#!/usr/bin/env bash
# Where canarygate's own CPU goes, by thread: the request workers
# (tokio-rt-worker), the durable audit's journal writer (audit-journal) and
# its index writer (audit-index), per request at saturation, with the bytes
# each writes per request and the records per journal sync.
#
#   bench/thread-cpu.sh           # 3 rounds of 6 s, whole answers then streams
#
# Each thread's CPU and bytes written come from /proc/PID/task/*/stat and io
# read around a saturating run of the load generator; the syncs from the
# `canarygate_audit_journal_sync_seconds` count in /metrics. canarygate
# serves the `default` preset (echo-first, durable audit) in front of the
# simulated provider, 64-token answers.
#
# Environment knobs [defaults]:
#   THREADS_ROUNDS   rounds [3]
#   THREADS_SECONDS  seconds of saturation per mode and round [6]
#   THREADS_MODES    modes, comma-separated [non-stream,stream]
#   CANARYGATE_BIN   canarygate binary [build target/release/canarygate]
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
# shellcheck source=bench/common.sh
. bench/common.sh
[ $# -eq 0 ] || { sed -n '2,14p' "$0" >&2; exit 2; }
rounds=${THREADS_ROUNDS:-3} seconds=${THREADS_SECONDS:-6}
IFS=, read -r -a modes <<<"${THREADS_MODES:-non-stream,stream}"
build_canarygate
build_load_generator
start_work
start_sim
start_canarygate_server canarygate preset:default
pid=$started_pid url=$started_url

# One line per thread name: name, CPU ticks, bytes written.
threads() {
  local task
  for task in /proc/"$pid"/task/*; do
    printf '%s %s %s\n' "$(tr ' ' _ <"$task/comm")" \
      "$(awk '{ print $14 + $15 }' "$task/stat")" \
      "$(awk '/^wchar/ { print $2 }' "$task/io")"
  done | awk '{ cpu[$1] += $2; bytes[$1] += $3 } END { for (name in cpu) print name, cpu[name], bytes[name] }' | sort
}
syncs() {
  curl -s "$url/metrics" | awk '/^canarygate_audit_journal_sync_seconds_count/ { print $2 }'
}
run() {
  "$load" --target "canarygate=$url/v1" --modes "$1" --rounds 1 --no-latency --max-tokens 64 \
    --seconds "$2" | grep -oE '\(([0-9]+) ok' | head -n 1 | tr -dc 0-9
}

for mode in "${modes[@]}"; do
  run "$mode" 2 >/dev/null
done
# Per round and mode: "round mode requests syncs" then the threads' lines.
for round in $(seq 1 "$rounds"); do
  for mode in "${modes[@]}"; do
    threads >"$work/before"
    syncs_before=$(syncs)
    requests=$(run "$mode" "$seconds")
    syncs_after=$(syncs)
    threads >"$work/after"
    echo "round $round $mode $requests $((syncs_after - syncs_before))"
    join "$work/before" "$work/after" | awk '{ print "thread", $1, $4 - $2, $5 - $3 }'
  done
done | python3 -c '
import collections, os, statistics, sys
hz = os.sysconf("SC_CLK_TCK")
runs = collections.defaultdict(list)  # mode -> [(requests, syncs, {thread: (us, bytes)})]
for line in sys.stdin:
    words = line.split()
    if words[0] == "round":
        mode, requests, syncs = words[2], int(words[3]), int(words[4])
        current = {}
        runs[mode].append((requests, syncs, current))
    else:
        _, name, ticks, written = words
        if name.startswith("tokio-rt-worker") or name.startswith("audit-"):
            current[name] = (int(ticks) * 1e6 / hz / requests, int(written) / requests)
for mode, rows in runs.items():
    print(f"{mode}: {statistics.median(r[0] for r in rows):.0f} requests per round, "
          f"{statistics.median(r[0] / r[1] for r in rows if r[1]):.2f} records per journal sync (medians of {len(rows)})")
    names = sorted({name for _, _, threads in rows for name in threads})
    total = statistics.median(sum(us for us, _ in threads.values()) for _, _, threads in rows)
    for name in names:
        us = statistics.median(threads.get(name, (0, 0))[0] for _, _, threads in rows)
        written = statistics.median(threads.get(name, (0, 0))[1] for _, _, threads in rows)
        print(f"  {name:16} {us:7.1f} µs per request ({us / total:4.0%}), {written:7.0f} bytes written per request")
    print(f"  all threads        {total:7.1f} µs per request")
'
