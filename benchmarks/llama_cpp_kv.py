"""llama.cpp's quantized KV caches as a peer: perplexity and KL of each cache type against llama.cpp's own
f16 cache, on the same GGUF and the same token windows as `veloxquant eval ppl`.

    python benchmarks/llama_cpp_kv.py --text ../shared/data/wikitext2-test.txt --ctx 2048 --windows 2 \
        --caches f16,q8_0,q4_0,q4_0:norot,q8_0/q4_0 --out benchmarks/results/quality-table-llama-cpp

A cache is `K[/V][:norot]` with ggml type names (f16, q8_0, q4_0, q4_1, q5_0, q5_1). llama.cpp rotates the
keys and values of quantized caches by a Hadamard transform by default; `:norot` sets LLAMA_ATTN_ROT_DISABLE
for that run (the plain q4_0 of older releases). Windows are fed in chunks of `--chunk` tokens (one llama.cpp
batch each) and the second half of each window is scored, as `veloxquant eval ppl` does; the tokens are the
ones `eval ppl` reads (the model's tokenizer, no BOS). Bits per coordinate come from ggml's block layouts
(e.g. q4_0: 32 codes of 4 bits and one fp16 scale per block, 4.5 bits). Needs `llama_cpp` (llama-cpp-python);
its models are created with use_extra_bufts=False (the AMX path crashes on some CPUs).
"""

import argparse
import math
import os
import time
from pathlib import Path

import numpy as np

from veloxquant_mlx.evaluation.results import write_json_and_markdown
from veloxquant_mlx.texts import load_text, tokenize_prefix
from veloxquant_mlx.models import gemma3_gguf_path, smollm2_gguf_path

# ggml block layouts: (bytes per block, values per block)
BLOCKS = {"f16": (2, 1), "q8_0": (34, 32), "q4_0": (18, 32), "q4_1": (20, 32), "q5_0": (22, 32), "q5_1": (24, 32)}


def parse_cache(text: str) -> dict:
    types, _, flag = text.partition(":")
    if flag not in ("", "norot"):
        raise ValueError(f"{text!r}: the only flag is ':norot'")
    key, _, value = types.partition("/")
    value = value or key
    for name in (key, value):
        if name not in BLOCKS:
            raise ValueError(f"{text!r}: unknown ggml type {name!r}; known: {', '.join(BLOCKS)}")
    bits = lambda name: 8 * BLOCKS[name][0] / BLOCKS[name][1]  # noqa: E731
    return {"cache": text, "type_k": key, "type_v": value, "rotation": flag != "norot" and key != "f16",
            "bits_per_coord": (bits(key) + bits(value)) / 2}


def log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    top = logits.max(-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


def window_logprobs(llm, window: list, chunk: int) -> np.ndarray:
    """Log-probabilities of the second half's next tokens after feeding `window` chunk by chunk."""
    llm.reset()
    llm._ctx.kv_cache_clear()
    for start in range(0, len(window), chunk):
        llm.eval(window[start:start + chunk])
    first = len(window) // 2
    return log_softmax(np.array(llm.scores[first:len(window) - 1]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", required=True)
    parser.add_argument("--model", default="smollm2", choices=("smollm2", "gemma3-270m"),
                        help="the embedded GGUF models: SmolLM2-135M (Q4_1) or Gemma 3 270M (Q4_K_M)")
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--skip-tokens", type=int, default=0)
    parser.add_argument("--caches", default="f16,q8_0,q4_0,q4_0:norot,q8_0/q4_0")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import llama_cpp
    from llama_cpp import Llama

    caches = [parse_cache(c) for c in args.caches.split(",")]
    if caches[0]["cache"] != "f16":
        caches.insert(0, parse_cache("f16"))
    from veloxquant_mlx.models import load_model

    _, tokenizer = load_model(args.model)
    ids = tokenize_prefix(tokenizer, load_text(args.text), args.skip_tokens + args.ctx * args.windows)
    ids = ids[args.skip_tokens:]
    windows = [ids[w * args.ctx:(w + 1) * args.ctx] for w in range(args.windows)]
    gguf = smollm2_gguf_path() if args.model == "smollm2" else gemma3_gguf_path()

    tallies = {c["cache"]: {"nll": [], "kl": [], "agree": [], "seconds": 0.0} for c in caches}
    reference = []
    for cache in caches:
        if cache["rotation"]:
            os.environ.pop("LLAMA_ATTN_ROT_DISABLE", None)
        else:
            os.environ["LLAMA_ATTN_ROT_DISABLE"] = "1"
        llm = Llama(model_path=str(gguf), n_ctx=args.ctx, n_batch=args.chunk, n_ubatch=args.chunk,
                    logits_all=True, flash_attn=True, verbose=False, use_extra_bufts=False,
                    n_threads=args.threads, n_threads_batch=args.threads,
                    type_k=getattr(llama_cpp, f"GGML_TYPE_{cache['type_k'].upper()}"),
                    type_v=getattr(llama_cpp, f"GGML_TYPE_{cache['type_v'].upper()}"))
        tally = tallies[cache["cache"]]
        for w, window in enumerate(windows):
            start = time.perf_counter()
            logprobs = window_logprobs(llm, window, args.chunk)
            tally["seconds"] += time.perf_counter() - start
            targets = np.array(window[len(window) // 2 + 1:])
            tally["nll"].append(-logprobs[np.arange(len(targets)), targets])
            if cache["cache"] == "f16":
                reference.append(logprobs)
            ref = reference[w]
            tally["kl"].append((np.exp(ref) * (ref - logprobs)).sum(-1))
            tally["agree"].append(logprobs.argmax(-1) == ref.argmax(-1))
            print(f"{cache['cache']} window {w + 1}/{len(windows)}: {tally['seconds']:.0f} s", flush=True)
        del llm
    os.environ.pop("LLAMA_ATTN_ROT_DISABLE", None)

    records = []
    base_ppl = None
    for cache in caches:
        tally = tallies[cache["cache"]]
        nll, kl = np.concatenate(tally["nll"]), np.concatenate(tally["kl"])
        ppl = math.exp(nll.mean())
        base_ppl = base_ppl or ppl
        records.append({**cache, "perplexity": ppl, "delta_ppl": ppl / base_ppl - 1, "kl_mean": float(kl.mean()),
                        "kl_p99": float(np.quantile(kl, 0.99)),
                        "top1_agreement": float(np.concatenate(tally["agree"]).mean()),
                        "scored_tokens": int(nll.shape[0]), "seconds": round(tally["seconds"], 1)})
    result = {"command": "python benchmarks/llama_cpp_kv.py", "args": vars(args), "gguf": gguf.name,
              "llama_cpp_version": llama_cpp.__version__, "records": records}
    lines = [f"llama.cpp {llama_cpp.__version__} on `{gguf.name}`, {Path(args.text).name}: {args.windows} window(s) "
             f"of {args.ctx} tokens from token {args.skip_tokens}, chunks of {args.chunk}, second half scored. "
             "ΔPPL, KL and top-1 are against llama.cpp's own f16 cache; bits from ggml's block layouts.", "",
             "| cache (K/V) | Hadamard rotation | bits/coord | PPL | ΔPPL | KL mean | KL p99 | top-1 |",
             "|---|---|---|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['type_k']}/{r['type_v']} | {'yes' if r['rotation'] else 'no'} | {r['bits_per_coord']:.2f} "
                     f"| {r['perplexity']:.2f} | {100 * r['delta_ppl']:+.2f}% | {r['kl_mean']:.4f} | {r['kl_p99']:.4f} "
                     f"| {100 * r['top1_agreement']:.1f}% |")
    write_json_and_markdown(args.out, result, lines)


if __name__ == "__main__":
    main()
