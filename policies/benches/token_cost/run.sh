#!/usr/bin/env bash
# Token cost of canarygate's canaries, counted with real tokenizers (OpenAI
# o200k_base via npm `gpt-tokenizer`, Llama 3 via npm `llama3-tokenizer-js`),
# today's format against the one it replaced, in the same run; then the high
# completion-token estimate against o200k_base, cl100k_base and Llama 3.
#
#   policies/benches/token_cost/run.sh
#
# Needs node (18+) and npm; installs the two tokenizers (pinned in
# package-lock.json) into policies/benches/token_cost/node_modules on first
# run. Exits non-zero when the targets are not met.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cd "$here/../../.."

if [ ! -d "$here/node_modules/gpt-tokenizer" ] || [ ! -d "$here/node_modules/llama3-tokenizer-js" ]; then
  npm ci --prefix "$here" --no-audit --no-fund --loglevel=error
fi
cargo run -q -p canarygate-policies --example token_cost_cases | node "$here/count.mjs"
echo
# The high estimate a cut at the client's max_tokens uses without a tokenizer_file.
cargo run -q -p canarygate-policies --example estimate_cases | node "$here/estimate.mjs"
