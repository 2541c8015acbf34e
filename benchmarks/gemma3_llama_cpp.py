"""Gemma 3 270M: the GGUF import against llama.cpp on the same file (perplexity, greedy text).

    python benchmarks/gemma3_llama_cpp.py --text ../shared/data/wikitext2-test.txt --tokens 512 \
        --out benchmarks/results/gemma3-llama-cpp

Needs `llama_cpp` (llama-cpp-python) besides the `gemma3` extra. Writes results.json and results.md.
"""

import argparse
import json
import math
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm import generate

from veloxquant_mlx.models import gemma3_gguf_path, load_model


def perplexity(logits: np.ndarray, tokens: list) -> float:
    logits = logits.astype(np.float64)
    top = logits.max(-1, keepdims=True)
    logprobs = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    return math.exp(-logprobs[np.arange(len(tokens) - 1), tokens[1:]].mean())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", required=True, help="text file; its start is scored")
    parser.add_argument("--tokens", type=int, default=512, help="tokens scored (default 512)")
    parser.add_argument("--prompt", default="The capital of France is", help="greedy-decoding prompt")
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens decoded greedily (default 24)")
    parser.add_argument("--out", required=True, help="results folder")
    args = parser.parse_args()
    from llama_cpp import Llama

    text = Path(args.text).read_text(encoding="utf-8")[: 12 * args.tokens]
    model, tokenizer = load_model("gemma3-270m")
    ours_ids = tokenizer.encode(text)[: args.tokens + 1]
    ours_logits = np.array(model(mx.array(ours_ids[:-1])[None]).astype(mx.float32)[0])
    ours_text = generate(model, tokenizer, args.prompt, max_tokens=args.max_tokens)

    # The AMX buffer types crash on some CPUs: the plain CPU path.
    llm = Llama(model_path=str(gemma3_gguf_path()), n_ctx=args.tokens + 64, logits_all=True, verbose=False,
                use_extra_bufts=False)
    ref_ids = llm.tokenize(text.encode(), add_bos=True, special=False)[: args.tokens + 1]
    llm.eval(ref_ids[:-1])
    ref_logits = np.array(llm.scores[: len(ref_ids) - 1])
    llm.reset()
    ref_text = llm(args.prompt, max_tokens=args.max_tokens, temperature=0.0)["choices"][0]["text"]

    shared = 0
    while shared < min(len(ours_text), len(ref_text)) and ours_text[shared] == ref_text[shared]:
        shared += 1
    record = {
        "tokens_scored": len(ours_ids) - 1,
        "same_token_ids": ours_ids == ref_ids,
        "perplexity_veloxquant": perplexity(ours_logits, ours_ids),
        "perplexity_llama_cpp": perplexity(ref_logits, ref_ids),
        "last_logits_max_abs_diff": float(np.abs(ours_logits[-1] - ref_logits[-1]).max()),
        "prompt": args.prompt,
        "greedy_veloxquant": ours_text,
        "greedy_llama_cpp": ref_text,
        "greedy_shared_prefix": ours_text[:shared],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n")
    lines = [
        f"Gemma 3 270M Q4_K_M, first {record['tokens_scored']} tokens of `{Path(args.text).name}`: "
        f"same token ids: {record['same_token_ids']}.",
        "",
        "| runtime | perplexity |",
        "|---|---|",
        f"| veloxquant (mlx-lm gemma3_text, float32 weights from `gguf`) | {record['perplexity_veloxquant']:.3f} |",
        f"| llama.cpp (`llama_cpp`, same GGUF) | {record['perplexity_llama_cpp']:.3f} |",
        "",
        f"Greedy continuation of {args.prompt!r}: veloxquant {ours_text!r}; llama.cpp {ref_text!r}; "
        f"shared prefix {ours_text[:shared]!r}.",
    ]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
