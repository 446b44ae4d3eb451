"""Renders chat templates with Hugging Face transformers itself, the reference
the local engine's templates must match (tests/e2e/chat_templates.rs).

usage: chat_templates.py JOBS_JSON

JOBS_JSON holds a list of {"dir": MODEL_DIR, "messages": [...]}. Each model
directory is loaded with AutoTokenizer.from_pretrained and its template
rendered with apply_chat_template(messages, tokenize=False,
add_generation_prompt=True). Prints one JSON list, one entry per job:
{"ok": PROMPT} or {"error": "TYPE: MESSAGE"}.
"""

import json
import logging
import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
logging.disable(logging.WARNING)

from transformers import AutoTokenizer  # noqa: E402

jobs = json.load(open(sys.argv[1], encoding="utf-8"))
results = []
for job in jobs:
    try:
        tokenizer = AutoTokenizer.from_pretrained(job["dir"])
        prompt = tokenizer.apply_chat_template(
            job["messages"], tokenize=False, add_generation_prompt=True
        )
        results.append({"ok": prompt})
    except Exception as error:  # the template's own refusal is a result too
        results.append({"error": f"{type(error).__name__}: {error}"})
print(json.dumps(results, ensure_ascii=False))
