#!/usr/bin/env bash
# Local fallback walkthrough: a provider trusted with 2,000 tokens of context,
# canarygate in front of it with a local engine, and two requests: a short one
# the provider answers, a long one the local engine answers (nothing of it is
# sent upstream). Then the provider goes away and a short request is served
# locally too. The audit log shows which route served each request.
#
#   CANARYGATE_BIN   the canarygate binary (default: target/debug/canarygate)
#   WORK_DIR         where to keep the model, policy, data dir and logs (default:
#                    a new temporary directory, removed on exit)
#
# Needs curl and python3. Uses a tiny random model (its answers are word salad:
# the point is where they come from) and a simulated provider on free local
# ports; stops everything it started on exit.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
bin="${CANARYGATE_BIN:-$root/target/debug/canarygate}"
[ -x "$bin" ] || { echo "no canarygate binary at $bin (cargo build, or set CANARYGATE_BIN)" >&2; exit 2; }

if [ -n "${WORK_DIR:-}" ]; then work="$WORK_DIR"; mkdir -p "$work"; else work="$(mktemp -d)"; fi
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  if [ -z "${WORK_DIR:-}" ]; then rm -rf "$work"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

step() { printf '\n== %s\n' "$*"; }

# start VAR NAME ARGS...: runs `canarygate ARGS...` in the background and sets
# VAR to the URL of its first line ("... listening on http://127.0.0.1:PORT").
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

# ask TEXT: one chat request; prints who served it and the start of the answer.
ask() {
  local body
  body=$(python3 -c 'import json,sys; print(json.dumps({"model": "reporter", "max_tokens": 16,
    "messages": [{"role": "user", "content": sys.argv[1]}]}))' "$1")
  curl --silent --show-error --max-time 120 --dump-header "$work/headers" \
    -H "Authorization: Bearer sk-example" -H "Content-Type: application/json" \
    -d "$body" "$proxy/v1/chat/completions" >"$work/answer.json"
  local status served reason
  status=$(head -1 "$work/headers" | cut -d' ' -f2)
  served=$(grep -i '^x-canarygate-served-by:' "$work/headers" | tr -d '\r' | cut -d' ' -f2)
  reason=$(grep -i '^x-canarygate-local-reason:' "$work/headers" | tr -d '\r' | cut -d' ' -f2 || true)
  python3 - "$status" "$served" "${reason:--}" "$work/answer.json" <<'PY'
import json, sys
status, served, reason, path = sys.argv[1:5]
answer = json.load(open(path))
if status != "200":
    sys.exit(f"HTTP {status}: {answer}")
content = answer["choices"][0]["message"]["content"]
print(f"HTTP {status}  served-by={served}  reason={reason}  model={answer['model']}")
print(f"  answer: {content[:70]!r}")
PY
}

step "1. a tiny local model, a simulated provider, canarygate with the example policy"
"$bin" engine init-tiny --word-tokenizer --context 8192 "$work/model" 2>/dev/null
start provider sim sim-provider --listen 127.0.0.1:0 --context-window 8192
sed -e "s#@BASE_URL@#$provider/v1#" -e "s#@MODEL_DIR@#$work/model#" \
  "$here/policy.toml" >"$work/policy.toml"
start proxy serve serve --listen 127.0.0.1:0 --data "$work/data" --config "$work/policy.toml"
echo "provider $provider, canarygate $proxy"

step "2. a short request: within the 2,000 trusted tokens, the provider answers"
ask "Summarise the deploy log of yesterday."

step "3. a long request (~3,000 tokens): over the trusted limit, the local engine answers"
ask "$(python3 -c 'print("Review this incident timeline: " + " ".join(["the river survey was open in spring"] * 430))')"

step "4. the provider goes away: the local engine answers"
kill "${pids[0]}"; wait "${pids[0]}" 2>/dev/null || true
ask "Summarise the deploy log of yesterday."

step "5. the audit log: route and action of each request"
"$bin" audit --data "$work/data" export | python3 -c '
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print("{request_id}  route={route:<8} action={action:<8} outcome={outcome}".format(**r))'
echo
echo "local fallback example: ok"
