"""The official openai and anthropic SDKs against the simulated provider,
unchanged but for the base URL: every surface, plain and streamed, its
helpers, and the errors each SDK raises. Run by sim/tests/sdk.rs; exits
non-zero on the first broken expectation.

Usage: sdk_surfaces.py BASE_URL  (the sim's root, e.g. http://127.0.0.1:9000)
"""

import json
import math
import sys

import anthropic
import openai

BASE = sys.argv[1]
OPENING = "ALPHA-1"
SYSTEM = f'Begin your reply with "{OPENING}" and then answer.'
QUESTION = "Plan the harbour survey"


def openai_client(mode=None):
    headers = {"x-sim-mode": mode} if mode else None
    return openai.OpenAI(base_url=BASE + "/v1", api_key="sk-test", max_retries=0, default_headers=headers)


def anthropic_client(mode=None):
    headers = {"x-sim-mode": mode} if mode else None
    return anthropic.Anthropic(base_url=BASE, api_key="sk-ant-test", max_retries=0, default_headers=headers)


def expect(condition, what):
    if not condition:
        raise SystemExit(f"FAILED: {what}")


def raises(kind, call):
    try:
        call()
    except kind as error:
        return error
    raise SystemExit(f"FAILED: expected {kind.__name__}")


results = {}
client = openai_client()
claude = anthropic_client()

# Responses: plain, streamed raw, the stream helper, stored and continued.
response = client.responses.create(model="sim-model", instructions=SYSTEM, input=QUESTION)
expect(response.status == "completed", response.status)
expect(response.output_text.startswith(f"{OPENING} You wrote: {QUESTION}"), response.output_text)
expect(response.usage.input_tokens > 10 and response.usage.output_tokens > 10, response.usage)
kinds = [event.type for event in client.responses.create(
    model="sim-reasoner", instructions=SYSTEM, input=QUESTION, stream=True, reasoning={"summary": "auto"})]
expect(kinds[:2] == ["response.created", "response.in_progress"], kinds[:2])
expect(kinds[-1] == "response.completed", kinds[-1])
expect("response.reasoning_summary_text.delta" in kinds, kinds)
with client.responses.stream(model="sim-model", instructions=SYSTEM, input=QUESTION) as stream:
    deltas = "".join(event.delta for event in stream if event.type == "response.output_text.delta")
    final = stream.get_final_response()
expect(final.output_text == deltas and deltas.startswith(OPENING), (final.output_text, deltas))
tools = [{"type": "function", "name": "get_weather",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
with client.responses.stream(model="sim-model", input="use get_weather for Oslo", tools=tools) as stream:
    call = stream.get_final_response().output[0]
expect(call.type == "function_call" and json.loads(call.arguments)["city"], call)
later = client.responses.create(model="sim-model", input="and then?", previous_response_id=response.id)
expect(later.usage.input_tokens > response.usage.input_tokens, later.usage)
expect(client.responses.retrieve(response.id).output_text == response.output_text, "retrieve")
client.responses.delete(response.id)
raises(openai.NotFoundError, lambda: client.responses.retrieve(response.id))
results["responses"] = "ok"

# Legacy completions, whole and streamed.
completion = client.completions.create(model="sim-model", prompt=["chart the reef", "log the buoys"], n=2,
                                       max_tokens=60, logprobs=2)
expect([choice.index for choice in completion.choices] == [0, 1, 2, 3], completion.choices)
expect(completion.choices[2].text.startswith("You wrote: log the buoys"), completion.choices[2].text)
expect(completion.choices[0].logprobs.tokens, completion.choices[0].logprobs)
chunks = list(client.completions.create(model="sim-model", prompt=SYSTEM + "\n\n" + QUESTION, stream=True,
                                        stream_options={"include_usage": True}))
text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
expect(text.startswith(OPENING), text)
expect(chunks[-1].usage.completion_tokens == 16, chunks[-1].usage)
results["completions"] = "ok"

# Embeddings: the SDK asks for base64 by default and decodes it.
embedded = client.embeddings.create(model="sim-embed", input=["the harbour survey", "a reef chart"])
vector = embedded.data[0].embedding
expect(len(embedded.data) == 2 and len(vector) == 1536, len(vector))
expect(abs(math.sqrt(sum(x * x for x in vector)) - 1) < 1e-4, "unit length")
floats = client.embeddings.create(model="sim-embed", input="the harbour survey", encoding_format="float")
expect(all(abs(a - b) < 1e-6 for a, b in zip(floats.data[0].embedding, vector)), "base64 = float")
expect(len(client.embeddings.create(model="sim-embed", input="x", dimensions=64).data[0].embedding) == 64, "dims")
results["embeddings"] = "ok"

# Anthropic Messages: plain, streamed raw, the stream helper, tools, counting.
message = claude.messages.create(model="sim-model", max_tokens=300, system=SYSTEM,
                                 messages=[{"role": "user", "content": QUESTION}])
expect(message.stop_reason == "end_turn", message.stop_reason)
expect(message.content[0].text.startswith(f"{OPENING} You wrote: {QUESTION}"), message.content[0].text)
expect(message.usage.input_tokens > 10, message.usage)
kinds = [event.type for event in claude.messages.create(
    model="sim-model", max_tokens=300, system=SYSTEM, messages=[{"role": "user", "content": QUESTION}], stream=True)]
expect(kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds)
with claude.messages.stream(model="sim-model", max_tokens=2000, system=SYSTEM,
                            thinking={"type": "enabled", "budget_tokens": 1024},
                            messages=[{"role": "user", "content": QUESTION}]) as stream:
    streamed = "".join(stream.text_stream)
    final = stream.get_final_message()
expect([block.type for block in final.content] == ["thinking", "text"], final.content)
expect(final.content[0].signature and OPENING in final.content[0].thinking, final.content[0])
expect(final.content[1].text == streamed and streamed.startswith(OPENING), streamed)
tools = [{"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
with claude.messages.stream(model="sim-model", max_tokens=300, tools=tools,
                            messages=[{"role": "user", "content": "use get_weather please"}]) as stream:
    used = stream.get_final_message()
expect(used.stop_reason == "tool_use" and used.content[0].input["city"], used)
counted = claude.messages.count_tokens(model="sim-model", system=SYSTEM,
                                       messages=[{"role": "user", "content": QUESTION}])
expect(counted.input_tokens == message.usage.input_tokens, (counted, message.usage))
results["messages"] = "ok"

# The errors each SDK raises, per surface.
raises(openai.RateLimitError, lambda: openai_client("rate-limited").responses.create(model="m", input="hi"))
raises(openai.RateLimitError, lambda: openai_client("rate-limited").embeddings.create(model="m", input="hi"))
raises(anthropic.RateLimitError, lambda: anthropic_client("rate-limited").messages.create(
    model="m", max_tokens=10, messages=[{"role": "user", "content": "hi"}]))
raises(anthropic.OverloadedError, lambda: anthropic_client("overloaded").messages.create(
    model="m", max_tokens=10, messages=[{"role": "user", "content": "hi"}]))
raises(openai.InternalServerError, lambda: openai_client("overloaded").responses.create(model="m", input="hi"))


def stream_messages_overloaded():
    with anthropic_client("overloaded").messages.stream(
            model="m", max_tokens=100, messages=[{"role": "user", "content": "hello there"}]) as stream:
        for _ in stream.text_stream:
            pass


error = raises(anthropic.APIStatusError, stream_messages_overloaded)
expect(error.body["error"]["type"] == "overloaded_error", error.body)
raises(openai.APIError, lambda: list(openai_client("overloaded").completions.create(
    model="m", prompt="hello there", stream=True)))
failed = [event.type for event in openai_client("overloaded").responses.create(model="m", input="hi", stream=True)]
expect(failed[-2:] == ["error", "response.failed"], failed[-2:])
results["errors"] = "ok"

print(json.dumps(results))
