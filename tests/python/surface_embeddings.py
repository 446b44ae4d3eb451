"""The official openai SDK's embeddings call through canarygate.

Usage: surface_embeddings.py BASE_URL MODEL

Only the base URL differs from a job talking to OpenAI. The SDK asks for
base64 and decodes it (its default), so a vector arriving intact proves the
body passed through unchanged. Prints one JSON line.
"""

import json
import sys

import openai


def main() -> None:
    base_url, model = sys.argv[1], sys.argv[2]
    client = openai.OpenAI(base_url=base_url, api_key="sk-test-embeddings", max_retries=0)
    raw = client.embeddings.with_raw_response.create(model=model, input=["first text", "second"])
    result = raw.parse()
    print(
        json.dumps(
            {
                "vectors": len(result.data),
                "dimensions": len(result.data[0].embedding),
                "finite": all(value == value for value in result.data[0].embedding),
                "prompt_tokens": result.usage.prompt_tokens,
                "verdict": raw.headers.get("x-canarygate-verdict"),
            }
        )
    )


if __name__ == "__main__":
    main()
