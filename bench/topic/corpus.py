"""Question/answer pairs for the topic check's calibration, from two offline FAQs.

Usage: python3 corpus.py --python-faq DIR --debian-faq FILE [--seed N] > pairs.jsonl

  --python-faq  the Python FAQ's reStructuredText sources (python3.X-doc's html/_sources/faq)
  --debian-faq  the Debian FAQ as plain text (debian-faq's debian-faq.en.txt.gz)

Each question heading and the text under it is an honest pair (the answer cut to about
1500 characters, markup stripped; answers under 80 characters are skipped). Each corpus also
gets as many swapped pairs: the same answers under other questions of the same corpus, by a
seeded derangement (no answer stays with its own question). One JSON object per line:
{"corpus", "pair": "honest" | "swapped", "id", "question", "answer", "source"}.
"""

import argparse
import gzip
import json
import pathlib
import random
import re
import sys

MAX_ANSWER = 1500
MIN_ANSWER = 80


def clip(text):
    """Whitespace collapsed within paragraphs, cut at a word boundary near MAX_ANSWER."""
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text)]
    text = "\n\n".join(p for p in paragraphs if p)
    if len(text) <= MAX_ANSWER:
        return text
    cut = text.rfind(" ", 0, MAX_ANSWER)
    return text[: cut if cut > MAX_ANSWER // 2 else MAX_ANSWER]


# --- The Python FAQ (reStructuredText) -------------------------------------------------

HEADING_UNDERLINE = re.compile(r"^([=\-~^\"'`#*+])\1{2,}\s*$")


def strip_rst(text):
    lines = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith(".. "):
            continue  # directives, comments, link targets: their indented bodies stay as text
        if re.match(r"^:\w+:", stripped) and not stripped.startswith(":ref:"):
            continue  # field lists such as :tocdepth:
        lines.append(line)
    text = "\n".join(lines)
    text = re.sub(r":[\w:+-]+:`([^`<]*?)\s*<[^`>]*>`", r"\1", text)  # :role:`title <target>`
    text = re.sub(r":[\w:+-]+:`~?([^`]*)`", r"\1", text)  # :role:`target`
    text = re.sub(r"`([^`<]*?)\s*<[^`>]*>`__?", r"\1", text)  # `text <url>`_
    text = re.sub(r"``([^`]*)``", r"\1", text)
    text = re.sub(r"`([^`]*)`_{0,2}", r"\1", text)
    text = re.sub(r"\*\*([^*]+)\*\*|\*([^*\s][^*]*)\*", lambda m: m.group(1) or m.group(2), text)
    text = re.sub(r"::\s*$", ":", text, flags=re.M)
    return text


def python_faq(directory):
    pairs = []
    for path in sorted(pathlib.Path(directory).glob("*.rst.txt")):
        if path.name == "index.rst.txt":
            continue
        lines = path.read_text(encoding="utf-8").splitlines()
        # A heading is a line underlined by a line of one repeated punctuation mark.
        headings = [i for i in range(len(lines) - 1)
                    if lines[i].strip() and HEADING_UNDERLINE.match(lines[i + 1])
                    and len(lines[i + 1].strip()) >= len(lines[i].strip())]
        for n, start in enumerate(headings):
            question = lines[start].strip()
            if not question.endswith("?"):
                continue
            end = headings[n + 1] if n + 1 < len(headings) else len(lines)
            answer = clip(strip_rst("\n".join(lines[start + 2:end])))
            if len(answer) >= MIN_ANSWER:
                pairs.append({"question": question, "answer": answer, "source": f"faq/{path.name}"})
    return pairs


# --- The Debian FAQ (plain text) --------------------------------------------------------

SECTION = re.compile(r"^(\d+)\.(\d+)\.\s+(\S.*)$")


def debian_faq(path):
    with gzip.open(path, "rt", encoding="utf-8") if str(path).endswith(".gz") else open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    pairs = []
    i = 0
    # Section headings start at column 0 ("4.1. What ...?"), possibly continued on the next
    # unindented lines; the table of contents is indented, so it never matches.
    while i < len(lines):
        match = SECTION.match(lines[i])
        if not match:
            i += 1
            continue
        heading = [match.group(3).strip()]
        i += 1
        while i < len(lines) and lines[i].strip() and not lines[i].startswith(" "):
            heading.append(lines[i].strip())
            i += 1
        body = []
        while i < len(lines) and not SECTION.match(lines[i]) and not lines[i].startswith("Chapter "):
            body.append(lines[i])
            i += 1
        question = " ".join(heading)
        # Link targets printed after their text: "Debian (https://www.debian.org/)".
        answer = re.sub(r"\s*\(\s*https?://[^)]*\)", "", "\n".join(body))
        answer = clip(answer)
        if "?" in question and len(answer) >= MIN_ANSWER:
            pairs.append({"question": question, "answer": answer,
                          "source": f"section {match.group(1)}.{match.group(2)}"})
    return pairs


def derangement(n, rng):
    """Sattolo's shuffle: a single cycle, so no index maps to itself."""
    order = list(range(n))
    for i in range(n - 1, 0, -1):
        j = rng.randrange(i)
        order[i], order[j] = order[j], order[i]
    return order


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python-faq", required=True)
    parser.add_argument("--debian-faq", required=True)
    parser.add_argument("--seed", type=int, default=20)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    for corpus, pairs in (("python-faq", python_faq(args.python_faq)),
                          ("debian-faq", debian_faq(args.debian_faq))):
        if len(pairs) < 2:
            sys.exit(f"corpus.py: {corpus}: only {len(pairs)} pairs found")
        for n, pair in enumerate(pairs):
            print(json.dumps({"corpus": corpus, "pair": "honest", "id": n, **pair}, ensure_ascii=False))
        for n, other in enumerate(derangement(len(pairs), rng)):
            print(json.dumps({"corpus": corpus, "pair": "swapped", "id": n,
                              "question": pairs[n]["question"], "answer": pairs[other]["answer"],
                              "source": f"{pairs[n]['source']} / {pairs[other]['source']}"},
                             ensure_ascii=False))
        print(f"corpus.py: {corpus}: {len(pairs)} honest and {len(pairs)} swapped pairs", file=sys.stderr)


if __name__ == "__main__":
    main()
