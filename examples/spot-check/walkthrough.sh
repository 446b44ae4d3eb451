#!/usr/bin/env bash
# Spot-check walkthrough: traffic through `canarygate serve`, then the audit
# log read back, verified, reviewed and summarised with `canarygate audit`.
#
#   CANARYGATE_BIN   the canarygate binary (default: target/debug/canarygate)
#   WORK_DIR         where to keep the policy, data dir and logs (default: a new
#                    temporary directory, removed on exit unless KEEP_WORK_DIR=1)
#
# Needs curl and python3. Starts two simulated providers (one honest, one that
# silently drops the head of every prompt) and one proxy on free local ports;
# stops all of them on exit, also on error or Ctrl-C.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
bin="${CANARYGATE_BIN:-$root/target/debug/canarygate}"
[ -x "$bin" ] || { echo "no canarygate binary at $bin (cargo build, or set CANARYGATE_BIN)" >&2; exit 2; }

if [ -n "${WORK_DIR:-}" ]; then
  work="$WORK_DIR"; mkdir -p "$work"
else
  work="$(mktemp -d)"
fi
data="$work/data"
pids=() # every process this script started
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  echo "stopped ${#pids[@]} processes"
  if [ -z "${WORK_DIR:-}" ] && [ "${KEEP_WORK_DIR:-0}" != 1 ]; then rm -rf "$work"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

step() { printf '\n== %s\n' "$*"; }

# start VAR NAME ARGS...: runs `canarygate ARGS...` in the background (logs in
# $work/NAME.out and .err) and sets VAR to the URL from its first line
# ("... listening on http://127.0.0.1:PORT"). Not called in $(...), so the pid
# lands in this shell's `pids` and the exit trap stops it.
start() {
  local var="$1" name="$2"; shift 2
  CANARYGATE_LOG=warn "$bin" "$@" >"$work/$name.out" 2>"$work/$name.err" &
  local pid="$!" url=""
  pids+=("$pid")
  for _ in $(seq 1 100); do
    url="$(grep -o -m 1 'http://[0-9.:]*' "$work/$name.out" 2>/dev/null || true)"
    [ -n "$url" ] && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  if [ -z "$url" ]; then echo "$name did not start:" >&2; cat "$work/$name.err" >&2; return 1; fi
  printf -v "$var" '%s' "$url"
}

audit() { "$bin" audit --data "$data" "$@"; }

step "1. start two simulated providers and canarygate serve (sample_rate = 1.0)"
start honest sim-honest sim-provider --listen 127.0.0.1:0
start truncating sim-truncating sim-provider --listen 127.0.0.1:0 --mode truncate-head
cat >"$work/policy.toml" <<TOML
[[providers]]
name = "honest"
base_url = "$honest/v1"
context_window = 128000

[[providers]]
name = "truncating"
base_url = "$truncating/v1"
context_window = 128000

[[routes]]
model = "flaky-model"
provider = "truncating"

[[routes]]
model = "*"
provider = "honest"

[verify]
echo = "head+tail"
action = "block"

# Keep every request's text for review (the default keeps 2% of passed
# requests and every failed one).
[audit]
sample_rate = 1.0
TOML
start proxy serve serve --listen 127.0.0.1:0 --data "$data" --config "$work/policy.toml"
echo "proxy: $proxy  data: $data"

step "2. send traffic: two answers, one stream, one answer the proxy blocks"
ask() { # ask MODEL STREAM TEXT: prints the HTTP status and the request id
  local body
  body=$(python3 -c 'import json,sys; print(json.dumps({"model": sys.argv[1], "stream": sys.argv[2] == "true", "messages": [{"role": "user", "content": sys.argv[3]}]}))' "$1" "$2" "$3")
  curl --silent --show-error --max-time 30 -o "$work/last-body" -D "$work/last-headers" \
    -w '%{http_code}' -H 'Authorization: Bearer sk-walkthrough' \
    -H 'Content-Type: application/json' -H 'x-canarygate-session: walkthrough' \
    -d "$body" "$proxy/v1/chat/completions" >"$work/last-status"
  local id
  id="$(tr -d '\r' <"$work/last-headers" | awk 'tolower($1) == "x-canarygate-request-id:" { print $2 }')"
  echo "status $(cat "$work/last-status") request $id ($1, stream=$2)"
}
ask small-model false "Summarise yesterday's deploy log in one line."
ask small-model false "Name the three largest ledger entries."
ask small-model true "Stream a short status report for the nightly job."
ask flaky-model false "Which invoices are overdue?"

step "3. export the log as JSON Lines (one record per line)"
audit export >"$work/audit.jsonl"
echo "$(wc -l <"$work/audit.jsonl") records exported to audit.jsonl; the first one:"
head -n 1 "$work/audit.jsonl"

step "4. verify the hash chain"
audit verify

step "5. list the samples nobody has reviewed yet"
# A request record with a sample and no review record pointing at it. Prints
# "ID VERDICT REQUEST_ID" per line.
unreviewed() {
  audit export | python3 -c '
import json, sys
records = [json.loads(line) for line in sys.stdin]
reviewed = {r["reviewed_id"] for r in records if r["kind"] == "review"}
for r in records:
    if r["kind"] == "request" and r["sample"] and r["id"] not in reviewed:
        print(r["id"], r["verdict"], r["request_id"])
'
}
pending="$(unreviewed)"
echo "$pending"
audit tail -n 10

step "6. look at each sample and record a review (non-interactive)"
while read -r id verdict request_id; do
  [ -n "$id" ] || continue
  # The start of the sample's response text (awk reads all of it: no SIGPIPE).
  audit show "$id" | awk '/^--- response text ---$/ { on = 1 } on && shown < 5 { print; shown++ }'
  if [ "$verdict" = fail ]; then
    audit spot-check --mark "$id" bad --note "blocked by the proxy: the answer does not fit the prompt ($request_id)"
  else
    audit spot-check --mark "$id" ok --note "answer fits the prompt ($request_id)"
  fi
done <<<"$pending"
echo "unreviewed samples left: $(unreviewed | grep -c . || true)"

step "7. verify again: the reviews are chained records too"
audit verify

step "8. statistics"
audit stats
