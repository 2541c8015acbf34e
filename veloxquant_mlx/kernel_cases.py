"""The kernels' cases on whole caches: what the GPU kernels' first-use check (`kernels/check.py`)
runs, and the cases of the self-test (`python -m veloxquant_mlx.kernels.selftest`) that build a cache.

They sit above the kernels, with the cache they fill: `kernels/check.py` runs the jobs this
module registers (`check.register_first_use_jobs`) when the package is imported.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, Optional

import mlx.core as mx
import numpy as np

from . import engine
from .cache import CompressedKVCache
from .config import KVCacheConfig
from . import kernels
from .kernels import check, encode, launch, partial
from .kernels.check import TF32_TOLERANCE
from .settings import EngineSettings

TOLERANCES = {"float32": 1e-4, "float16": 4e-3}
ENCODE_MIN_EQUAL = 0.999


@dataclass
class Case:
    name: str
    dim: int
    bits: int
    value_bits: int
    rep: int
    kv_heads: int = 2
    batch: int = 1
    tokens: int = 600
    queries: int = 1  # > 1: a prefill chunk of this many new tokens
    dtype: str = "float32"
    options: Dict = field(default_factory=dict)
    seed: int = 0
    tensor_cores: bool = True  # EngineSettings.tensor_cores: False checks the SIMT partial kernel


def _config(case: Case):
    opts = dict(case.options)
    fields = {k: opts.pop(k) for k in ("residual_length", "sink_tokens", "center") if k in opts}
    return KVCacheConfig(method="turboquant_mse", bits=case.bits, value_bits=case.value_bits,
                         options=opts, **fields)


def _inputs(case: Case):
    rng = np.random.default_rng([case.seed, 2024])
    shape = (case.batch, case.kv_heads, case.tokens, case.dim)
    keys = rng.standard_normal(shape).astype(np.float32)
    keys[..., : case.dim // 8] *= 4.0  # a few large channels, like real keys
    values = rng.standard_normal(shape).astype(np.float32)
    queries = rng.standard_normal((case.batch, case.kv_heads * case.rep, case.queries, case.dim)).astype(np.float32)
    return keys, values, queries


def _cache(case: Case, keys, values, backend: Optional[str] = None):
    dtype = getattr(mx, case.dtype)
    settings = EngineSettings.resolve(**({"backend": backend} if backend else {}))
    cache = CompressedKVCache(_config(case), settings=settings)
    n = case.tokens - case.queries
    k, v = mx.array(keys).astype(dtype), mx.array(values).astype(dtype)
    cache.update_and_fetch(k[..., :n, :], v[..., :n, :])
    if case.queries > 1:  # the chunk itself is encoded before it attends
        cache.update_and_fetch(k[..., n:, :], v[..., n:, :])
    else:
        for i in range(n, case.tokens):
            cache.update_and_fetch(k[..., i : i + 1, :], v[..., i : i + 1, :])
    mx.eval(cache.store.rows)
    return cache


def _attend_dequantized(cache, queries: np.ndarray, scale: float) -> np.ndarray:
    keys, values = (np.array(a, dtype=np.float64) for a in cache.dequantized())
    B, n_heads, L, D = queries.shape
    kv = keys.shape[1]
    q = queries.astype(np.float64).reshape(B, kv, n_heads // kv, L, D) * scale
    s = np.einsum("bhrld,bhtd->bhrlt", q, keys)
    T = keys.shape[2]
    if L > 1:  # causal: query i sits at position T - L + i
        pos = np.arange(T - L, T)[:, None]
        s = np.where(np.arange(T)[None] <= pos, s, -np.inf)
    s = s - s.max(-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhrlt,bhtd->bhrld", p, values).reshape(B, n_heads, L, -1)


def _rel(out: np.ndarray, ref: np.ndarray) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-30))


def run_case(case: Case, backend: str) -> Dict:
    keys, values, queries = _inputs(case)
    cache = _cache(case, keys, values)
    cache.settings = cache.settings.replace(tensor_cores=case.tensor_cores)
    q = mx.array(queries).astype(getattr(mx, case.dtype))
    scale = case.dim ** -0.5
    mask = "causal" if case.queries > 1 else None
    strict = TOLERANCES[case.dtype]
    mma = case.queries == 1 and launch.use_mma(backend, case.tensor_cores, case.dim, case.rep, case.bits,
                                               case.value_bits)
    if mma:  # the tensor-core kernel takes fp16 operands (fp32 sums) whatever the cache's dtype
        strict = max(strict, TOLERANCES["float16"])
    # MLX's own float32 matmuls / SDPA run at TF32 precision on GPUs unless MLX_ENABLE_TF32=0.
    mlx_ops = strict
    if backend in ("cuda", "metal") and os.environ.get("MLX_ENABLE_TF32", "1") != "0":
        mlx_ops = max(strict, TF32_TOLERANCE)
    record = {"case": case.name, "backend": backend, "dtype": case.dtype, "tolerance": strict,
              "tolerance_mlx_ops": mlx_ops, "partial_kernel": "mse_partial_mma" if mma else "mse_partial"}
    if case.queries > 1:
        out = kernels.prefill_attention(cache, q, scale, mask, using=backend)
    else:
        out = kernels.decode_attention(cache, q, scale, mask, using=backend)
    if out is None:
        record.update(status="not applicable")
        return record
    out = np.array(out.astype(mx.float32))
    if case.queries == 1:
        portable = np.array(kernels.decode_attention(cache, q, scale, mask, using="portable").astype(mx.float32))
        record["vs_portable"] = _rel(out, portable)
    cache.settings = cache.settings.replace(kernels=False)
    generic = np.array(cache.attend(q, scale=scale, mask=mask).astype(mx.float32))
    record["vs_generic"] = _rel(out, generic)
    record["vs_dequant_fp64"] = _rel(out, _attend_dequantized(cache, queries if case.dtype == "float32"
                                                              else np.array(q.astype(mx.float32)), scale))
    # The decode kernels never use MLX matmuls (strict); prefill runs MLX's SDPA (mlx_ops), and the
    # plain fp16-window partial of a decode step is an MLX matmul too.
    own = mlx_ops if (case.queries > 1 or case.options.get("residual_length") or case.options.get("sink_tokens")) \
        else strict
    limits = {"vs_portable": mlx_ops, "vs_generic": mlx_ops, "vs_dequant_fp64": own}
    record["max_error"] = max(record[k] for k in limits if k in record)
    ok = all(record[k] <= limit for k, limit in limits.items() if k in record)
    record["status"] = "ok" if ok else "FAIL"
    record["output"] = out
    return record


# (key dim, key bits, value dim, value bits, scale): keys and values go through one launch. scale
# "norm" or "renorm" for both roles; "unbiased": renorm keys, unbiased values (`unbiased_values`).
ENCODE_CASES = [
    (128, 3, 128, 4, "norm"), (128, 3, 128, 4, "renorm"), (128, 1, 128, 8, "norm"), (128, 2, 128, 3, "renorm"),
    (64, 4, 64, 2, "norm"), (64, 3, 64, 3, "renorm"), (96, 3, 96, 4, "norm"), (96, 2, 96, 2, "renorm"),
    (256, 3, 256, 4, "norm"), (128, 3, 64, 4, "norm"), (64, 4, 128, 2, "renorm"),
    (128, 3, 128, 2, "unbiased"), (64, 4, 64, 3, "unbiased"), (96, 3, 96, 2, "unbiased"),
]


def _encode_name(kd, kb, vd, vb, scale):
    return f"encode_k{kd}x{kb}_v{vd}x{vb}{'' if scale == 'norm' else '_' + scale}"


def run_encode(backend: str, kd: int, kb: int, vd: int, vb: int, scale: str, tokens: int = 40) -> Dict:
    from .formats import RowLayout
    from .methods.turboquant_mse import SCALES, MSECodec

    renorm = scale != "norm"
    kc, vc = MSECodec(kd, kb, seed=3, renorm=renorm), MSECodec(vd, vb, seed=4, renorm=renorm,
                                                               unbiased=scale == "unbiased")
    layout = RowLayout.of(kc.format, vc.format)
    rng = np.random.default_rng([kd, kb, vd, vb, SCALES.index(scale)])
    k = mx.array(rng.standard_normal((2, 3, tokens, kd)).astype(np.float32)).astype(mx.float16)
    v = mx.array(rng.standard_normal((2, 3, tokens, vd)).astype(np.float32)).astype(mx.float16)
    rows = engine.row_encoder(layout, kc, vc, EngineSettings.resolve(backend=backend)).many(k, v)
    equal, norm_err, same = encode.fields_agreement(layout.views(rows), (kc.encode(k), vc.encode(v)))
    ok = equal >= ENCODE_MIN_EQUAL and norm_err <= 2 ** -10 and same and rows.shape == (2, 3, tokens, layout.words)
    return {"case": _encode_name(kd, kb, vd, vb, scale), "backend": backend,
            "codes_equal": equal, "norm_rel_error": norm_err, "status": "ok" if ok else "FAIL"}


def run_fused(backend: str, sinks: int = 2, window: int = 8, tokens: int = 200, smoothed: bool = False,
              kept: bool = False) -> Dict:
    """The fused decode step (partial + merge_encode_slide + one store) through the cache, as
    decode tokens take it: with fp16 sinks, a window slid as a ring by the kernel (more steps
    than it holds) and centering, against the portable path; then the window read in order.
    `smoothed`: keys smoothed by random per-channel scales (`methods/smoothing.py`), which the
    kernels take as an input. `kept`: `keep_attended` with a low threshold, so that tokens are
    kept as they leave the window in the fused steps (`kept_settle`, `kept_splits`); the kept
    positions must be the portable path's too."""
    from .codec_set import CodecSet
    from .kept import EMPTY
    from .methods.smoothing import SCALE

    cfg = KVCacheConfig(method="turboquant_mse", bits=3, value_bits=4, center=True, sink_tokens=sinks,
                        residual_length=window)
    codecs = None
    if smoothed:
        base = CodecSet(cfg)
        scale = mx.exp(0.5 * mx.random.normal((2, 128), key=mx.random.key(3)))
        params = {("keys", 128): {**base.get("keys", 128).params(), SCALE: scale},
                  ("values", 128): base.get("values", 128).params()}
        cfg = cfg.replace(options={**cfg.options, "smooth_keys": 0.5})
        codecs = CodecSet(cfg, params, source="selftest")
    if kept:
        cfg = cfg.replace(options={**cfg.options, "keep_attended": 0.5})
    steps = window + 3
    rng = np.random.default_rng([sinks, window, tokens])
    k = mx.array(rng.standard_normal((1, 2, tokens + steps, 128)).astype(np.float32)).astype(mx.float16)
    v = mx.array(rng.standard_normal((1, 2, tokens + steps, 128)).astype(np.float32)).astype(mx.float16)
    q = mx.array(rng.standard_normal((steps, 1, 8, 1, 128)).astype(np.float32)).astype(mx.float16)
    ref = CompressedKVCache(cfg, codecs, settings=EngineSettings.resolve(backend="portable"))
    fused = CompressedKVCache(cfg, codecs, settings=EngineSettings.resolve(backend=backend))
    outputs = {id(ref): [], id(fused): []}
    paths = set()
    for cache in (ref, fused):
        cache.update_and_fetch(k[..., :tokens, :], v[..., :tokens, :])
        for t in range(steps):
            cache.update_and_fetch(k[..., tokens + t : tokens + t + 1, :], v[..., tokens + t : tokens + t + 1, :])
            outputs[id(cache)].append(np.array(cache.attend(q[t], 128 ** -0.5).astype(mx.float32)))
            if cache is fused:
                paths.add(fused.last_path)
    tolerance = TOLERANCES["float16"]
    if backend in ("cuda", "metal") and os.environ.get("MLX_ENABLE_TF32", "1") != "0":
        tolerance = max(tolerance, TF32_TOLERANCE)  # the fp16 partial is an MLX matmul
    error = max(_rel(a, b) for a, b in zip(outputs[id(fused)], outputs[id(ref)]))
    rows_equal = bool(mx.array_equal(fused.store.rows[..., :fused.encoded, :], ref.store.rows[..., :ref.encoded, :]))
    window_equal = bool(mx.array_equal(fused.window_keys, ref.window_keys)) and bool(
        mx.array_equal(fused.window_values, ref.window_values))
    # With kept tokens the first step slides the window op by op (`mse_kernel_step`): no attention call came
    # after the prompt, so the window's shares do not line up with a fused step's yet (`KeptTokens._steady`).
    fused_paths = {"mse_fused_step", "mse_kernel_step"} if kept else {"mse_fused_step"}
    ok = "mse_fused_step" in paths and paths <= fused_paths and error <= tolerance and rows_equal and window_equal
    record = {"case": "fused_window_center" + ("_smoothed" if smoothed else "") + ("_kept" if kept else ""),
              "backend": backend, "path": ",".join(sorted(paths)), "vs_portable": error, "rows_equal": rows_equal,
              "window_equal": window_equal, "tolerance": tolerance}
    if kept:
        held = [sorted(p for p in c.kept.positions.tolist() if p < EMPTY) for c in (fused, ref)]
        record.update(kept=len(held[0]), same_kept=held[0] == held[1])
        ok = ok and held[0] == held[1] and len(held[0]) > 0
    return {**record, "status": "ok" if ok else "FAIL"}


# The first-use check runs these decode and prefill cases (and one of each other kind of job).
FIRST_USE_CASES = [
    Case("check_decode", 128, 3, 4, 4, tokens=300, dtype="float16", seed=21),
    Case("check_window_center", 64, 4, 3, 2, tokens=200, seed=22,
         options={"residual_length": 8, "sink_tokens": 2, "center": True}),
    Case("check_prefill", 128, 3, 4, 4, tokens=300, queries=8, dtype="float16", seed=23),
]


def dequant_record(backend: str) -> dict:
    """The formats' dequant kernel (`dequant.py`) against the codecs' MLX decode: a row format
    (turboquant_rvq) and a field format with per-block fields (kivi)."""
    worst = 0.0
    for config in (KVCacheConfig(method="turboquant_rvq", bits=3), KVCacheConfig(method="kivi", bits=3, group_size=32)):
        cache = CompressedKVCache(config, settings=EngineSettings.resolve(backend="portable"))
        k = mx.random.normal((1, 2, 96, 128), key=mx.random.key(5))
        cache.update_and_fetch(k, mx.sin(k))
        worst = max(worst, check.dequant_error(backend, cache.store, cache.key_codec, cache.value_codec, cache.encoded))
    return {"vs_codec_decode": worst, "status": "ok" if worst <= check.DEQUANT_TOLERANCE else "FAIL"}


def partial_record(backend: str) -> dict:
    """The partial kernel of `backend` against the engine's MLX-ops decode (`compiled_decode`
    uncompiled, on the CPU) on three formats, GQA 3, with chunks of one tile: the first-use check and the
    self-test run it."""
    worst = 0.0
    for i, options in enumerate(partial.CHECK_METHODS):
        cache = CompressedKVCache(KVCacheConfig(**options), settings=EngineSettings.resolve(backend="portable"))
        keys = mx.random.normal((1, 2, 300, 128), key=mx.random.key(40 + i)) + 0.25
        cache.update_and_fetch(keys, mx.cos(keys))
        queries = mx.random.normal((1, 6, 1, 128), key=mx.random.key(50 + i))
        h = cache.attention_history()
        with mx.stream(mx.cpu):  # full float32 (MLX's GPU matmuls run at TF32 by default)
            ref = engine.compiled_decode(h, queries, 128 ** -0.5, compiled=False)
            mx.eval(ref)
        h.settings = h.settings.replace(backend=backend)
        out = partial.decode(h, queries, 128 ** -0.5, chunk=partial.THREADS)
        worst = max(worst, float(mx.max(mx.abs(out - ref))) / max(float(mx.max(mx.abs(ref))), 1e-30))
    return {"case": "format_partial", "backend": backend, "vs_compiled_decode": worst,
            "status": "ok" if worst <= partial.CHECK_TOLERANCE else "FAIL"}


def first_use_jobs(backend: str) -> list:
    """(name, job) of the first-use check of `backend`'s kernels: each job returns a record whose
    "status" is "ok" or "FAIL"."""
    jobs = [("encode", lambda: run_encode(backend, 128, 3, 128, 4, "norm", tokens=8)),
            ("format_encode", lambda: encode.check_record(backend, encode.CHECK_FORMATS[:1])),
            ("dequant", lambda: dequant_record(backend)), ("partial", lambda: partial_record(backend)),
            ("fused", lambda: run_fused(backend))]
    return jobs + [(case.name, lambda case=case: run_case(case, backend)) for case in FIRST_USE_CASES]


check.register_first_use_jobs(first_use_jobs)
