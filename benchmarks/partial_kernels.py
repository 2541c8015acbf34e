"""The turboquant_mse decode partial kernels alone, on the GPU: the fp32 SIMT `mse_partial`
against the tensor-core `mse_partial_mma`, next to fp16 SDPA over the same tokens.

    python benchmarks/partial_kernels.py --out results/gpu/NAME [--shapes 1x4096,1x32768,1x131072,8x16384]

One layer of the Llama-3.1-8B shape (32 query heads, 8 kv heads, d = 128, fp16 queries),
`turboquant_mse:3:vbits=4` codes (29 words per token and kv head). For each shape
(batch x tokens) and split size, microseconds per call (median of `--rounds` rounds; a
round calls each kernel once on each of `--layers` distinct caches, so the codes come from
memory, not L2) and the bandwidth at which the call reads its codes, against the device's
measured copy bandwidth. Writes partial_kernels.json and partial_kernels.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from veloxquant_mlx.cache import CompressedKVCache  # noqa: E402
from veloxquant_mlx.config import KVCacheConfig  # noqa: E402
from veloxquant_mlx.kernels import ops  # noqa: E402
from veloxquant_mlx.settings import EngineSettings  # noqa: E402

KV_HEADS, Q_HEADS, DIM = 8, 32, 128


def seconds_per_call(fn, calls: int, rounds: int) -> float:
    for i in range(calls):  # warm-up: compilation and first-use checks
        mx.eval(fn(i))
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        mx.eval([fn(i) for i in range(calls)])
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def copy_bandwidth() -> float:
    a = mx.random.uniform(shape=(256 * 1024 * 1024,))  # 1 GiB of float32
    mx.eval(a)
    t = seconds_per_call(lambda i: a * 1.0, 1, 10)
    return 2 * a.nbytes / t


def filled_cache(batch: int, tokens: int, seed: int) -> CompressedKVCache:
    config = KVCacheConfig(method="turboquant_mse", bits=3, value_bits=4)
    cache = CompressedKVCache(config, settings=EngineSettings.resolve())
    for start in range(0, tokens, 8192):
        n = min(8192, tokens - start)
        k = mx.random.normal((batch, KV_HEADS, n, DIM), key=mx.random.key(seed * 1000 + start)).astype(mx.float16)
        cache.update_and_fetch(k, mx.sin(k))
        mx.eval(cache.store.rows)
    return cache


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", default="1x4096,1x32768,1x131072,8x16384")
    parser.add_argument("--chunks", default="default,1024,2048,4096",
                        help="tokens per split: 'default' (planned from the GPU's size) or numbers")
    parser.add_argument("--mma-threads", default="128",
                        help="threads per block of the tensor-core kernel (comma list: 128 = 4 warps, 256 = 8)")
    parser.add_argument("--layers", type=int, default=0, help="distinct caches per round (0: ~300 MB of codes)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--backend", default=None, help="kernel runner (default: the device's back end)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bandwidth = copy_bandwidth()
    run = ops.runner(args.backend or EngineSettings.resolve().backend)
    records = []
    for shape in args.shapes.split(","):
        batch, tokens = (int(x) for x in shape.split("x"))
        code_bytes = batch * KV_HEADS * tokens * 29 * 4
        layers = args.layers or max(2, min(16, -(-300_000_000 // code_bytes)))
        caches = [filled_cache(batch, tokens, seed) for seed in range(layers)]
        queries = [mx.random.normal((batch, Q_HEADS, 1, DIM), key=mx.random.key(100 + i)).astype(mx.float16)
                   for i in range(layers)]
        fp16 = [(mx.random.normal((batch, KV_HEADS, tokens, DIM), key=mx.random.key(200 + i)).astype(mx.float16),) * 2
                for i in range(min(layers, 4))]
        mx.eval(queries, fp16)
        scale = DIM ** -0.5
        sdpa = seconds_per_call(
            lambda i: mx.fast.scaled_dot_product_attention(queries[i], *fp16[i % len(fp16)], scale=scale),
            len(fp16), args.rounds)
        row = {"batch": batch, "tokens": tokens, "layers": layers, "code_bytes": code_bytes,
               "fp16_sdpa_us": sdpa * 1e6, "fp16_bytes": 2 * batch * KV_HEADS * tokens * DIM * 2, "kernels": []}
        for chunk in args.chunks.split(","):
            split = None if chunk == "default" else int(chunk)
            variants = [(False, None)] + [(True, int(n)) for n in args.mma_threads.split(",")]
            for mma, threads in variants:
                def call(i, mma=mma, split=split, threads=threads):
                    c = caches[i]
                    o, ml, _ = ops.mse_partials(run, queries[i], c.key_codec, c.value_codec, c.store.rows, tokens,
                                                scale, chunk=split, mma=mma, threads=threads)
                    return [o, ml]

                t = seconds_per_call(call, layers, args.rounds)
                plan = ops.mse_partials(run, queries[0], caches[0].key_codec, caches[0].value_codec,
                                        caches[0].store.rows, tokens, scale, chunk=split, mma=mma, threads=threads)[2]
                row["kernels"].append({"kernel": plan.kernel, "threads": plan.threadgroup[0],
                                       "chunk": plan.meta["chunk"], "splits": plan.meta["splits"],
                                       "us": t * 1e6, "GBps": code_bytes / t / 1e9,
                                       "copy_fraction": code_bytes / t / bandwidth})
        records.append(row)
        print(json.dumps(row), flush=True)
    write_tables(out / "partial_kernels", bandwidth, records, ["kernel", "threads", "tokens per split", "splits"],
                 lambda row, k: [k["kernel"], k["threads"], k["chunk"], k["splits"]])
    return 0


def write_tables(stem: Path, bandwidth: float, records: list, columns: list, cells) -> None:
    """`stem`.json (the records) and `stem`.md: a row per kernel record, with the shape, fp16 SDPA's
    time, `columns` (filled by `cells(row, kernel)`), the time, and the codes' bandwidth."""
    result = {"device": str(mx.default_device()), "copy_bandwidth_GBps": bandwidth / 1e9, "records": records}
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2))
    lines = [f"Copy bandwidth (read + write of 1 GiB): {bandwidth / 1e9:.0f} GB/s.", "",
             "| batch x tokens | fp16 SDPA us | " + " | ".join(columns) + " | us | vs fp16 SDPA | GB/s of codes | of copy bandwidth |",
             "|---|---:|" + "---|" * len(columns) + "---:|---:|---:|---:|"]
    for row in records:
        for k in row["kernels"]:
            lines.append(f"| {row['batch']}x{row['tokens']} | {row['fp16_sdpa_us']:.1f} | "
                         + " | ".join(str(c) for c in cells(row, k))
                         + f" | {k['us']:.1f} | {row['fp16_sdpa_us'] / k['us']:.2f}x | {k['GBps']:.0f} | "
                         f"{100 * k['copy_fraction']:.0f}% |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(main())
