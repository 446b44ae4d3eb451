#!/usr/bin/env bash
# The test command: installs what the tests need, then runs every test.
#
# Needs: a Rust toolchain and python3 (3.9+). Creates .venv with the openai SDK
# (pinned in scripts/requirements-test.txt) on first run.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c 'import openai' 2>/dev/null; then
  python3 -m venv .venv
  .venv/bin/pip install --quiet --disable-pip-version-check -r scripts/requirements-test.txt
fi
export CANARYGATE_PYTHON="$PWD/.venv/bin/python"

cargo test --workspace "$@"
