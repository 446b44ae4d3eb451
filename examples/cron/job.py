#!/usr/bin/env python3
"""A nightly job that asks an LLM through canarygate with the official openai SDK.

canarygate is a drop-in: the only change from talking to the provider directly
is OPENAI_BASE_URL (default here: http://127.0.0.1:8787/v1). The SDK reads
OPENAI_API_KEY as usual. Set JOB_STREAM=1 to stream the answer.
"""

import os
import sys

from openai import OpenAI


def main() -> int:
    client = OpenAI(
        base_url=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8787/v1"),
        default_headers={"x-canarygate-session": os.environ.get("JOB_SESSION", "nightly-report")},
        max_retries=0,
    )
    model = os.environ.get("JOB_MODEL", "gpt-4o-mini")
    prompt = sys.argv[1] if len(sys.argv) > 1 else "Summarise the deploy log of yesterday in three bullet points."
    messages = [{"role": "user", "content": prompt}]

    if os.environ.get("JOB_STREAM") == "1":
        stream = client.chat.completions.create(model=model, messages=messages, stream=True)
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                print(chunk.choices[0].delta.content, end="", flush=True)
        print()
    else:
        raw = client.chat.completions.with_raw_response.create(model=model, messages=messages)
        completion = raw.parse()
        print(completion.choices[0].message.content)
        print(f"request id: {raw.headers.get('x-canarygate-request-id')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
