"""Prompt-cache file sizes: `veloxquant cache-prompt` against mlx-lm's fp16 prompt cache of the same document.

Ours: `prompt_cache.cache_prompt` (what `veloxquant cache-prompt` runs) per configuration.
mlx-lm's: the same tokens through mlx-lm's own `KVCache`s, saved by mlx-lm's `save_prompt_cache`
with `mlx_lm.cache_prompt`'s metadata. mlx-lm's loader keeps the default model's Q4 weights with
float16 activations, so its caches hold float16; this script prefills with the project's float32
model (mlx-lm's Q4 CPU path is far slower) and casts the keys and values to float16 before saving:
the same shapes and dtype, so the same file size, as `mlx_lm.cache_prompt` writes.

    python benchmarks/prompt_cache_size.py --document DOC --configs vq4,vq3,turboquant_mse:3 \
        --out benchmarks/results/prompt-cache-smollm2-cpu
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache, save_prompt_cache

from veloxquant_mlx.cli import build_parser, config_from_args
from veloxquant_mlx.evaluation.results import write_json_and_markdown
from veloxquant_mlx.models import load_model
from veloxquant_mlx.prompt_cache import cache_prompt, document_tokens, prefill


def kv_config(name: str):
    argv = ["cache-prompt", "--prompt-file", "-", "--out", "-"]
    argv += ["--kv", name] if ":" not in name else ["--method", name.split(":")[0], "--bits", name.split(":")[1]]
    return config_from_args(build_parser().parse_args(argv))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="model (default: smollm2)")
    parser.add_argument("--document", required=True, help="text file to cache (required)")
    parser.add_argument("--configs", default="vq4,vq3,turboquant_mse:3", help="our caches (default: vq4,vq3,turboquant_mse:3)")
    parser.add_argument("--out", required=True, help="results folder (required)")
    args = parser.parse_args()

    model, tokenizer = load_model(args.model)
    text = Path(args.document).read_text()
    tokens = document_tokens(tokenizer, text)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        caches = [KVCache() for _ in model.layers]
        prefill(model, caches, tokens)
        for cache in caches:
            cache.keys, cache.values = cache.keys.astype(mx.float16), cache.values.astype(mx.float16)
        path = Path(tmp) / "mlx_lm.safetensors"
        save_prompt_cache(str(path), caches, {"model": args.model, "tokenizer_config": json.dumps({})})
        rows.append({"cache": "mlx-lm KVCache (float16)", "bytes": os.path.getsize(path)})
        for name in args.configs.split(","):
            config = kv_config(name)
            path = Path(tmp) / f"{name.replace(':', '_')}.safetensors"
            written = cache_prompt(model, tokenizer, text, config, path, args.model)
            rows.append({"cache": config.describe(), "preset": name, "bytes": os.path.getsize(path),
                         "used_bytes": sum(c.used_nbytes for c in written["caches"])})
            print(rows[-1], flush=True)
    base = rows[0]["bytes"]
    meta = {"model": args.model, "document": Path(args.document).name, "tokens": len(tokens),
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    lines = [f"Prompt-cache files for one document of {len(tokens)} tokens, model `{args.model}` ({meta['when']}).", "",
             "| cache | file MB | vs mlx-lm |", "|---|---|---|"]
    lines += [f"| {r['cache']} | {r['bytes'] / 1e6:.3f} | {base / r['bytes']:.2f}x smaller |" for r in rows]
    write_json_and_markdown(args.out, {"meta": meta, "rows": rows}, lines)


if __name__ == "__main__":
    main()
