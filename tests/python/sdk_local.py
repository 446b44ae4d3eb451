"""Sends one request, plain and streamed, through canarygate with the official
openai SDK and prints what it saw as one JSON object (tests/e2e/local_fallback.rs).

usage: sdk_local.py BASE_URL MODEL TEXT
"""

import json
import sys

from openai import OpenAI

base_url, model, text = sys.argv[1:4]
client = OpenAI(base_url=base_url, api_key="sk-sdk-test", max_retries=0, timeout=60)
messages = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": text},
]
result = {}

raw = client.chat.completions.with_raw_response.create(
    model=model, messages=messages, max_tokens=12, temperature=0
)
completion = raw.parse()
result["plain"] = {
    "served_by": raw.headers.get("x-canarygate-served-by"),
    "reason": raw.headers.get("x-canarygate-local-reason"),
    "request_id": completion._request_id,
    "canarygate_request_id": raw.headers.get("x-canarygate-request-id"),
    "model": completion.model,
    "content": completion.choices[0].message.content,
    "finish_reason": completion.choices[0].finish_reason,
    "prompt_tokens": completion.usage.prompt_tokens,
    "completion_tokens": completion.usage.completion_tokens,
}

raw = client.chat.completions.with_raw_response.create(
    model=model,
    messages=messages,
    max_tokens=12,
    temperature=0,
    stream=True,
    stream_options={"include_usage": True},
)
parts, usage, finish, streamed_model = [], None, None, None
for chunk in raw.parse():
    streamed_model = chunk.model
    if chunk.choices:
        if chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        if chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    if chunk.usage:
        usage = chunk.usage.completion_tokens
result["stream"] = {
    "served_by": raw.headers.get("x-canarygate-served-by"),
    "reason": raw.headers.get("x-canarygate-local-reason"),
    "model": streamed_model,
    "content": "".join(parts),
    "finish_reason": finish,
    "completion_tokens": usage,
}

print(json.dumps(result))
