#!/usr/bin/env bash
# A nightly job that asks an LLM through canarygate with plain curl.
#
#   OPENAI_BASE_URL  canarygate's address (default http://127.0.0.1:8787/v1)
#   OPENAI_API_KEY   your provider key; canarygate forwards it (passthrough auth)
#                    or checks it against its client keys (managed auth)
#   JOB_SESSION      optional label that separates this job's session from others
#
# Prints the answer; exits non-zero on any HTTP or API error, so cron mails you.
set -euo pipefail

base_url="${OPENAI_BASE_URL:-http://127.0.0.1:8787/v1}"
: "${OPENAI_API_KEY:?set OPENAI_API_KEY}"
model="${JOB_MODEL:-gpt-4o-mini}"
prompt="${1:-Summarise the deploy log of yesterday in three bullet points.}"

body=$(python3 -c 'import json,sys; print(json.dumps({"model": sys.argv[1], "messages": [{"role": "user", "content": sys.argv[2]}]}))' "$model" "$prompt")

headers=(-H "Authorization: Bearer ${OPENAI_API_KEY}" -H "Content-Type: application/json")
if [ -n "${JOB_SESSION:-}" ]; then
  headers+=(-H "x-canarygate-session: ${JOB_SESSION}")
fi

# --dump-header: the response headers (x-canarygate-request-id, x-canarygate-session)
# go to stderr, i.e. the job's log, so an answer can be traced in the audit log.
response=$(curl --silent --show-error --fail-with-body --max-time 300 \
  "${headers[@]}" --dump-header /dev/stderr \
  -d "$body" "${base_url}/chat/completions")

python3 -c 'import json,sys; print(json.loads(sys.stdin.read())["choices"][0]["message"]["content"])' <<<"$response"
