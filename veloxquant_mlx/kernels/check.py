"""First-use check of a GPU kernel back end: never a silent fallback.

The first time a process asks whether the kernels of `backend` may run (`usable`), they
are compiled and run on small cases of the self-test (`selftest.py`: encode, decode,
decode with sinks/window/centering, prefill) and compared with the portable path and a
float64 reference. The verdict is cached for the process. If a kernel fails, a warning
names the case, the kernel and the error, and the paths of that back end stand aside
for the engine's portable paths. `python -m veloxquant_mlx.kernels.selftest --backend
metal` remains the full check.

The CPU back ends have nothing to check here ("native" checks its module when it
loads, the emulator is for tests).
"""

from __future__ import annotations

import threading
import warnings

CHECKED_BACKENDS = ("cuda", "metal")
_VERDICTS = {}
_LOCK = threading.RLock()
_RUNNING = set()


def _cases():
    from .selftest import Case

    return [
        Case("check_decode", 128, 3, 4, 4, tokens=300, dtype="float16", seed=21),
        Case("check_window_center", 64, 4, 3, 2, tokens=200, seed=22,
             options={"residual_length": 8, "sink_tokens": 2, "center": True}),
        Case("check_prefill", 128, 3, 4, 4, tokens=300, queries=8, dtype="float16", seed=23),
    ]


_KERNELS = {"check_decode": "mse_partial + merge", "check_window_center": "mse_partial + merge (fp16 partial)",
            "check_prefill": "mse_dequant", "encode": "mse_encode", "dequant": "the formats' dequant kernel",
            "partial": "the formats' partial kernel", "format_encode": "the formats' encode kernel",
            "fused": "mse_partial + merge_encode_slide (fused decode step, window slid in the kernel)"}


def _dequant_record(backend: str) -> dict:
    """The formats' dequant kernel (`dequant.py`) against the codecs' MLX decode: a row format
    (turboquant_rvq) and a field format with per-block fields (kivi)."""
    import mlx.core as mx

    from ..cache import CompressedKVCache
    from ..config import KVCacheConfig
    from ..settings import EngineSettings
    from . import dequant, ops

    worst = 0.0
    for config in (KVCacheConfig(method="turboquant_rvq", bits=3), KVCacheConfig(method="kivi", bits=3, group_size=32)):
        cache = CompressedKVCache(config, settings=EngineSettings.resolve(backend="portable"))
        k = mx.random.normal((1, 2, 96, 128), key=mx.random.key(5))
        cache.update_and_fetch(k, mx.sin(k))
        for role, codec in (("keys", cache.key_codec), ("values", cache.value_codec)):
            out = dequant.dequantize(ops.runner(backend), cache.store, role, codec, cache.encoded, mx.float32)
            ref = codec.decode(cache.store.fields(role))
            worst = max(worst, float(mx.max(mx.abs(out - ref))) / max(float(mx.max(mx.abs(ref))), 1e-30))
    return {"vs_codec_decode": worst, "status": "ok" if worst <= 1e-5 else "FAIL"}


def usable(backend: str) -> bool:
    if backend not in CHECKED_BACKENDS:
        return True
    with _LOCK:
        if backend in _RUNNING:  # the check's own caches
            return True
        if backend not in _VERDICTS:
            _RUNNING.add(backend)
            try:
                _VERDICTS[backend] = _run(backend)
            finally:
                _RUNNING.discard(backend)
        return _VERDICTS[backend]


def _run(backend: str) -> bool:
    from . import encode, partial, selftest

    failures = []
    jobs = [("encode", lambda: selftest.run_encode(backend, 128, 3, 128, 4, "norm", tokens=8)),
            ("format_encode", lambda: encode.check_record(backend, encode.CHECK_FORMATS[:1])),
            ("dequant", lambda: _dequant_record(backend)), ("partial", lambda: partial.check_record(backend)),
            ("fused", lambda: selftest.run_fused(backend))]
    jobs += [(case.name, lambda case=case: selftest.run_case(case, backend)) for case in _cases()]
    for name, job in jobs:
        try:
            record = job()
        except Exception as error:  # noqa: BLE001 - any failure disables the back end, loudly
            failures.append(f"{name} ({_KERNELS[name]}): {error!r}"[:500])
            continue
        if record.get("status") == "FAIL":
            errors = {k: v for k, v in record.items()
                      if k.startswith("vs_") or k in ("codes_equal", "norm_rel_error", "rows_equal", "path")}
            failures.append(f"{name} ({_KERNELS[name]}): outside tolerance {errors}")
    if failures:
        from .. import engine

        engine.row_encoder.cache_clear()  # encoders chosen while the check ran used these kernels
        engine.field_encoder.cache_clear()
        warnings.warn(f"veloxquant_mlx: the {backend} kernels failed their first-use check and are off for this "
                      "process; every format attends and encodes on the engine's portable (MLX-ops) paths instead. "
                      + "; ".join(failures),
                      RuntimeWarning, stacklevel=3)
        return False
    return True


def reset():
    """Forget the verdicts (tests)."""
    with _LOCK:
        _VERDICTS.clear()
