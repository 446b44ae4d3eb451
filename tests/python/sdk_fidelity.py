"""What the official openai SDK reads through canarygate from a reasoning
model with logprobs, plain and streamed, how a 5-token limit holds, and what
a search model's citation annotations point at once the echo is removed;
prints one JSON object for tests/e2e/fidelity.rs to assert on.

usage: sdk_fidelity.py BASE_URL
"""

import json
import sys

from openai import OpenAI

base_url = sys.argv[1]
client = OpenAI(base_url=base_url, api_key="sk-sdk-fidelity", max_retries=0, timeout=30)
messages = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Why is the sky blue?"},
]
short = [{"role": "user", "content": "Tell me about the history of maps"}]
result = {}

completion = client.chat.completions.create(
    model="sim-reasoner", messages=messages, logprobs=True, top_logprobs=2
)
choice = completion.choices[0]
cut = client.chat.completions.create(model="reporter", messages=short, max_tokens=5)
result["plain"] = {
    # Not in the SDK's types: read from the extra fields it keeps.
    "reasoning": (choice.message.model_extra or {}).get("reasoning_content"),
    "content": choice.message.content,
    "logprob_tokens": "".join(entry.token for entry in choice.logprobs.content),
    "short_content": cut.choices[0].message.content,
    "short_completion_tokens": len(cut.choices[0].message.content.split()),
    "short_finish_reason": cut.choices[0].finish_reason,
}

reasoning, content, tokens = [], [], []
stream = client.chat.completions.create(
    model="sim-reasoner", messages=messages, logprobs=True, top_logprobs=2, stream=True
)
for chunk in stream:
    if not chunk.choices:
        continue
    delta = chunk.choices[0].delta
    extra = delta.model_extra or {}
    if extra.get("reasoning_content"):
        reasoning.append(extra["reasoning_content"])
    if delta.content:
        content.append(delta.content)
    if chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
        tokens.extend(entry.token for entry in chunk.choices[0].logprobs.content)

short_parts, short_finish = [], None
for chunk in client.chat.completions.create(
    model="reporter", messages=short, max_tokens=5, stream=True
):
    if chunk.choices and chunk.choices[0].delta.content:
        short_parts.append(chunk.choices[0].delta.content)
    if chunk.choices and chunk.choices[0].finish_reason:
        short_finish = chunk.choices[0].finish_reason
result["stream"] = {
    "reasoning": "".join(reasoning),
    "content": "".join(content),
    "logprob_tokens": "".join(tokens),
    "short_content": "".join(short_parts),
    "short_completion_tokens": len("".join(short_parts).split()),
    "short_finish_reason": short_finish,
}



def cited(content, annotations):
    """The text each url_citation annotation points at in `content`."""
    return [
        content[a.url_citation.start_index : a.url_citation.end_index] + " " + a.url_citation.title
        for a in annotations or []
    ]


# A search model cites its answer's last word; its indices count characters
# of the content as the provider wrote it, echo included.
search = {"model": "reporter", "messages": short, "web_search_options": {}}
message = client.chat.completions.create(**search).choices[0].message
streamed_content, streamed_annotations = [], []
for chunk in client.chat.completions.create(**search, stream=True):
    if chunk.choices:
        delta = chunk.choices[0].delta
        streamed_content.append(delta.content or "")
        streamed_annotations.extend((delta.model_extra or {}).get("annotations") or [])
streamed_text = "".join(streamed_content)
result["citations"] = {
    "plain": cited(message.content, message.annotations),
    "stream": [
        streamed_text[a["url_citation"]["start_index"] : a["url_citation"]["end_index"]]
        + " "
        + a["url_citation"]["title"]
        for a in streamed_annotations
    ],
}

print(json.dumps(result))
