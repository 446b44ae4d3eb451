"""An independent reference for the topic crate's Embedder: BERT and mean pooling in numpy.

Usage: python reference_minilm.py MODEL_DIR < texts.json > embeddings.json

Reads the weights with safetensors' numpy API and tokenizes with the `tokenizers` package
(truncation at the directory's max_seq_length, no padding: one text at a time), then runs the
encoder in float64 and mean-pools over the tokens, normalising when modules.json says so.
Written from the BERT paper's equations, not from candle's code.
"""

import json
import math
import pathlib
import sys

import numpy as np
from safetensors.numpy import load_file
from tokenizers import Tokenizer


def erf(x):
    # Abramowitz & Stegun 7.1.26: |error| < 1.5e-7, enough for a 1e-4 comparison.
    sign = np.sign(x)
    x = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * x)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    return sign * (1.0 - poly * np.exp(-x * x))


def gelu(x):
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def layer_norm(x, weight, bias, eps):
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * weight + bias


def main():
    model_dir = pathlib.Path(sys.argv[1])
    config = json.loads((model_dir / "config.json").read_text())
    max_len = json.loads((model_dir / "sentence_bert_config.json").read_text()).get("max_seq_length", 256)
    modules = json.loads((model_dir / "modules.json").read_text())
    normalize = any(m["type"].endswith("Normalize") for m in modules)
    w = {name: t.astype(np.float64) for name, t in load_file(str(model_dir / "model.safetensors")).items()}
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=max_len)

    heads = config["num_attention_heads"]
    hidden = config["hidden_size"]
    head_dim = hidden // heads
    eps = config["layer_norm_eps"]

    def linear(x, name):
        return x @ w[name + ".weight"].T + w[name + ".bias"]

    out = []
    for text in json.load(sys.stdin):
        encoding = tokenizer.encode(text)
        ids = np.array(encoding.ids)
        types = np.array(encoding.type_ids)
        n = len(ids)
        x = (w["embeddings.word_embeddings.weight"][ids]
             + w["embeddings.position_embeddings.weight"][np.arange(n)]
             + w["embeddings.token_type_embeddings.weight"][types])
        x = layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)
        for i in range(config["num_hidden_layers"]):
            p = f"encoder.layer.{i}."
            # [n, hidden] -> [heads, n, head_dim]
            q, k, v = (linear(x, p + "attention.self." + part).reshape(n, heads, head_dim).transpose(1, 0, 2)
                       for part in ("query", "key", "value"))
            scores = q @ k.transpose(0, 2, 1) / math.sqrt(head_dim)  # [heads, n, n]
            scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
            attention = scores / scores.sum(axis=-1, keepdims=True)
            context = (attention @ v).transpose(1, 0, 2).reshape(n, hidden)
            x = layer_norm(x + linear(context, p + "attention.output.dense"),
                           w[p + "attention.output.LayerNorm.weight"], w[p + "attention.output.LayerNorm.bias"], eps)
            inner = gelu(linear(x, p + "intermediate.dense"))
            x = layer_norm(x + linear(inner, p + "output.dense"),
                           w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"], eps)
        pooled = x.mean(axis=0)
        if normalize:
            pooled = pooled / max(np.linalg.norm(pooled), 1e-12)
        out.append({"tokens": n, "embedding": pooled.tolist()})
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
