"""The formats' flash-decoding partial kernel alone (`kernels/partial.py`), on the GPU, next to
fp16 SDPA over the same tokens.

    python benchmarks/format_partials.py --out results/gpu/NAME [--methods kivi:4,...] [--shapes 1x32768]

One layer of the Llama-3.1-8B shape (32 query heads, 8 kv heads, d = 128, fp16 queries). For
each method spec and shape (batch x tokens): microseconds per call of the partial kernel
(median of `--rounds` rounds; a round calls it once on each of `--layers` distinct caches, so
the codes come from memory, not L2), the bytes of codes it reads, and that as a share of the
device's measured copy bandwidth. A kernel's name is a hash of its text, so two checkouts' runs
of this script show whether they timed the same kernel. Writes format_partials.json and
format_partials.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from partial_kernels import DIM, KV_HEADS, Q_HEADS, copy_bandwidth, seconds_per_call, write_tables  # noqa: E402

from veloxquant_mlx.cache import CompressedKVCache  # noqa: E402
from veloxquant_mlx.evaluation.specs import parse_method_spec  # noqa: E402
from veloxquant_mlx.kernels import ops, partial  # noqa: E402
from veloxquant_mlx.settings import EngineSettings  # noqa: E402

METHODS = "kivi:4,kivi:2,turboquant_rvq:2,polarquant:4,qjl:4,turboquant_mse:3:vbits=4"


def filled_cache(spec: str, batch: int, tokens: int, seed: int) -> CompressedKVCache:
    parsed = parse_method_spec(spec)
    cache = CompressedKVCache(parsed.config, settings=EngineSettings.resolve(**parsed.engine))
    for start in range(0, tokens, 8192):
        n = min(8192, tokens - start)
        k = mx.random.normal((batch, KV_HEADS, n, DIM), key=mx.random.key(seed * 1000 + start)).astype(mx.float16)
        cache.update_and_fetch(k, mx.sin(k))
        mx.eval(cache.state)
    cache.flush()
    return cache


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--methods", default=METHODS)
    parser.add_argument("--shapes", default="1x32768,1x131072")
    parser.add_argument("--layers", type=int, default=0, help="distinct caches per round (0: ~300 MB of codes)")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bandwidth = copy_bandwidth()
    run = ops.runner(EngineSettings.resolve().backend)
    records = []
    for shape in args.shapes.split(","):
        batch, tokens = (int(x) for x in shape.split("x"))
        queries = [mx.random.normal((batch, Q_HEADS, 1, DIM), key=mx.random.key(100 + i)).astype(mx.float16)
                   for i in range(16)]
        fp16 = [(mx.random.normal((batch, KV_HEADS, tokens, DIM), key=mx.random.key(200 + i)).astype(mx.float16),) * 2
                for i in range(4)]
        mx.eval(queries, fp16)
        scale = DIM ** -0.5
        sdpa = seconds_per_call(
            lambda i: mx.fast.scaled_dot_product_attention(queries[i], *fp16[i], scale=scale), len(fp16), args.rounds)
        row = {"batch": batch, "tokens": tokens, "fp16_sdpa_us": sdpa * 1e6,
               "fp16_bytes": 2 * batch * KV_HEADS * tokens * DIM * 2, "kernels": []}
        fp16 = None  # free its memory before the caches are built
        for spec in args.methods.split(","):
            probe = filled_cache(spec, batch, 256, 0)
            bits = probe.key_codec.format.bits_per_token + probe.value_codec.format.bits_per_token
            code_bytes = int(batch * KV_HEADS * tokens * bits / 8)
            layers = args.layers or max(2, min(16, -(-300_000_000 // code_bytes)))
            caches = [filled_cache(spec, batch, tokens, seed) for seed in range(layers)]
            launches = []
            for i, c in enumerate(caches):
                h = c._history()
                launch_ = partial.prepare(h.store, h.key_codec, h.value_codec, batch * KV_HEADS, Q_HEADS // KV_HEADS,
                                          h.count, h.settings.split_tokens, h.settings.backend)
                q = h.key_codec.to_domain((queries[i].astype(mx.float32) * scale)
                                          .reshape(batch, KV_HEADS, Q_HEADS // KV_HEADS, DIM))
                mx.eval(q)
                launches.append((launch_.plan, [q] + list(launch_.inputs)))

            def call(i):
                plan, inputs = launches[i]
                return run(plan, inputs)

            t = seconds_per_call(call, layers, args.rounds)
            plan = launches[0][0]
            row["kernels"].append({"method": spec, "kernel": plan.kernel, "layers": layers, "code_bytes": code_bytes,
                                   "splits": plan.grid[0] // partial.THREADS, "us": t * 1e6,
                                   "GBps": code_bytes / t / 1e9, "copy_fraction": code_bytes / t / bandwidth})
            print(json.dumps(row["kernels"][-1]), flush=True)
            caches = launches = None
        records.append(row)
    write_tables(out / "format_partials", bandwidth, records, ["method", "kernel", "splits"],
                 lambda row, k: [f"`{k['method']}`", k["kernel"], k["splits"]])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
