"""Drives canarygate with the official openai SDK; prints one JSON object of
what it saw, for tests/e2e/openai_sdk.rs to assert on.

usage: sdk_client.py BASE_URL MODEL UNKNOWN_MODEL
"""

import json
import sys

import openai
from openai import OpenAI

base_url, model, unknown_model = sys.argv[1:4]
client = OpenAI(base_url=base_url, api_key="sk-sdk-test", max_retries=0, timeout=30)
messages = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name the planets"},
]
result = {}

raw = client.chat.completions.with_raw_response.create(model=model, messages=messages, max_tokens=12)
completion = raw.parse()
result["plain"] = {
    "content": completion.choices[0].message.content,
    "finish_reason": completion.choices[0].finish_reason,
    "prompt_tokens": completion.usage.prompt_tokens,
    "completion_tokens": completion.usage.completion_tokens,
    "request_id": raw.headers.get("x-canarygate-request-id"),
    "session": raw.headers.get("x-canarygate-session"),
    "verdict": raw.headers.get("x-canarygate-verdict"),
}

stream = client.chat.completions.create(
    model=model, messages=messages, stream=True, stream_options={"include_usage": True}
)
parts, usage = [], None
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        parts.append(chunk.choices[0].delta.content)
    if chunk.usage:
        usage = chunk.usage.completion_tokens
result["stream"] = {"content": "".join(parts), "completion_tokens": usage}

# Stored completions (`store: true`), read back as the client sent them and
# was delivered them: the provider kept canarygate's blocks and the echo.
stored = client.chat.completions.create(
    model=model, messages=messages, max_tokens=200, store=True, metadata={"job": "sdk-test"}
)
kept = client.chat.completions.retrieve(stored.id)
kept_messages = client.chat.completions.messages.list(stored.id)
listed = client.chat.completions.list(metadata={"job": "sdk-test"})
updated = client.chat.completions.update(stored.id, metadata={"job": "sdk-test", "seen": "yes"})
deleted = client.chat.completions.delete(stored.id)
result["stored"] = {
    "content": stored.choices[0].message.content,
    "kept": kept.choices[0].message.content,
    "messages": [{"role": m.role, "content": m.content} for m in kept_messages.data],
    "listed": [c.choices[0].message.content for c in listed.data],
    "updated": [updated.choices[0].message.content, updated.metadata],
    "deleted": deleted.deleted,
    "raw": " ".join(
        json.dumps(page.model_dump()) for page in [kept, kept_messages, listed, updated]
    ),
}

try:
    client.chat.completions.create(model=unknown_model, messages=messages)
    result["error"] = None
except openai.APIStatusError as error:
    result["error"] = {"status": error.status_code, "code": error.code, "message": error.message}

print(json.dumps(result))
