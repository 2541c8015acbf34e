"""Where the host time of one decode step goes (per layer, Llama-3.1-8B layer shape).

    python benchmarks/host_profile.py [--context 4096] [--layers 32] [--methods SPECS] [--out DIR]

Builds `--layers` caches of `--context` tokens (turboquant_mse K3/V4 and mlx-lm's
KVCache) and times, host side only (graph construction, evaluation untimed):
the fp16 step (append + SDPA), our step through the cache (update_and_fetch +
attend), the same with the compiled step off, and the compiled fused function
called directly (no cache logic). Then cProfiles our step, and times and cProfiles the step
of each cache in `--methods` the same way. Writes host.json.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_lm.models.cache import KVCache  # noqa: E402

from veloxquant_mlx import kernels  # noqa: E402
from veloxquant_mlx.cache import CompressedKVCache  # noqa: E402
from veloxquant_mlx.config import KVCacheConfig  # noqa: E402
from veloxquant_mlx.evaluation.specs import parse_method_list  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_bench import ERRORS, build_time, timed  # noqa: E402

ROUNDS = 15


def build_us(fn, layers: int):
    """Microseconds, or None where `fn` failed (kernel_bench records the error)."""
    seconds = build_time(fn, layers, ROUNDS)
    return None if seconds is None else seconds * 1e6


def total_us(fn, layers: int):
    seconds = timed(fn, layers, ROUNDS)
    return None if seconds is None else seconds * 1e6


def profiled(fn, layers: int) -> str:
    """cProfile's top 25 (by own time) of 10 steps of fn(i) over the layers, each evaluated."""
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(10):
        mx.eval([fn(i) for i in range(layers)])
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
    return text.getvalue()


def filled_layers(layers: int, tokens: int, cfg: KVCacheConfig = None):
    """(CompressedKVCaches of `cfg` (default K3/V4), fp16 KVCaches): one pair per layer,
    Llama-3.1-8B's kv shape, filled with the same random `tokens` keys (= values)."""
    cfg = cfg or KVCacheConfig(method="turboquant_mse", bits=3, value_bits=4)
    caches, fp16 = [], []
    for i in range(layers):
        k = mx.random.normal((1, 8, tokens, 128), key=mx.random.key(i)).astype(mx.float16)
        c = CompressedKVCache(cfg)
        c.update_and_fetch(k, k)
        f = KVCache()
        f.update_and_fetch(k, k)
        mx.eval(c.store.rows, f.keys)
        caches.append(c)
        fp16.append(f)
    return caches, fp16


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--out", default=None)
    parser.add_argument("--methods", default=None,
                        help="also time and profile these caches' steps (method specs, as `veloxquant benchmark` takes)")
    args = parser.parse_args()
    L, T = args.layers, args.context
    caches, fp16 = filled_layers(L, T)
    q = mx.random.normal((1, 32, 1, 128)).astype(mx.float16)
    new = mx.random.normal((1, 8, 1, 128)).astype(mx.float16)
    mx.eval(q, new)

    def fp16_step(i):
        k, v = fp16[i].update_and_fetch(new, new)
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=0.088)

    def vq_step(i):
        caches[i].update_and_fetch(new, new)
        return caches[i].attend(q, scale=0.088)

    result = {"backend": kernels.backend(), "context": T, "layers": L, "mlx": mx.__version__}
    result["fp16 step: host us/layer"] = build_us(fp16_step, L)
    result["fp16 step: total us/layer"] = total_us(fp16_step, L)
    result["packed step: host us/layer"] = build_us(vq_step, L)
    result["packed step: total us/layer"] = total_us(vq_step, L)
    if kernels.backend() in ("cuda", "metal"):
        name = kernels.backend()
        c = caches[0]
        c.flush()
        plan, fn = kernels.step._step_fn("fused", name, c.key_codec, c.value_codec, tuple(q.shape), q.dtype,
                                         "float16", 0.088, c.store.rows.shape[0] * c.store.rows.shape[1], c.store.rows.shape[2],
                                         False)
        _, chunk, cap, splits = plan.meta["meta"]
        meta = kernels.ops.small_array((c.encoded, chunk, cap, splits))
        none = kernels.ops.small_array((0.0,), mx.float32)
        rows = [caches[i].store.rows for i in range(L)]
        result["compiled fused call alone: host us/layer"] = build_us(
            lambda i: fn(q, rows[i], meta, none, none, [], new, new)[0], L)
        result["compiled fused call alone: total us/layer"] = total_us(
            lambda i: fn(q, rows[i], meta, none, none, [], new, new)[0], L)
        result["SDPA call alone: host us/layer"] = build_us(
            lambda i: mx.fast.scaled_dot_product_attention(q, fp16[i].keys[..., :T, :], fp16[i].values[..., :T, :],
                                                           scale=0.088), L)
    for c in caches:
        c.flush()
        c.settings = c.settings.replace(compile_step=False)
    result["packed step, compile off: host us/layer"] = build_us(vq_step, L)
    result["packed step, compile off: total us/layer"] = total_us(vq_step, L)
    for c in caches:
        c.flush()
        c.settings = c.settings.replace(compile_step=True)
    result["profile"] = profiled(vq_step, L)
    for spec in parse_method_list(args.methods) if args.methods else []:
        if spec.config is None:
            continue
        others, _ = filled_layers(L, T, spec.config)

        def other_step(i, others=others):
            others[i].update_and_fetch(new, new)
            return others[i].attend(q, scale=0.088)

        result[f"{spec.label}: host us/layer"] = build_us(other_step, L)
        result[f"{spec.label}: total us/layer"] = total_us(other_step, L)
        result[f"{spec.label}: path"] = others[0].last_path
        result[f"{spec.label}: profile"] = profiled(other_step, L)
        del others
    if ERRORS:
        result["errors"] = ERRORS
    for k, v in result.items():
        print(f"{k}: {v:.1f}" if isinstance(v, float) else f"{k}: {v}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "host.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
