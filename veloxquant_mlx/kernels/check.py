"""First-use check of a GPU kernel back end: never a silent fallback.

The first time a process asks whether the kernels of `backend` may run (`usable`), they
are compiled and run on small cases that fill whole caches (`kernel_cases.py`, which
registers them: encode, decode, decode with sinks/window/centering, prefill) and compared with
the portable path and a float64 reference. The verdict is cached for the process. If a kernel fails, a warning
names the case, the kernel and the error, and the paths of that back end stand aside
for the engine's portable paths. `python -m veloxquant_mlx.kernels.selftest --backend
metal` remains the full check.

Every other format's kernels are rendered from its codecs' snippets, so on Metal they are
checked the same way at their own first use (`format_usable`, `format_encode_usable`): the dequant
and partial kernels on the history of the first cache that asks, against the codecs' MLX
decode and the engine's MLX-ops decode on the CPU, and the encode kernel on a few random
tokens against `encode`, once per process and rendered kernel. A failure warns, naming the
format, the kernel and the error, and that format's kernel paths stand aside for the
portable ones; the other formats keep theirs.

The CPU back ends have nothing to check here ("native" checks its module when it
loads, the emulator is for tests).
"""

from __future__ import annotations

import threading
import warnings
from typing import Callable, Optional

CHECKED_BACKENDS = ("cuda", "metal")
# The formats' own kernels are checked at first use on Metal, where they have never run (no Mac);
# on CUDA the self-test checks every format's kernels on each device (docs/kernels.md), and
# the first-use check's extra compiles were not measured there.
FORMAT_CHECKED_BACKENDS = ("metal",)
# (name, job) of a back end's first-use check: `kernel_cases.py` registers them
# (`register_first_use_jobs`), since they fill whole caches, a layer above the kernels.
_FIRST_USE_JOBS: Optional[Callable[[str], list]] = None
# On a GPU, MLX runs float32 matmuls and SDPA at TF32 precision unless MLX_ENABLE_TF32=0.
TF32_TOLERANCE = 2e-3
_VERDICTS = {}
_LOCK = threading.RLock()
_RUNNING = set()


_KERNELS = {"check_decode": "mse_partial + merge", "check_window_center": "mse_partial + merge (fp16 partial)",
            "check_prefill": "mse_dequant", "encode": "mse_encode", "dequant": "the formats' dequant kernel",
            "partial": "the formats' partial kernel", "format_encode": "the formats' encode kernel",
            "fused": "mse_partial + merge_encode_slide (fused decode step, window slid in the kernel)"}


DEQUANT_TOLERANCE = 1e-5  # the dequant kernel against the codecs' decode, relative (float32, same maths)


# ---- what the first-use checks and the self-test compare (kernels against the MLX-ops maths) ----

def _rel(out, ref) -> float:
    import mlx.core as mx

    return float(mx.max(mx.abs(out - ref))) / max(float(mx.max(mx.abs(ref))), 1e-30)


def dequant_error(backend: str, store, key_codec, value_codec, tokens: int) -> float:
    """`backend`'s dequant kernel on the first `tokens` of `store`, both roles, against the codecs'
    `decode` in float32 on the CPU: the worst relative error."""
    import mlx.core as mx

    from . import dequant, ops

    worst = 0.0
    for role, codec in (("keys", key_codec), ("values", value_codec)):
        out = dequant.dequantize(ops.runner(backend), store, role, codec, tokens, mx.float32)
        with mx.stream(mx.cpu):
            ref = codec.decode(store.fields(role, 0, tokens))
            mx.eval(ref)
        worst = max(worst, _rel(out, ref))
    return worst


def partial_error(h, rep: int = 1, seed: int = 31) -> float:
    """The formats' partial kernel over `h` (an `engine.History`, its back end's) against the
    engine's MLX-ops decode in float32 on the CPU, `rep` random queries per kv head."""
    import mlx.core as mx

    from .. import engine
    from . import partial

    batch = next(iter(h.store.fields("keys", 0, 1).values())).shape[0]
    q = mx.random.normal((batch, h.kv_heads * rep, 1, h.key_codec.dim), key=mx.random.key(seed))
    scale = h.key_codec.dim ** -0.5
    with mx.stream(mx.cpu):  # full float32 (MLX's GPU matmuls run at TF32 by default)
        ref = engine.compiled_decode(h, q, scale, compiled=False)
        mx.eval(ref)
    return _rel(partial.decode(h, q, scale, chunk=partial.THREADS), ref)


def partial_tolerance(backend: str) -> float:
    import os

    from . import partial

    if backend in ("cuda", "metal") and os.environ.get("MLX_ENABLE_TF32", "1") != "0":
        return max(partial.CHECK_TOLERANCE, TF32_TOLERANCE)  # a dense query map is an MLX matmul there
    return partial.CHECK_TOLERANCE


def encode_agreement(backend: str, layout, key_codec, value_codec, tokens: int = 8, seed: int = 32):
    """`backend`'s encode kernel on `tokens` random fp16 tokens per head against the codecs' `encode`
    on the CPU: (share of equal packed words, worst relative error of the fp16 scalars, whether
    every field matched by name and shape), as `encode.fields_agreement`."""
    import mlx.core as mx

    from . import encode, ops

    heads = getattr(key_codec, "heads", None) or getattr(value_codec, "heads", None) or 2  # per-head codecs' own
    keys = mx.random.normal((1, heads, tokens, key_codec.dim), key=mx.random.key(seed)).astype(mx.float16)
    values = mx.random.normal((1, heads, tokens, value_codec.dim), key=mx.random.key(seed + 1)).astype(mx.float16)
    got = layout.views(encode.encode_rows(ops.runner(backend), layout, key_codec, value_codec, keys, values))
    with mx.stream(mx.cpu):
        refs = (key_codec.encode(keys), value_codec.encode(values))
        mx.eval(refs)
    return encode.fields_agreement(got, refs)


def encode_ok(agreement) -> bool:
    from . import encode

    equal, half_error, same = agreement
    return same and equal >= encode.CHECK_MIN_EQUAL and half_error <= encode.CHECK_HALF_ERROR


def register_first_use_jobs(jobs: Callable[[str], list]) -> None:
    global _FIRST_USE_JOBS
    _FIRST_USE_JOBS = jobs


def usable(backend: str) -> bool:
    if backend not in CHECKED_BACKENDS:
        return True
    return _decided(backend, lambda: _run(backend))


def _decided(key, decide) -> bool:
    """The process's verdict for `key`, from `decide()` the first time it is asked (True while
    `decide` runs: the check's own calls ask too)."""
    with _LOCK:
        if key in _RUNNING:
            return True
        if key not in _VERDICTS:
            _RUNNING.add(key)
            try:
                _VERDICTS[key] = decide()
            finally:
                _RUNNING.discard(key)
        return _VERDICTS[key]


def _run(backend: str) -> bool:
    if _FIRST_USE_JOBS is None:
        raise RuntimeError("no first-use kernel checks are registered: import veloxquant_mlx "
                           "(kernel_cases.py registers them)")
    jobs = _FIRST_USE_JOBS(backend)
    failures = _failures(jobs)
    if failures:
        from .. import engine

        engine.row_encoder.cache_clear()  # encoders chosen while the check ran used these kernels
        engine.field_encoder.cache_clear()
        warnings.warn(f"veloxquant_mlx: the {backend} kernels failed their first-use check and are off for this "
                      "process; every format attends and encodes on the engine's portable (MLX-ops) paths instead. "
                      + "; ".join(failures),
                      RuntimeWarning, stacklevel=5)
        return False
    return True


def format_usable(h) -> bool:
    """Whether the dequant and partial kernels of the format of `h` (an `engine.History`) may run on
    its back end: checked on `h` the first time this process renders them."""
    from . import dequant

    backend = h.settings.backend
    if backend not in FORMAT_CHECKED_BACKENDS:
        return True
    if not usable(backend):
        return False
    key = ("decode", backend, type(h.store).__name__, dequant.program(h.store, "keys", h.key_codec).kernel,
           dequant.program(h.store, "values", h.value_codec).kernel)
    return _verdict(key, lambda: _format_decode_jobs(h), _format_name(h.key_codec, h.value_codec), backend)


def format_encode_usable(backend: str, layout, key_codec, value_codec) -> bool:
    """Whether the encode kernel of this row layout's codecs may run on `backend`: checked on a few
    random tokens the first time this process renders it."""
    from . import encode

    if backend not in FORMAT_CHECKED_BACKENDS:
        return True
    if not usable(backend):
        return False
    key = ("encode", backend, encode.program(layout, key_codec, value_codec).kernel)
    record = lambda: _format_encode_record(backend, layout, key_codec, value_codec)  # noqa: E731
    return _verdict(key, lambda: [("format_encode", record)], _format_name(key_codec, value_codec), backend)


def _format_name(key_codec, value_codec) -> str:
    return f"{key_codec.format.name} keys / {value_codec.format.name} values"


def _verdict(key, jobs, what: str, backend: str) -> bool:
    def decide():
        failures = _failures(jobs())
        if failures:
            from .. import engine

            engine.row_encoder.cache_clear()  # an encoder chosen before the verdict
            warnings.warn(f"veloxquant_mlx: the {backend} kernels of {what} failed their first-use check and are "
                          "off for this process; what they did (attend, or encode) runs on the engine's portable "
                          "(MLX-ops) paths instead for that format. " + "; ".join(failures), RuntimeWarning,
                          stacklevel=6)
        return not failures

    return _decided(key, decide)


def _format_decode_jobs(h) -> list:
    from . import partial

    backend = h.settings.backend

    def dequant_record():
        error = dequant_error(backend, h.store, h.key_codec, h.value_codec, h.count)
        return {"vs_codec_decode": error, "status": "ok" if error <= DEQUANT_TOLERANCE else "FAIL"}

    def partial_record():
        error = partial_error(h)
        return {"vs_compiled_decode": error, "status": "ok" if error <= partial_tolerance(backend) else "FAIL"}

    jobs = [("dequant", dequant_record)]
    if partial.fits(h.store, h.key_codec, h.value_codec, 1, backend):
        jobs.append(("partial", partial_record))
    return jobs


def _format_encode_record(backend: str, layout, key_codec, value_codec) -> dict:
    equal, half_error, same = agreement = encode_agreement(backend, layout, key_codec, value_codec)
    return {"codes_equal": equal, "norm_rel_error": half_error, "status": "ok" if encode_ok(agreement) else "FAIL"}


def _failures(jobs) -> list:
    """What failed of `jobs` ((name, record function) pairs), each naming its kernel."""
    failures = []
    for name, job in jobs:
        try:
            record = job()
        except Exception as error:  # noqa: BLE001 - any failure disables the kernels, loudly
            failures.append(f"{name} ({_KERNELS[name]}): {error!r}"[:500])
            continue
        if record.get("status") == "FAIL":
            errors = {k: v for k, v in record.items()
                      if k.startswith("vs_") or k in ("codes_equal", "norm_rel_error", "rows_equal", "path")}
            failures.append(f"{name} ({_KERNELS[name]}): outside tolerance {errors}")
    return failures


def reset():
    """Forget the verdicts (tests)."""
    with _LOCK:
        _VERDICTS.clear()
