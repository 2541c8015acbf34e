"""Decode under tensor parallelism: compressed caches against mlx-lm's own sharded run with fp16 caches.

    python benchmarks/distributed_decode.py --context 8192 --methods fp16,vq3 --out benchmarks/results/distributed-decode

World size 1 runs in one process, world size 2 as two ranks over the ring back end (`mlx.launch
--backend ring -n 2`). The model is a random llama of SmolLM2's body with 8 query and 4 KV heads (SmolLM2's 3 KV
heads do not split over 2 ranks), in float32 on the CPU. As in `cpu_decode.py`, each rank's caches are filled
with random keys/values of `--context` tokens (its own KV heads) instead of a prefill, then `--tokens` greedy
tokens are decoded, `--repeats` times, methods interleaved; medians reported. Per rank: cache bytes held
(`footprint`), decode tok/s, peak memory (`mx.get_peak_memory`, weights included).

It also prints the largest context that fits a memory per rank for the Llama-3.1-8B shape (32 layers, 8 KV heads
of dim 128, 8.03B bf16 weights split evenly) at world sizes 1, 2 and 4, from the bytes per token measured on one
layer of that shape filled with `--context` tokens. Writes distributed_decode.json and .md under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from veloxquant_mlx.evaluation.benchmark import decode  # noqa: E402
from veloxquant_mlx.evaluation import launcher  # noqa: E402
from veloxquant_mlx.evaluation.launcher import idle_stdin  # noqa: E402
from veloxquant_mlx.evaluation.specs import parse_method_list  # noqa: E402
from veloxquant_mlx.evaluation.shapes import write_random_model_folder  # noqa: E402
from veloxquant_mlx.footprint import footprint  # noqa: E402
from veloxquant_mlx.kvlayout import cache_arrays  # noqa: E402

LLAMA_8B = dict(layers=32, kv_heads=8, head_dim=128, params=8.03e9, weight_bytes=2, max_context=131072)
GIB = 2**30


def build_model_dir(target: Path) -> Path:
    """A random llama with SmolLM2's tokenizer and vocabulary, 30 layers of width 512, 8 heads, 4 KV heads."""
    if (target / "model.safetensors").is_file():
        return target
    return write_random_model_folder(target, dict(
        model_type="llama", hidden_size=512, num_hidden_layers=30, intermediate_size=1536, num_attention_heads=8,
        num_key_value_heads=4, rms_norm_eps=1e-5, max_position_embeddings=32768, tie_word_embeddings=True,
        rope_theta=100000.0))


def filled_caches(model, spec, context: int, seed: int):
    """`spec`'s caches for this rank's layers and heads, holding `context` random tokens."""
    caches = spec.make_caches(model)
    layer = model.layers[0].self_attn
    heads, dim = layer.n_kv_heads, layer.k_proj.weight.shape[0] // layer.n_kv_heads
    for i, cache in enumerate(caches):
        key = mx.random.key(seed * 1000 + i)
        k = mx.random.normal((1, heads, context, dim), key=key)
        v = mx.random.normal((1, heads, context, dim), key=mx.random.split(key)[0])
        for start in range(0, context, 2048):
            cache.update_and_fetch(k[..., start:start + 2048, :], v[..., start:start + 2048, :])
        mx.eval(cache_arrays([cache]))  # a compressed cache's `keys` would be a decoded copy
    return caches


def rank_main(args) -> None:
    """One rank (or the one process): decode with each method, write rankR.json."""
    from veloxquant_mlx.models import load_model

    group = mx.distributed.init()
    if group.size() > 1:
        model, _ = load_model(args.model_dir, group=group)
    else:
        model, _ = load_model(args.model_dir)
    specs = parse_method_list(args.methods)
    runs = {spec.label: [] for spec in specs}
    info = {}
    for repeat in range(args.repeats):
        for spec in specs:
            mx.synchronize()
            mx.clear_cache()
            mx.reset_peak_memory()
            caches = filled_caches(model, spec, args.context, repeat)
            y = mx.array([1])
            decode(model, caches, y, 1, lambda: None)  # untimed first step
            mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu))  # start together
            start = time.perf_counter()
            decode(model, caches, y, args.tokens, lambda: None)
            runs[spec.label].append(time.perf_counter() - start)
            held = footprint(caches)
            info[spec.label] = {"cache_bytes": held.held, "cache_allocated_bytes": held.allocated,
                                "bits_per_coordinate": held.bits, "peak_memory_bytes": mx.get_peak_memory()}
            del caches
    records = [{"method": label, **info[label], "decode_s": seconds,
                "decode_tokens_per_s": args.tokens / statistics.median(seconds)} for label, seconds in runs.items()]
    out = Path(args.rank_out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{group.rank()}.json").write_text(json.dumps({"rank": group.rank(), "size": group.size(),
                                                              "records": records}))


def launch(args, world_size: int, out: Path) -> list:
    """Run `rank_main` at `world_size`; each rank's result."""
    child = [str(Path(__file__).resolve()), "--rank", "--model-dir", str(args.model_dir), "--methods", args.methods,
             "--context", str(args.context), "--tokens", str(args.tokens), "--repeats", str(args.repeats),
             "--rank-out", str(out)]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if world_size == 1:
        command = [sys.executable, *child]
    else:
        command = launcher.command("--backend", "ring", "-n", world_size, "--python", sys.executable, *child)
    with idle_stdin() as stdin:
        result = subprocess.run(command, env=env, stdin=stdin, capture_output=True, text=True)
    files = [out / f"rank{r}.json" for r in range(world_size)]
    if not all(f.is_file() for f in files):
        raise RuntimeError(f"world size {world_size} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    return [json.loads(f.read_text()) for f in files]


def bytes_per_token(spec, context: int) -> float:
    """Held bytes per token of one Llama-3.1-8B layer (8 KV heads of dim 128) filled with `context` tokens."""
    heads, dim = LLAMA_8B["kv_heads"], LLAMA_8B["head_dim"]
    if spec.config is None:
        from mlx_lm.models.cache import KVCache

        cache = KVCache()
    else:
        from veloxquant_mlx.cache import CompressedKVCache

        cache = CompressedKVCache(spec.config)
    for start in range(0, context, 2048):
        n = min(2048, context - start)
        k = mx.random.normal((1, heads, n, dim), key=mx.random.key(start)).astype(mx.float16)
        v = mx.random.normal((1, heads, n, dim), key=mx.random.key(start + 1)).astype(mx.float16)
        cache.update_and_fetch(k, v)
        mx.eval(cache.state)
    return footprint([cache]).held / context


def context_table(specs, context: int, memory_gib: float) -> dict:
    """Largest context per world size that fits `memory_gib` per rank: bf16 weights split evenly, the rest KV."""
    rows = []
    per_token = {spec.label: bytes_per_token(spec, context) * LLAMA_8B["layers"] for spec in specs}
    for world in (1, 2, 4):
        free = memory_gib * GIB - LLAMA_8B["params"] * LLAMA_8B["weight_bytes"] / world
        row = {"world_size": world, "kv_bytes_per_rank": free}
        for label, whole in per_token.items():
            row[label] = max(int(free // (whole / world)), 0)
        rows.append(row)
    return {"memory_per_rank_gib": memory_gib, "bytes_per_token_whole_model": per_token, "rows": rows,
            "measured_at_context": context}


def markdown(result: dict) -> str:
    lines = [f"# Decode at {result['context']} tokens, tensor parallel on the CPU (ring back end)", "",
             f"Model: {result['model']}. Caches filled with random K/V of {result['context']} tokens on each rank (its "
             f"own KV heads); {result['tokens']} greedy tokens, median of {result['repeats']} interleaved runs. "
             f"`fp16` is mlx-lm's own `KVCache` on the same sharded model. Peak memory includes the weights. "
             f"{result.get('cpu_count')} CPU cores, load average {result.get('load_average_at_start', float('nan')):.1f} "
             f"at the start and {result.get('load_average_at_end', float('nan')):.1f} at the end (the ranks at world size "
             f"2 share the cores, and a load over the core count means they shared them with other work: compare "
             f"methods within one world size, not across).", "",
             "| world size | rank | method | cache MB held | bits/coord | decode tok/s | vs fp16 same world | peak MB |",
             "|---:|---:|---|---:|---:|---:|---:|---:|"]
    for world in result["worlds"]:
        for rank in world["ranks"]:
            base = next(r for r in rank["records"] if r["method"] == "fp16")["decode_tokens_per_s"]
            for r in rank["records"]:
                lines.append(f"| {world['size']} | {rank['rank']} | `{r['method']}` | {r['cache_bytes'] / 1e6:.2f} | "
                             f"{r['bits_per_coordinate']:.2f} | {r['decode_tokens_per_s']:.2f} | "
                             f"{r['decode_tokens_per_s'] / base:.2f}x | {r['peak_memory_bytes'] / 1e6:.0f} |")
    table = result["llama_3_1_8b"]
    labels = list(table["bytes_per_token_whole_model"])
    lines += ["", f"## Largest context per rank, Llama-3.1-8B shape, {table['memory_per_rank_gib']:g} GiB per rank", "",
              f"Bf16 weights (8.03B parameters) split evenly over the ranks, the rest of the memory for the KV cache "
              f"(no activations or runtime counted). Whole-model bytes per token, measured on one layer of the "
              f"shape filled with {table['measured_at_context']} random tokens, x 32 layers: "
              + ", ".join(f"`{k}` {v / 1024:.1f} KiB" for k, v in table["bytes_per_token_whole_model"].items())
              + f". The model's own limit is {LLAMA_8B['max_context']} tokens.", "",
              "| world size | KV GiB per rank | " + " | ".join(f"`{label}` tokens" for label in labels) + " |",
              "|---:|---:|" + "---:|" * len(labels)]
    for row in table["rows"]:
        lines.append(f"| {row['world_size']} | {row['kv_bytes_per_rank'] / GIB:.1f} | "
                     + " | ".join(f"{row[label]:,}" for label in labels) + " |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--methods", default="fp16,vq3")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--memory-gib", type=float, default=24.0, help="memory per rank of the Llama-3.1-8B table")
    parser.add_argument("--out", default="benchmarks/results/distributed-decode")
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank-out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--table-only", action="store_true", help="print the Llama-3.1-8B table only")
    args = parser.parse_args()
    if args.rank:
        return rank_main(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    specs = parse_method_list(args.methods)
    result = {"context": args.context, "tokens": args.tokens, "repeats": args.repeats, "platform": platform.platform(),
              "cpu_count": os.cpu_count(), "load_average_at_start": os.getloadavg()[0],
              "mlx": mx.__version__, "backend": "ring", "device": str(mx.default_device()),
              "model": "random llama, 30 layers, hidden 512, 8 heads, 4 KV heads of dim 64, float32", "worlds": []}
    if not args.table_only:
        args.model_dir = str(build_model_dir(Path(args.model_dir or out / "model")))
        for world in (1, 2):
            ranks = launch(args, world, out / f"world{world}")
            result["worlds"].append({"size": world, "ranks": ranks})
            print(f"world size {world}: " + "; ".join(
                f"rank {r['rank']} " + ", ".join(f"{x['method']} {x['decode_tokens_per_s']:.2f} tok/s "
                                                 f"{x['cache_bytes'] / 1e6:.2f} MB" for x in r["records"])
                for r in ranks), flush=True)
    result["load_average_at_end"] = os.getloadavg()[0]
    result["llama_3_1_8b"] = context_table(specs, args.context, args.memory_gib)
    text = markdown(result)
    (out / "distributed_decode.json").write_text(json.dumps(result, indent=1))
    (out / "distributed_decode.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
