"""The official anthropic SDK, unchanged but for its base URL, against
canarygate's Messages endpoint (tests/e2e/surface_messages.rs).

Every call's outcome is printed as one JSON object: what an honest answer,
a streamed one and the `messages.stream()` helper delivered, and which SDK
exception each failure raised, with its status and body.

usage: surface_messages.py BASE_URL LONG_TEXT
"""

import json
import sys
import urllib.error
import urllib.request

import anthropic

base_url, long_text = sys.argv[1:3]
SYSTEM = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]


def client(session="surface-messages", **options):
    return anthropic.Anthropic(
        base_url=base_url,
        api_key="sk-ant-surface-test",
        max_retries=0,
        timeout=60,
        default_headers={"x-canarygate-session": session},
        **options,
    )


def ask(model, text="Name the planets", max_tokens=200):
    # Greedy, so the local engine's answers can be compared (2.15.0 no longer
    # declares `temperature`: it goes as an extra field).
    return {
        "extra_body": {"temperature": 0},
        "model": model,
        "max_tokens": max_tokens,
        "system": SYSTEM,
        "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}],
    }


def failure(error):
    """What an SDK exception says."""
    return {
        "class": type(error).__name__,
        "status": getattr(error, "status_code", None),
        "body": getattr(error, "body", None),
    }


def plain(model, **kwargs):
    raw = client(**kwargs).messages.with_raw_response.create(**ask(model))
    message = raw.parse()
    return {
        "verdict": raw.headers.get("x-canarygate-verdict"),
        "served_by": raw.headers.get("x-canarygate-served-by"),
        "request_id": raw.headers.get("x-canarygate-request-id"),
        "id": message.id,
        "model": message.model,
        "types": [block.type for block in message.content],
        "text": "".join(block.text for block in message.content if block.type == "text"),
        "stop_reason": message.stop_reason,
        "input_tokens": message.usage.input_tokens,
        "output_tokens": message.usage.output_tokens,
    }


def streamed(model, text="Name the planets", max_tokens=200):
    """`messages.create(stream=True)`: every event, and the text deltas."""
    events, parts, stop_reason, output_tokens = [], [], None, None
    try:
        for event in client().messages.create(**ask(model, text, max_tokens), stream=True):
            events.append(event.type)
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                parts.append(event.delta.text)
            if event.type == "message_delta":
                stop_reason = event.delta.stop_reason
                output_tokens = event.usage.output_tokens
    except anthropic.APIError as error:
        return {"events": events, "text": "".join(parts), "error": failure(error)}
    return {
        "events": events,
        "text": "".join(parts),
        "stop_reason": stop_reason,
        "output_tokens": output_tokens,
    }


def helper(model, text="Name the planets", max_tokens=200):
    """The `messages.stream()` helper: `text_stream` and `get_final_message()`."""
    with client().messages.stream(**ask(model, text, max_tokens)) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    return {
        "text": text,
        "final_text": "".join(b.text for b in final.content if b.type == "text"),
        "model": final.model,
        "stop_reason": final.stop_reason,
        "output_tokens": final.usage.output_tokens,
    }


def raised(call):
    try:
        call()
    except anthropic.APIError as error:
        return failure(error)
    return {"class": None}


def raw_http(method, path, headers, body=None):
    """A request the SDK would not send: status and JSON body."""
    request = urllib.request.Request(
        base_url + path,
        data=None if body is None else json.dumps(body).encode(),
        headers={"content-type": "application/json", **headers},
        method=method,
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return {"status": response.status, "body": json.loads(response.read())}
    except urllib.error.HTTPError as error:
        return {"status": error.code, "body": json.loads(error.read())}


result = {
    "plain": plain("m-honest"),
    "stream": streamed("m-honest"),
    "helper": helper("m-honest"),
    "leak": raised(lambda: client().messages.create(**ask("m-truncate"))),
    "leak_stream": streamed("m-truncate"),
    "overloaded": raised(lambda: client().messages.create(**ask("m-overloaded"))),
    "overloaded_stream": streamed("m-overloaded", "Write a long story about the planets"),
    "other_api": raised(lambda: client().messages.create(**ask("m-openai"))),
    "no_key": raised(
        lambda: client().messages.create(**ask("m-honest"), extra_headers={"Authorization": anthropic.Omit()})
    ),
}
# The long prompt goes to the local engine (the route's trusted context is small).
raw = client().messages.with_raw_response.create(**ask("m-local", long_text, max_tokens=12))
message = raw.parse()
result["local"] = {
    "served_by": raw.headers.get("x-canarygate-served-by"),
    "model": message.model,
    "id": message.id,
    "text": "".join(b.text for b in message.content if b.type == "text"),
    "stop_reason": message.stop_reason,
    "output_tokens": message.usage.output_tokens,
    "stream": streamed("m-local", long_text, 12),
    "helper": helper("m-local", long_text, 12),
}
# Swap: the second request is answered from the first's context, another
# session's canaries in it.
client("swap-first").messages.create(**ask("m-swap", "Name three rivers"))
result["swap"] = raised(lambda: client("swap-second").messages.create(**ask("m-swap")))
# Thinking: the thinking block (and its signature) reaches the client, the
# echo does not.
with client().messages.stream(
    **ask("m-honest", max_tokens=3000), thinking={"type": "enabled", "budget_tokens": 1024}
) as stream:
    final = stream.get_final_message()
THINKING = {"type": "enabled", "budget_tokens": 1024}


def sent_back(message):
    """The next turn, carrying `message` back as the SDK gave it (thinking
    and signature included): the provider checks the signature."""
    request = ask("m-honest", max_tokens=3000) | {"thinking": THINKING}
    request["messages"] += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]},
        {"role": "user", "content": "And the moons?"},
    ]
    return raised(lambda: client().messages.create(**request))


plain_thinking = client().messages.create(**ask("m-honest", max_tokens=3000), thinking=THINKING)
result["thinking"] = {
    "types": [block.type for block in final.content],
    "thinking": "".join(b.thinking for b in final.content if b.type == "thinking"),
    "signature": "".join(b.signature for b in final.content if b.type == "thinking"),
    "text": "".join(b.text for b in final.content if b.type == "text"),
    "stream_sent_back": sent_back(final),
    "plain_sent_back": sent_back(plain_thinking),
}
# Tools (passive checks): the tool call's input, plain and accumulated from
# the stream's partial JSON.
weather = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
tool_request = ask("m-honest", "Use get_weather for Oslo") | {
    "tools": [weather],
    "tool_choice": {"type": "any"},
}
raw = client().messages.with_raw_response.create(**tool_request)
message = raw.parse()
with client().messages.stream(**tool_request) as stream:
    streamed_tool = stream.get_final_message()
result["tools"] = {
    "verdict": raw.headers.get("x-canarygate-verdict"),
    "stop_reason": message.stop_reason,
    "inputs": [b.input for b in message.content if b.type == "tool_use"],
    "stream_inputs": [b.input for b in streamed_tool.content if b.type == "tool_use"],
    "stream_stop_reason": streamed_tool.stop_reason,
}
# A prefill (the last turn is the assistant's, which the model continues) and
# a stop sequence that could end the reply at the echo's line break: passive
# checks, no echo asked.
prefill_request = ask("m-honest", "Name a planet as JSON")
prefill_request["messages"].append({"role": "assistant", "content": '{"planet":'})
raw = client().messages.with_raw_response.create(**prefill_request)
stop_request = ask("m-honest") | {"stop_sequences": ["\n"]}
raw_stop = client().messages.with_raw_response.create(**stop_request)
result["passive"] = {
    "prefill_verdict": raw.headers.get("x-canarygate-verdict"),
    "prefill_text": "".join(b.text for b in raw.parse().content if b.type == "text"),
    "stop_verdict": raw_stop.headers.get("x-canarygate-verdict"),
}
# The model's whole output cap (the sim's is 16,384, as gpt-4o's): the limit
# canarygate raises for the echo is refused, and the request goes again
# within the client's own.
raw = client().messages.with_raw_response.create(**ask("m-honest", max_tokens=16384))
result["output_cap"] = {
    "verdict": raw.headers.get("x-canarygate-verdict"),
    "stop_reason": raw.parse().stop_reason,
}
# The client's own limit, below what canarygate asked of the provider.
result["limit"] = {
    "plain": client().messages.create(**ask("m-honest", max_tokens=4)).model_dump(),
    "stream": streamed("m-honest", max_tokens=4),
}
# An older client's `x-api-key`, a wrong method, and a path nobody serves.
result["x_api_key"] = raw_http(
    "POST",
    "/v1/messages",
    {"x-api-key": "sk-ant-old-client", "anthropic-version": "2023-06-01"},
    {key: value for key, value in ask("m-honest").items() if key != "extra_body"},
)
result["get"] = raw_http("GET", "/v1/messages", {"x-api-key": "k"})
result["unknown"] = raw_http("POST", "/v1/messages/batches", {"x-api-key": "k"}, {})
result["bad_request"] = raised(
    lambda: client().messages.create(
        model="m-honest", max_tokens=5, messages=[{"role": "user", "content": 7}]
    )
)
# The beta surface with the query string the SDK's 0.x releases sent
# (`?beta=true`; 2.x marks it otherwise): verified like any other, and the
# query goes on to the provider.
raw = client().beta.messages.with_raw_response.create(
    **ask("m-honest"), extra_query={"beta": "true"}
)
result["beta"] = {
    "verdict": raw.headers.get("x-canarygate-verdict"),
    "text": "".join(b.text for b in raw.parse().content if b.type == "text"),
}
# The model list, every page of it (the SDK pages on while `has_more`).
result["models"] = [model.model_dump(mode="json") for model in client().models.list()]
result["model"] = client().models.retrieve("m-honest").model_dump(mode="json")
result["openai_models"] = raw_http("GET", "/v1/models", {"authorization": "Bearer sk-openai-surface"})
print(json.dumps(result))
