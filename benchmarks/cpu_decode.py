"""Decode speed at a long context on the CPU, without a long prefill.

    python benchmarks/cpu_decode.py --context 8192 --methods fp16,turboquant_mse:3 --out results/cpu

Prefilling 8K tokens through a model on a small CPU takes minutes per run, and
decode speed depends only on the cache's shapes, so each layer's cache is
filled directly with random keys/values of `--context` tokens (the compressed
cache encodes them as it would after a prefill). Then `--tokens` tokens are
decoded greedily, mlx-lm style (the next step queued before the current one is
read), `--repeats` times per method, methods interleaved; the median is reported.
With `--interleave-every N` the methods' caches are filled once per repeat and take turns every N tokens, so a
machine whose speed drifts within a run (this 2-core VM's runs of one method spread by 30-50%) slows every method
alike; the tok/s is then the median over every block of N tokens.
Writes cpu_decode.json and cpu_decode.md under --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from veloxquant_mlx import kernels  # noqa: E402
from veloxquant_mlx.kvlayout import cache_arrays  # noqa: E402
from veloxquant_mlx.evaluation.benchmark import decode  # noqa: E402
from veloxquant_mlx.evaluation.specs import parse_method_list  # noqa: E402
from veloxquant_mlx.models import load_model  # noqa: E402


def filled_caches(model, spec, context: int, dtype, seed: int = 0):
    caches = spec.make_caches(model)
    for i, cache in enumerate(caches):
        n_kv = model.args.num_key_value_heads
        dim = getattr(model.args, "head_dim", None) or model.args.hidden_size // model.args.num_attention_heads
        key = mx.random.key(seed + i)
        k = mx.random.normal((1, n_kv, context, dim), key=key).astype(dtype)
        v = mx.random.normal((1, n_kv, context, dim), key=mx.random.split(key)[0]).astype(dtype)
        for start in range(0, context, 2048):
            cache.update_and_fetch(k[..., start:start + 2048, :], v[..., start:start + 2048, :])
        mx.eval(cache_arrays([cache]))  # a compressed cache's `keys` would be a decoded copy
        if hasattr(cache, "key_fields"):
            mx.eval(cache.key_fields, cache.value_fields)
    return caches


def decode_seconds(model, caches, tokens: int) -> float:
    """Seconds to decode `tokens` tokens greedily (the harness's loop), after one untimed step."""
    y = mx.array([1])
    decode(model, caches, y, 1, lambda: None)
    start = time.perf_counter()
    decode(model, caches, y, tokens, lambda: None)
    return time.perf_counter() - start


def prefill_seconds(model, spec, tokens: int, chunk: int, seed: int = 0) -> float:
    """Seconds to prefill `tokens` random tokens into fresh caches of `spec`, `chunk` at a time, each chunk
    evaluated before the next (as mlx-lm's generate_step does)."""
    caches = spec.make_caches(model)
    ids = mx.random.randint(0, model.args.vocab_size, (1, tokens), key=mx.random.key(seed))
    start = time.perf_counter()
    for at in range(0, tokens, chunk):
        model(ids[:, at:at + chunk], cache=caches)
        mx.eval([c.state for c in caches])
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--methods", default="fp16,turboquant_mse:3")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="results/cpu_decode")
    parser.add_argument("--dtype", default="as-loaded", choices=["as-loaded", "float16", "float32"],
                        help="activation dtype; the caches are filled in it (fp16 cache = this dtype)")
    parser.add_argument("--prefill", type=int, default=0,
                        help="also time a prefill of this many random tokens through the model (0: none)")
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--interleave-every", type=int, default=0,
                        help="take turns every N decoded tokens (caches filled once per repeat; 0: each method "
                             "decodes all --tokens in one run)")
    args = parser.parse_args()
    if args.interleave_every and args.prefill:
        parser.error("--interleave-every times decoding only; time --prefill in a run without it")
    model, _ = load_model(args.model)
    if args.dtype != "as-loaded":
        model.set_dtype(getattr(mx, args.dtype))
    dtype = model.model.embed_tokens.weight.dtype if hasattr(model, "model") else mx.float32
    if dtype not in (mx.float16, mx.bfloat16, mx.float32):
        dtype = mx.float32
    specs = parse_method_list(args.methods)
    runs = {s.label: [] for s in specs}
    prefills = {s.label: [] for s in specs}
    if args.interleave_every:
        for r in range(args.repeats):
            held = {spec.label: filled_caches(model, spec, args.context, dtype, seed=r) for spec in specs}
            for _ in range(args.tokens // args.interleave_every):
                for label, caches in held.items():
                    runs[label].append(decode_seconds(model, caches, args.interleave_every))
            del held
    else:
        for r in range(args.repeats):
            for spec in specs:
                caches = filled_caches(model, spec, args.context, dtype, seed=r)
                runs[spec.label].append(decode_seconds(model, caches, args.tokens))
                print(f"repeat {r} {spec.label}: {args.tokens / runs[spec.label][-1]:.2f} tok/s", flush=True)
                del caches
                if args.prefill:
                    prefills[spec.label].append(prefill_seconds(model, spec, args.prefill, args.prefill_chunk,
                                                                seed=r))
                    print(f"repeat {r} {spec.label}: prefill {args.prefill / prefills[spec.label][-1]:.1f} tok/s",
                          flush=True)
    unit = args.interleave_every or args.tokens  # tokens per timed run
    result = {
        "model": args.model, "activations": str(dtype), "context": args.context, "tokens": args.tokens, "repeats": args.repeats,
        "interleave_every": args.interleave_every,
        "device": str(mx.default_device()), "backend": kernels.backend(), "platform": platform.platform(),
        "processor": platform.processor(), "mlx": mx.__version__,
        "records": [{"method": k, "decode_s": v, "decode_tokens_per_s": unit / statistics.median(v),
                     **({"prefill_tokens": args.prefill, "prefill_chunk": args.prefill_chunk, "prefill_s": prefills[k],
                         "prefill_tokens_per_s": args.prefill / statistics.median(prefills[k])} if args.prefill else {})}
                    for k, v in runs.items()],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"_{str(dtype).split('.')[-1]}"
    (out / f"cpu_decode{tag}.json").write_text(json.dumps(result, indent=1))
    base = result["records"][0]["decode_tokens_per_s"]
    lines = [f"# Decode at {args.context} tokens, `{args.model}`, activations {dtype}, {result['device']} "
             f"({kernels.backend()} path)", "",
             f"Caches filled with random K/V of {args.context} tokens; {args.tokens} greedy tokens, median of "
             + (f"{args.repeats} interleaved runs." if not args.interleave_every else
                f"every block of {unit} tokens, the methods taking turns every {unit} tokens, caches filled "
                f"{args.repeats} times."),
             "", "| method | decode tok/s | vs first | "
             + ("runs (s) |" if not args.interleave_every else "blocks: min / median / max (s) |"),
             "|---|---:|---:|---|"]
    for rec in result["records"]:
        shown = rec["decode_s"] if not args.interleave_every else (
            min(rec["decode_s"]), statistics.median(rec["decode_s"]), max(rec["decode_s"]))
        lines.append(f"| `{rec['method']}` | {rec['decode_tokens_per_s']:.2f} | "
                     f"{rec['decode_tokens_per_s'] / base:.2f}x | {', '.join(f'{s:.2f}' for s in shown)} |")
    if args.prefill:
        first = result["records"][0]["prefill_tokens_per_s"]
        lines += ["", f"Prefill of {args.prefill} random tokens in chunks of {args.prefill_chunk}, median of "
                  f"{args.repeats} interleaved runs.", "", "| method | prefill tok/s | vs first | runs (s) |",
                  "|---|---:|---:|---|"]
        for rec in result["records"]:
            lines.append(f"| `{rec['method']}` | {rec['prefill_tokens_per_s']:.1f} | {rec['prefill_tokens_per_s'] / first:.2f}x "
                         f"| {', '.join(f'{s:.2f}' for s in rec['prefill_s'])} |")
    (out / f"cpu_decode{tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
