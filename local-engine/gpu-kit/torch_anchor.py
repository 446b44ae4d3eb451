"""PyTorch eager anchor of the GPU kit (scripts/gpu-kit.sh run).

Measures Hugging Face transformers' LlamaForCausalLM on the workload the engine was measured
on (speed-workload.json, written by `canarygate-gpu-kit speed`): the model is built from the
very config.json the engine loaded, with transformers' own random initialisation, directly on
the device in the workload's dtype, and runs in eager mode (no torch.compile, no CUDA graphs)
with transformers' default attention.

- prefill: one forward over the prompt with a fresh cache, logits of the last position only,
  as tokens/s (median of the repeats);
- decode: `batch` sequences of `decode_prompt` tokens, then `decode_steps` greedy steps of one
  token each, as tokens/s of all sequences together.

Writes anchor.json: {"status": "ok" | "skipped" | "failed", "reason", versions, "prefill",
"decode"}. Where torch (or, in a GPU run, CUDA) is missing it writes "skipped" and exits 0:
the anchor is reported, never required.
"""

import argparse
import inspect
import json
import statistics
import sys
import time
import traceback


def write(path, result):
    with open(path, "w") as f:
        json.dump(result, f, indent=2)


def sync(torch, device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def prompt(torch, batch, length, vocab, salt, device):
    """Deterministic token ids, like the engine's speed prompts (any ids do for timing)."""
    i = torch.arange(length, device=device)
    rows = [(i * 7919 + (salt + b) * 104729 + 11) % vocab for b in range(batch)]
    return torch.stack(rows)


def last_logits_argument(model):
    """transformers computes logits for every position unless told otherwise; the engine only
    computes the last one, so ask for that where the installed version allows it."""
    parameters = inspect.signature(model.forward).parameters
    for name in ("logits_to_keep", "num_logits_to_keep"):
        if name in parameters:
            return {name: 1}
    return {}


def measure(torch, transformers, workload):
    device = torch.device(workload["device"])
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[workload["dtype"]]
    config = transformers.LlamaConfig.from_pretrained(workload["model_dir"])
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.eval()
    vocab = config.vocab_size
    keep = last_logits_argument(model)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"anchor: {parameters / 1e9:.2f} B parameters, {dtype}, {device}, "
          f"attention {model.config._attn_implementation}, {keep or 'all logits'}",
          file=sys.stderr)

    def prefill_seconds(length, salt):
        ids = prompt(torch, 1, length, vocab, salt, device)
        sync(torch, device)
        started = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, **keep)
        out.logits[:, -1].argmax(-1).tolist()
        sync(torch, device)
        return time.perf_counter() - started

    def decode_tokens_per_s(batch, length, steps, salt):
        ids = prompt(torch, batch, length, vocab, salt, device)
        out = model(input_ids=ids, use_cache=True, **keep)
        cache = out.past_key_values
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        sync(torch, device)
        started = time.perf_counter()
        for _ in range(steps):
            out = model(input_ids=token, past_key_values=cache, use_cache=True, **keep)
            cache = out.past_key_values
            token = out.logits[:, -1].argmax(-1, keepdim=True)
        sync(torch, device)
        return batch * steps / (time.perf_counter() - started)

    result = {
        "parameters": parameters,
        "attn_implementation": model.config._attn_implementation,
        "logits": "last position" if keep else "every position",
        "prefill": [],
        "decode": [],
    }
    with torch.inference_mode():
        # Warm-up: kernels, allocator, cuBLAS handles.
        prefill_seconds(min(600, workload["prefill_lengths"][-1]), 99)
        decode_tokens_per_s(2, 16, 4, 99)
        for length in workload["prefill_lengths"]:
            seconds = [prefill_seconds(length, r) for r in range(workload["prefill_repeats"])]
            tokens_per_s = length / statistics.median(seconds)
            print(f"anchor prefill {length} tokens: {tokens_per_s:.0f} tokens/s", file=sys.stderr)
            result["prefill"].append(
                {"tokens": length, "seconds": seconds, "tokens_per_s": tokens_per_s})
        for batch in workload["decode_batches"]:
            tokens_per_s = decode_tokens_per_s(
                batch, workload["decode_prompt"], workload["decode_steps"], batch)
            print(f"anchor decode batch {batch}: {tokens_per_s:.1f} tokens/s", file=sys.stderr)
            result["decode"].append({"batch": batch, "tokens_per_s": tokens_per_s})
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", required=True, help="speed-workload.json")
    parser.add_argument("--out", required=True, help="anchor.json to write")
    args = parser.parse_args()
    with open(args.workload) as f:
        workload = json.load(f)
    started = time.perf_counter()
    try:
        import torch
        import transformers
    except ImportError as e:
        write(args.out, {"status": "skipped", "reason": f"torch or transformers is not importable ({e})"})
        return 0
    result = {"torch": torch.__version__, "transformers": transformers.__version__}
    if workload["device"] == "cuda" and not torch.cuda.is_available():
        write(args.out, {**result, "status": "skipped", "reason": "torch sees no CUDA device"})
        return 0
    try:
        result.update(measure(torch, transformers, workload))
        result["status"] = "ok"
    except Exception as e:  # the report says what failed; the run goes on
        traceback.print_exc()
        result.update({"status": "failed", "reason": f"{type(e).__name__}: {e}"})
    result["seconds"] = time.perf_counter() - started
    write(args.out, result)
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
