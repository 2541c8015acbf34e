"""What MLX's CPU back end offers for attention over a 3-bit cache (one decode step, one layer).

    python benchmarks/cpu_primitives.py [--tokens 8192] [--out benchmarks/results/cpu]

SmolLM2's layer shape (3 kv heads, 9 query heads, d = 64), one query: per-layer
milliseconds of fp32 `mx.fast.scaled_dot_product_attention` (what an fp16/fp32 KVCache
costs), of our portable path and our C++ kernel (`csrc/`, where built) on turboquant_mse
codes (K3/V3, and K4/V4 for the kernel), and of mlx-lm-style
`mx.quantized_matmul` attention at 2, 3, 4 and 8 bits (group 64): the fastest
packed-code primitives MLX has on the CPU. Also the cost of one row gather and of one
compiled elementwise op per element, the two building blocks of decoding codes in MLX
ops. Median of 20 calls after 3 warm-ups. Writes cpu_primitives.json / .md.
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

from veloxquant_mlx import kernels  # noqa: E402
from veloxquant_mlx.cache import CompressedKVCache  # noqa: E402
from veloxquant_mlx.config import KVCacheConfig  # noqa: E402


def ms(fn, calls: int = 20) -> float:
    for _ in range(3):
        mx.eval(fn())
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    T, H, R, D = args.tokens, 3, 3, 64
    q = mx.random.normal((1, H * R, 1, D), key=mx.random.key(0))
    k = mx.random.normal((1, H, T, D), key=mx.random.key(1))
    v = mx.random.normal((1, H, T, D), key=mx.random.key(2))
    rows = {}
    rows["fp32 SDPA (KVCache)"] = ms(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125))
    cache = CompressedKVCache(KVCacheConfig(method="turboquant_mse", bits=3))
    cache.update_and_fetch(k, v)
    mx.eval(cache.store.rows)
    rows["turboquant_mse K3/V3, portable path"] = ms(lambda: kernels.decode_attention(cache, q, 0.125,
                                                                                      using="portable"))
    if kernels.native.available():
        rows["turboquant_mse K3/V3, C++ kernel"] = ms(lambda: kernels.decode_attention(cache, q, 0.125,
                                                                                      using="native"))
        cache4 = CompressedKVCache(KVCacheConfig(method="turboquant_mse", bits=4))
        cache4.update_and_fetch(k, v)
        mx.eval(cache4.store.rows)
        rows["turboquant_mse K4/V4, C++ kernel"] = ms(lambda: kernels.decode_attention(cache4, q, 0.125,
                                                                                      using="native"))
    qg = q.reshape(1, H, R, D)
    for bits in (2, 3, 4, 8):
        kq = mx.quantize(k, group_size=64, bits=bits)
        vq = mx.quantize(v, group_size=64, bits=bits)

        def attend(kq=kq, vq=vq, bits=bits):
            s = mx.quantized_matmul(qg, *kq, transpose=True, group_size=64, bits=bits)
            return mx.quantized_matmul(mx.softmax(s, axis=-1), *vq, transpose=False, group_size=64, bits=bits)

        rows[f"mx.quantized_matmul attention, {bits}-bit"] = ms(attend)
    n = T * H * 16  # one index per 4 codes of K (what the portable path gathers)
    index = mx.random.randint(0, 4096, (n,), key=mx.random.key(3)).astype(mx.uint32)
    table = mx.random.normal((4096, 4), key=mx.random.key(4))
    gather = ms(lambda: mx.take(table, index, axis=0))
    x = mx.random.normal((T * H * D,), key=mx.random.key(5))
    fused = mx.compile(lambda a: mx.where(a > 0.5, a * 3.0 + 1.0, a * 0.5 - 2.0))
    elementwise = ms(lambda: fused(x))
    result = {"tokens": T, "layer": "3 kv heads, 9 query heads, d = 64", "mlx": mx.__version__,
              "per_layer_ms": rows,
              "gather_ns_per_index": gather * 1e6 / n,
              "compiled_elementwise_ns_per_element": elementwise * 1e6 / x.size}
    lines = [f"# MLX CPU primitives, one decode step of one SmolLM2 layer at {T} tokens", "",
             "| path | ms per layer |", "|---|---:|"]
    lines += [f"| {name} | {value:.2f} |" for name, value in rows.items()]
    lines += ["", f"Row gather (4 floats): {result['gather_ns_per_index']:.2f} ns per index; "
              f"compiled elementwise op: {result['compiled_elementwise_ns_per_element']:.2f} ns per element."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "cpu_primitives.json").write_text(json.dumps(result, indent=1))
        (out / "cpu_primitives.md").write_text(text)


if __name__ == "__main__":
    main()
