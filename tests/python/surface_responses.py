"""Drives canarygate's Responses API surface with the official openai SDK;
prints one JSON object of what it saw, for tests/e2e/surface_responses.rs.

usage: surface_responses.py BASE_URL

Models (routes of the test's policy): m-honest, m-reasoner (a reasoning
model), m-trunc (drops the head canary), m-swap (answers from the previous
request's context), m-overloaded (a stream fails half-way), m-local (served
by the local engine).
"""

import json
import re
import sys

import openai
from openai import OpenAI

CANARY = re.compile(r"CG[0-9A-Za-z]{6,}", re.IGNORECASE)

base_url = sys.argv[1]
client = OpenAI(base_url=base_url, api_key="sk-responses-test", max_retries=0, timeout=30)
result = {}


def check_clean(label, text):
    assert not CANARY.search(text or ""), f"{label}: a canary reached the client: {text!r}"


def failure(call):
    """The SDK error `call` raises, as a dict."""
    try:
        call()
    except openai.APIStatusError as error:
        return {
            "status": error.status_code,
            "code": error.code,
            "param": error.param,
            "message": error.message,
        }
    except openai.APIError as error:
        return {"status": None, "code": getattr(error, "code", None), "message": error.message}
    return None


# Plain.
raw = client.responses.with_raw_response.create(
    model="m-honest", instructions="Be brief.", input="Name the planets", max_output_tokens=40
)
response = raw.parse()
check_clean("plain", response.output_text)
check_clean("plain instructions", response.instructions)
result["plain"] = {
    "id": response.id,
    "status": response.status,
    "text": response.output_text,
    "instructions": response.instructions,
    "max_output_tokens": response.max_output_tokens,
    "input_tokens": response.usage.input_tokens,
    "output_tokens": response.usage.output_tokens,
    "verdict": raw.headers.get("x-canarygate-verdict"),
}

# The client's own instructions come back as it sent them: a ticket number
# shaped like a canary, and an empty text (not null).
result["instructions_back"] = [
    client.responses.create(model="m-honest", instructions=sent, input="Name the planets").instructions
    for sent in ["Ticket [CG123456789012345] is open; be terse.", ""]
]

# Streamed, raw events.
events = list(
    client.responses.create(
        model="m-honest",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Name the planets"}]}],
        stream=True,
    )
)
deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
done = [e.text for e in events if e.type == "response.output_text.done"]
final = events[-1]
assert final.type == "response.completed", [e.type for e in events]
check_clean("stream", deltas)
check_clean("stream final", json.dumps(final.response.model_dump()))
result["stream"] = {
    "types": [e.type for e in events],
    "sequence": [e.sequence_number for e in events],
    "deltas": deltas,
    "done": done,
    "final_text": final.response.output_text,
}

# The stream helper, with a reasoning model's summary.
with client.responses.stream(
    model="m-reasoner", input="Name the planets", reasoning={"summary": "auto"}
) as stream:
    helper_text, summary = [], []
    for event in stream:
        if event.type == "response.output_text.delta":
            helper_text.append(event.delta)
        elif event.type == "response.reasoning_summary_text.delta":
            summary.append(event.delta)
    final = stream.get_final_response()
check_clean("helper", final.output_text)
check_clean("helper summary", "".join(summary))
check_clean("helper final", json.dumps(final.model_dump()))
result["helper"] = {
    "deltas": "".join(helper_text),
    "final_text": final.output_text,
    "summary": "".join(summary),
    "final_summary": [
        part.text for item in final.output if item.type == "reasoning" for part in item.summary
    ],
}

# Two turns of a conversation the provider keeps.
first = client.responses.create(model="m-honest", input="Remember the word teal")
second = client.responses.create(
    model="m-honest", input="Which word did I ask you to remember?", previous_response_id=first.id
)
check_clean("second turn", second.output_text)
streamed_turn = "".join(
    e.delta
    for e in client.responses.create(
        model="m-honest", input="And once more?", previous_response_id=second.id, stream=True
    )
    if e.type == "response.output_text.delta"
)
check_clean("third turn", streamed_turn)
# Read back as the provider kept them: what the client sent and was
# delivered, canarygate's blocks and echo taken out.
kept_first = client.responses.retrieve(first.id)
kept_second = client.responses.retrieve(second.id)
for label, kept in [("first, read back", kept_first), ("second, read back", kept_second)]:
    check_clean(label, json.dumps(kept.model_dump()))
# A client's own canary-shaped ticket number stays in what it reads back.
TICKET = "Ticket [CG123456789012345] is open; be terse."
ticketed = client.responses.create(model="m-honest", instructions=TICKET, input="Status?")
kept_ticketed = client.responses.retrieve(ticketed.id)
result["conversation"] = {
    "ticket_kept": kept_ticketed.instructions == TICKET,
    "second": second.output_text,
    "third": streamed_turn,
    "read_back": [kept_first.output_text == first.output_text, kept_second.output_text == second.output_text],
    "read_back_instructions": [kept_first.instructions, kept_second.instructions],
}

# A bad shape: 400 naming the parameter, nothing sent upstream.
result["bad_input"] = failure(
    lambda: client.responses.create(model="m-honest", input=[{"role": "user", "content": 7}])
)

# A leak (the head canary dropped) and a foreign canary (a swapped context).
result["truncated"] = failure(
    lambda: client.responses.create(model="m-trunc", instructions="Be brief.", input="Name the rivers")
)
client.responses.create(model="m-swap", input="The payroll of Quenby")
result["swapped"] = failure(lambda: client.responses.create(model="m-swap", input="Name the rivers"))

# A failure after the stream began: the provider's own `error` and
# `response.failed` events, as it sent them (the SDK does not raise on them),
# the failed response's output edited like a completed one's.
failed_events = list(client.responses.create(model="m-overloaded", input="Name the planets", stream=True))
failed = failed_events[-1]
result["overloaded"] = {
    "types": [event.type for event in failed_events][-2:],
    "error_code": next(e.code for e in failed_events if e.type == "error"),
    "status": failed.response.status,
    "deltas": "".join(e.delta for e in failed_events if e.type == "response.output_text.delta"),
    "final_text": failed.response.output_text,
}

# Served by the local engine, whole and streamed. Greedy (temperature 0): the
# test model has random weights, and sampling at the default temperature can
# draw the end token first, an answer with no text.
raw = client.responses.with_raw_response.create(
    model="m-local", input="Name the planets", max_output_tokens=8, temperature=0
)
local = raw.parse()
with client.responses.stream(model="m-local", input="Name the planets", max_output_tokens=8, temperature=0) as stream:
    local_events = list(stream)
local_deltas = "".join(e.delta for e in local_events if e.type == "response.output_text.delta")
# At the limit the answer ends `incomplete`, as OpenAI's does (the helper's
# get_final_response() wants `completed`): the last event carries it.
local_final = local_events[-1].response
result["local"] = {
    "served_by": raw.headers.get("x-canarygate-served-by"),
    "id": local.id,
    "object": local.object,
    "status": local.status,
    "text": local.output_text,
    "output_tokens": local.usage.output_tokens,
    "stream_deltas": local_deltas,
    "stream_text": local_final.output_text,
    "stream_id": local_final.id,
}

print(json.dumps(result))
