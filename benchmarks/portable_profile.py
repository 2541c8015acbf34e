"""Where the portable (MLX-ops) decode spends its time on a GPU, and what cheaper
formulations of its pieces cost: one layer of the Llama-3.1-8B shape (8 kv heads,
32 query heads, head dim 128) at one context, turboquant_mse keys at 3 bits and values
at 4 bits.

    python benchmarks/portable_profile.py --context 4096 --out results/gpu/runN/portable_profile

Rows (each a compiled function, median of `--rounds` calls, each evaluated on its own):
the fp16 SDPA decode it competes with; the engine's `compiled_decode` step as a cache
runs it (backend=portable); the codec's decode of the whole history; its parts (unpack,
centroid lookup); and alternatives: unpack by two constant-index gathers, the centroid
lookup as a select-sum, and decode-to-fp16 followed by MLX's fused SDPA.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx

from veloxquant_mlx import EngineSettings
from veloxquant_mlx.codebooks import dequantize
from veloxquant_mlx.packing import unpack

from engine_profile import DIM, Q_HEADS, filled, timed  # noqa: E402  (benchmarks/ is on the path)


def unpack_by_gather(words: mx.array, bits: int, n: int) -> mx.array:
    j = mx.arange(n) * bits
    index, shift = j // 32, (j % 32).astype(mx.uint32)
    straddles = (shift + bits) > 32
    complement = mx.where(straddles, 31 - shift, 31).astype(mx.uint32)
    low = mx.take(words, index, axis=-1) >> shift
    high = (mx.take(words, mx.minimum(index + 1, words.shape[-1] - 1), axis=-1) << 1) << complement
    return (low | high) & ((1 << bits) - 1)


def select_sum(codes: mx.array, centroids: mx.array) -> mx.array:
    out = mx.zeros(codes.shape, mx.float32)
    for k in range(centroids.shape[0]):
        out = mx.where(codes == k, centroids[k], out)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out", default="benchmarks/results/portable_profile")
    args = parser.parse_args()
    T = args.context
    settings = EngineSettings.resolve(backend="portable")
    spec = "turboquant_mse:3:vbits=4"
    cache, k, v = filled(spec, T, settings)
    q = mx.random.normal((1, Q_HEADS, 1, DIM), key=mx.random.key(3)).astype(mx.float16)
    cache.attend(q, DIM ** -0.5)
    path = cache.last_path
    kf, vf = cache.store.fields("keys"), cache.store.fields("values")
    kc, vc = cache.key_codec, cache.value_codec
    kwords, vwords = kf["codes"], vf["codes"]
    rows = {}

    def add(name, fn):
        rows[name] = timed(fn, args.rounds)
        print(json.dumps({"row": name, "ms": rows[name]}), flush=True)

    sdpa = mx.compile(lambda q, k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=DIM ** -0.5))
    add("fp16 SDPA decode", lambda: sdpa(q, k, v))
    add(f"cache.attend ({path})", lambda: cache.attend(q, DIM ** -0.5))
    dec = mx.compile(lambda: (kc.decode(kf), vc.decode(vf)))
    add("codec decode, keys + values (fp32)", dec)
    add("unpack keys + values (current)", mx.compile(lambda: (unpack(kwords, 3, DIM), unpack(vwords, 4, DIM))))
    add("unpack keys + values (two gathers)",
        mx.compile(lambda: (unpack_by_gather(kwords, 3, DIM), unpack_by_gather(vwords, 4, DIM))))
    kcodes, vcodes = unpack(kwords, 3, DIM), unpack(vwords, 4, DIM)
    mx.eval(kcodes, vcodes)
    add("centroids by take", mx.compile(lambda: (dequantize(kcodes, kc.centroids), dequantize(vcodes, vc.centroids))))
    add("centroids by select", mx.compile(lambda: (select_sum(kcodes, kc.centroids), select_sum(vcodes, vc.centroids))))

    def fused_fp16(q):
        kd = (select_sum(unpack_by_gather(kwords, 3, DIM), kc.centroids) * kf["norm"].astype(mx.float32)).astype(mx.float16)
        vd = (select_sum(unpack_by_gather(vwords, 4, DIM), vc.centroids) * vf["norm"].astype(mx.float32)).astype(mx.float16)
        qd = kc.to_domain(q.astype(mx.float32)).astype(mx.float16)
        o = mx.fast.scaled_dot_product_attention(qd, kd, vd, scale=DIM ** -0.5)
        return vc.from_domain(o.astype(mx.float32)).astype(mx.float16)

    add("alternative: gather-unpack + select + fp16 SDPA", lambda: mx.compile(fused_fp16)(q))
    fused = mx.compile(fused_fp16)
    add("alternative (compiled once)", lambda: fused(q))
    reference = cache.attend(q, DIM ** -0.5).astype(mx.float32)
    difference = float(mx.max(mx.abs(fused(q).astype(mx.float32) - reference)) / mx.max(mx.abs(reference)))
    print(json.dumps({"alternative_vs_cache_relative_max_difference": difference}), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"device": str(mx.default_device()), "context": T, "spec": spec, "path": path, "ms": rows,
              "alternative_vs_cache_relative_max_difference": difference}
    (out / "results.json").write_text(json.dumps(record, indent=2))
    lines = [f"| piece (one layer, {T} tokens) | ms |", "|---|---|"] + [f"| {k} | {v:.4f} |" for k, v in rows.items()]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
