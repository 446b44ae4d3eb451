"""Legacy completions through canarygate with the official openai SDK, only the
base URL changed; prints what it saw as one JSON object
(tests/e2e/surface_completions.rs).

usage: surface_completions.py BASE_URL LONG_PROMPT

Models (routes of the test's policy): m-honest, m-truncate (drops the head of
the prompt), m-swap (answers from the previous request's context), m-overloaded
(fails mid-stream), m-local (over its trusted context: served locally).
"""

import json
import sys

import openai
from openai import OpenAI

base_url, long_prompt = sys.argv[1:3]
client = OpenAI(base_url=base_url, api_key="sk-sdk-test", max_retries=0, timeout=60)
result = {}


def error_of(call):
    """The SDK's exception for `call`, as a dict, or None when it succeeded."""
    try:
        call()
    except openai.APIStatusError as error:
        body = error.body if isinstance(error.body, dict) else {}
        return {
            "status": error.status_code,
            "code": body.get("code"),
            "param": body.get("param"),
            "failed_checks": body.get("failed_checks"),
            "message": str(error),
        }
    return None


def choice_of(choice):
    seen = {"index": choice.index, "text": choice.text, "finish_reason": choice.finish_reason}
    if choice.logprobs:
        seen["tokens"] = choice.logprobs.tokens
        seen["text_offset"] = choice.logprobs.text_offset
    return seen


# Plain, one prompt.
raw = client.completions.with_raw_response.create(
    model="m-honest", prompt="Name the planets of the inner system", max_tokens=40
)
completion = raw.parse()
result["plain"] = {
    "verdict": raw.headers.get("x-canarygate-verdict"),
    "served_by": raw.headers.get("x-canarygate-served-by"),
    "object": completion.object,
    "choices": [choice_of(choice) for choice in completion.choices],
    "prompt_tokens": completion.usage.prompt_tokens,
    "completion_tokens": completion.usage.completion_tokens,
}

# A list of prompts, two choices each: prompt-major indices.
completion = client.completions.create(
    model="m-honest",
    prompt=["Count the moons of Mars", "List three rivers"],
    n=2,
    max_tokens=30,
    logprobs=1,
)
result["list"] = [choice_of(choice) for choice in completion.choices]

# Streamed, with the usage chunk asked for; and without it.
stream = client.completions.create(
    model="m-honest",
    prompt="Describe the harbour at dawn",
    max_tokens=40,
    stream=True,
    stream_options={"include_usage": True},
    logprobs=1,
)
parts, finish, usage, objects, tokens, offsets = [], None, None, set(), [], []
for chunk in stream:
    objects.add(chunk.object)
    for choice in chunk.choices:
        parts.append(choice.text)
        finish = choice.finish_reason or finish
        if choice.logprobs:
            tokens.extend(choice.logprobs.tokens)
            offsets.extend(choice.logprobs.text_offset)
    if chunk.usage:
        usage = chunk.usage.completion_tokens
result["stream"] = {
    "text": "".join(parts),
    "finish_reason": finish,
    "completion_tokens": usage,
    "objects": sorted(objects),
    "tokens": tokens,
    "text_offset": offsets,
}
usage_chunks = 0
for chunk in client.completions.create(
    model="m-honest", prompt="Describe the harbour at dusk", max_tokens=20, stream=True
):
    usage_chunks += chunk.usage is not None
result["stream_usage_chunks_unasked"] = usage_chunks

# What cannot carry canaries is a 400 naming the field.
result["echo_refused"] = error_of(
    lambda: client.completions.create(model="m-honest", prompt="Hi", echo=True)
)
result["token_ids_refused"] = error_of(
    lambda: client.completions.create(model="m-honest", prompt=[1, 2, 3])
)

# A provider that lost the head of the prompt is blocked.
result["truncated"] = error_of(
    lambda: client.completions.create(model="m-truncate", prompt="Say hi", max_tokens=20)
)

# A provider answering from another request's context: the second request
# gets the first one's canaries.
result["swap_first"] = error_of(
    lambda: client.completions.create(model="m-swap", prompt="First job", max_tokens=20)
)
result["swap_second"] = error_of(
    lambda: client.completions.create(model="m-swap", prompt="Second job", max_tokens=20)
)

# A stream that fails after it began ends with an error event the SDK raises.
seen = []
try:
    for chunk in client.completions.create(
        model="m-overloaded",
        prompt="Tell the long story of the lighthouse keeper and the storm",
        max_tokens=60,
        stream=True,
    ):
        seen.extend(choice.text for choice in chunk.choices)
    result["overloaded"] = {"raised": None, "text": "".join(seen)}
except openai.APIError as error:
    result["overloaded"] = {"raised": type(error).__name__, "message": str(error),
                            "text": "".join(seen)}

# Over the provider's trusted context: the local engine answers, plain and streamed.
raw = client.completions.with_raw_response.create(
    model="m-local", prompt=long_prompt, max_tokens=8, temperature=0
)
completion = raw.parse()
result["local"] = {
    "served_by": raw.headers.get("x-canarygate-served-by"),
    "reason": raw.headers.get("x-canarygate-local-reason"),
    "object": completion.object,
    "id": completion.id,
    "choices": [choice_of(choice) for choice in completion.choices],
    "completion_tokens": completion.usage.completion_tokens,
}
raw = client.completions.with_raw_response.create(
    model="m-local", prompt=long_prompt, max_tokens=8, temperature=0, stream=True
)
parts, finish, objects = [], None, set()
for chunk in raw.parse():
    objects.add(chunk.object)
    for choice in chunk.choices:
        parts.append(choice.text)
        finish = choice.finish_reason or finish
result["local_stream"] = {
    "served_by": raw.headers.get("x-canarygate-served-by"),
    "text": "".join(parts),
    "finish_reason": finish,
    "objects": sorted(objects),
}
result["local_list_refused"] = error_of(
    lambda: client.completions.create(model="m-local", prompt=[long_prompt, long_prompt])
)

print(json.dumps(result))
