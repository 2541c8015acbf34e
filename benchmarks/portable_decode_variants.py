"""Which MLX-ops decode of packed codes is fastest on a GPU, timed as a decode step would
run it: 32 layers of the Llama-3.1-8B shape (8 kv heads, 32 query heads, head dim 128),
each with its own cache of `--context` tokens, chained (a layer's output is the next
layer's query) and evaluated once per step. turboquant_mse keys at 3 bits, values at 4.

    python benchmarks/portable_decode_variants.py --context 4096 --out results/gpu/runN/portable-variants

Rows, taking turns in every round (median step ms over `--rounds`):
- fp16: MLX's fused SDPA over fp16 keys and values (what the portable path competes with);
- the engine's `compiled_decode` as a cache on the portable back end runs it, with the
  codec's decode (`packing.unpack`, then a centroid gather) or with the centroids looked up by
  a chain of selects, which `mx.compile` fuses with the unpacking and the norm;
- each of those with the whole capacity decoded as one split instead of 4096-token splits;
- the whole capacity decoded to fp16 by one compiled call, sliced to the tokens held, and
  MLX's fused SDPA in the codecs' domains (what `engine.sdpa_decode` now does, with the gather).

The recorded run (`results/gpu/run45-portable/variants-4k`) predates the broadcast unpacking in
`packing`: its "elementwise unpack" rows were this script's own copy of what `packing.unpack` now
does on a GPU, and its "current decode" rows the grouped unpacking that the CPU keeps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from veloxquant_mlx import EngineSettings, engine
from veloxquant_mlx.methods.turboquant_mse import MSECodec
from veloxquant_mlx.packing import unpack

from engine_profile import DIM, Q_HEADS, filled  # noqa: E402  (benchmarks/ is on the path)

LAYERS = 32
SPEC = "turboquant_mse:3:vbits=4"


def lookup_select(codes: mx.array, centroids) -> mx.array:
    values = [float(c) for c in np.array(centroids)]
    out = mx.full(codes.shape, values[0], mx.float32)
    for k in range(1, len(values)):
        out = mx.where(codes == k, values[k], out)
    return out


ORIGINAL_DECODE = MSECodec.decode


def select_decode(self, fields):
    """The codec's decode with the centroids looked up by selects instead of a gather."""
    codes = unpack(fields["codes"], self.bits, self.dim)
    return lookup_select(codes, self.centroids) * fields["norm"].astype(mx.float32)


def layer_step(h, queries, decode, split: int):
    """A compiled decode step for history `h`, traced with `decode` as the codec's decode."""
    names, per_row, kb, vb = engine.capacity_fields(h)
    capacity = h.store.capacity
    parts, fp16 = h.fp16_inputs()
    saved_split, saved_decode = engine.DECODE_SPLIT, MSECodec.decode
    engine.DECODE_SPLIT, MSECodec.decode = split, decode
    try:
        fn = engine._decode_fn.__wrapped__(h.key_codec, h.value_codec, names, per_row, capacity,
                                           tuple(queries.shape), queries.dtype, DIM ** -0.5, parts, False)
        count, none = engine.small_array((h.count,)), engine.small_array((0.0,), mx.float32)
        mx.eval(fn(queries, kb, vb, count, fp16, none, none))  # trace now, with the patches in place
    finally:
        engine.DECODE_SPLIT, MSECodec.decode = saved_split, saved_decode
    return lambda q: fn(q, kb, vb, count, fp16, none, none)


def sdpa_step(h, decode):
    """The whole capacity decoded to fp16 in one compiled call (keys and values), sliced to the
    tokens held, then MLX's fused SDPA in the codecs' domains and the value rotation undone."""
    kc, vc, count = h.key_codec, h.value_codec, h.count
    kf, vf = h.store.fields("keys", 0, h.store.capacity), h.store.fields("values", 0, h.store.capacity)
    decoded = mx.compile(lambda kf, vf: (decode(kc, kf).astype(mx.float16), decode(vc, vf).astype(mx.float16)))
    to_domain = mx.compile(lambda q: kc.to_domain(q.astype(mx.float32)).astype(mx.float16))
    from_domain = mx.compile(lambda o: vc.from_domain(o.astype(mx.float32)).astype(mx.float16))

    def step(q):
        keys, values = decoded(kf, vf)
        out = mx.fast.scaled_dot_product_attention(to_domain(q), keys[..., :count, :], values[..., :count, :],
                                                   scale=DIM ** -0.5)
        return from_domain(out)

    return step


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results/portable-variants")
    args = parser.parse_args()
    settings = EngineSettings.resolve(backend="portable")
    caches, fp16_kv = [], []
    for layer in range(LAYERS):
        cache, k, v = filled(SPEC, args.context, settings)
        caches.append(cache._history())
        fp16_kv.append((k * 1, v * 1))
        mx.eval(fp16_kv[-1])
    q0 = mx.random.normal((1, Q_HEADS, 1, DIM), key=mx.random.key(3)).astype(mx.float16)
    capacity = caches[0].store.capacity

    def chain(steps):
        def run():
            q = q0
            for step in steps:
                q = step(q)
            return q
        return run

    sdpa = mx.compile(lambda q, k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=DIM ** -0.5))
    variants = {"fp16 SDPA": chain([lambda q, kv=kv: sdpa(q, *kv) for kv in fp16_kv])}
    decodes = {"codec decode (gather)": ORIGINAL_DECODE, "centroids by selects": select_decode}
    for split_name, split in (("4096-token splits", 4096), ("one split", capacity)):
        for name, decode in decodes.items():
            variants[f"compiled_decode, {name}, {split_name}"] = chain(
                [layer_step(h, q0, decode, split) for h in caches])
    for name, decode in decodes.items():
        variants[f"fp16 decode of the whole capacity + SDPA, {name}"] = chain([sdpa_step(h, decode) for h in caches])
    reference = variants["compiled_decode, codec decode (gather), 4096-token splits"]()
    differences = {}
    for name, run in variants.items():
        out = run()
        differences[name] = float(mx.max(mx.abs(out.astype(mx.float32) - reference.astype(mx.float32))))
    times = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, run in variants.items():
            mx.synchronize()
            start = time.perf_counter()
            mx.eval(run())
            mx.synchronize()
            times[name].append((time.perf_counter() - start) * 1e3)
    fp16 = statistics.median(times["fp16 SDPA"])
    rows = {name: {"step_ms": statistics.median(t), "vs_fp16_attention": fp16 / statistics.median(t),
                   "max_abs_difference_from_current": differences[name]} for name, t in times.items()}
    for name, row in rows.items():
        print(json.dumps({"variant": name, **row}), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"device": str(mx.default_device()), "context": args.context, "capacity": capacity, "layers": LAYERS,
              "spec": SPEC, "rounds": args.rounds, "rows": rows}
    (out / "results.json").write_text(json.dumps(record, indent=2))
    lines = [f"| variant ({LAYERS} layers, {args.context} tokens each) | step ms (attention only) | fp16 / this "
             "| max abs difference from the codec decode with 4096-token splits |", "|---|---|---|---|"]
    lines += [f"| {name} | {r['step_ms']:.3f} | {r['vs_fp16_attention']:.2f} | {r['max_abs_difference_from_current']:.2e} |"
              for name, r in rows.items()]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
