#!/usr/bin/env bash
# The test command: installs what the tests need, then runs every test.
#
# Needs: a Rust toolchain and python3 (3.9+). Creates .venv with the openai SDK
# (pinned in scripts/requirements-test.txt) on first run. Extra arguments go to
# `cargo test` (e.g. `scripts/test.sh --test proxy_e2e`).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c 'import openai' 2>/dev/null; then
  python3 -m venv .venv
  .venv/bin/pip install --quiet --disable-pip-version-check -r scripts/requirements-test.txt
fi
export CANARYGATE_PYTHON="$PWD/.venv/bin/python"

log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
cargo test --workspace "$@" 2>&1 | tee "$log" || status=$?

# One closing line over every test binary (cargo prints one per binary).
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($i ~ /^passed;?$/) p += $(i-1); if ($i ~ /^failed;?$/) f += $(i-1) } }
     END { printf "%d passed, %d failed\n", p, f }' "$log"
exit "$status"
