"""Kernels for the "mse" format family (turboquant_mse keys and values), registered as
attention paths of the engine (`veloxquant_mlx.engine`).

Back ends (`settings.EngineSettings.backend`):

* ``cuda``: `mx.fast.cuda_kernel`, when MLX's CUDA back end is available and the
  default device is the GPU;
* ``metal``: `mx.fast.metal_kernel`, generated from the same templates; each kernel is
  checked against the portable path at first use (`check.py`), and a kernel that fails
  is reported in a warning and replaced by the portable path for the process;
* ``native``: on the CPU, one C++ MLX primitive (`native.py`, `csrc/mse_attention.cpp`)
  where the optional extension was built (`make setup` builds it);
* ``portable``: MLX ops, everywhere else;
* ``emulator``: the kernels' text compiled as C++ and run on the CPU (tests).

The paths read the codes through `engine.History` (never the cache) and the word
offsets of a row from its `formats.RowLayout`. Seeded Hadamard rotations of
power-of-two dims are applied inside the kernels, other rotations by MLX ops around
them. Other formats take the engine's paths for every format.
"""

from __future__ import annotations

import functools
import warnings
from typing import Optional

import mlx.core as mx

from .. import engine
from ..formats import RowLayout
from ..settings import CPU_BACKENDS, EngineSettings
from . import check, dequant, encode, launch, native, ops, partial, portable, step, templates

__all__ = ["backend", "decode_attention", "prefill_attention", "kernel_supported", "mse_rows",
           "check", "dequant", "encode", "launch", "native", "ops", "partial", "portable", "step", "templates"]

KERNEL_BACKENDS = ("cuda", "metal", "emulator")


def backend() -> str:
    """The back end a cache made now would use (for reports)."""
    return EngineSettings.resolve().backend


def mse_rows(layout) -> Optional[tuple]:
    """(key words, value words, row words) where `layout` is the row the mse kernels read:
    key codes, value codes, then one word of key norm (low half) and value norm (high
    half); None for any other layout."""
    if layout is None or layout.key.kernel != "mse" or layout.value.kernel != "mse":
        return None
    kc, vc = layout.slot("keys", "codes"), layout.slot("values", "codes")
    kn, vn = layout.slot("keys", "norm"), layout.slot("values", "norm")
    kw, vw = kc.field.words, vc.field.words
    if (kc.start, vc.start, kn.start, vn.start, layout.words) != (0, kw, 2 * (kw + vw), 2 * (kw + vw) + 1, kw + vw + 1):
        return None
    return kw, vw, layout.words


def kernel_supported(key_codec, value_codec=None) -> bool:
    """Whether the decode kernels take these codecs."""
    codecs = [key_codec] + ([value_codec] if value_codec is not None else [])
    if not all(c.format.kernel == "mse" for c in codecs):
        return False
    if value_codec is not None and key_codec.dim != value_codec.dim:
        return False
    if key_codec.dim % 32 or key_codec.dim > 1024:
        return False
    try:
        launch.value_group(key_codec.dim, launch.PARTIAL_THREADS, (value_codec or key_codec).bits)
    except ValueError:
        return False
    return True


@functools.lru_cache(maxsize=256)
def _decode_kernel_ok(key_codec, value_codec, rep: int, backend_name: str) -> bool:
    """Whether the decode kernels take this shape on `backend_name`, whose static shared memory per
    block is `partial.shared_limit` (Apple GPUs' 32 KB of threadgroup memory, under CUDA's 48)."""
    return kernel_supported(key_codec, value_codec) and launch.partial_shared_bytes(
        key_codec.dim, rep, key_codec.bits, value_codec.bits) <= partial.shared_limit(backend_name)


@functools.lru_cache(maxsize=64)
def _warn_no_kernel(backend_name: str, key_codec, value_codec, rep: int):
    reason = ("head dims differ" if key_codec.dim != value_codec.dim else
              f"head dim {key_codec.dim} is not a multiple of 32 up to 1024" if not kernel_supported(key_codec, value_codec)
              else f"the partial kernel would need {launch.partial_shared_bytes(key_codec.dim, rep, key_codec.bits, value_codec.bits)} "
                   f"bytes of shared memory (> {partial.shared_limit(backend_name)} on {backend_name})")
    warnings.warn(f"veloxquant_mlx: no {backend_name} decode kernel for turboquant_mse K{key_codec.bits}/V{value_codec.bits} "
                  f"d={key_codec.dim} with {rep} query heads per kv head ({reason}); this shape decodes on the next "
                  "registered path that takes it (the formats' kernels, else the engine's MLX-ops paths)",
                  RuntimeWarning, stacklevel=3)


def _mse(h) -> bool:
    return h.count > 0 and mse_rows(h.layout) is not None


def native_ragged_supported(key_codec, value_codec, layout) -> bool:
    """Whether the C++ kernel's ragged form (`native.mse_partials_ragged`: a batch of sequences of
    different lengths, `batch_decode.py`) takes these rows: turboquant_mse's, the codes behind a
    key map included, in `layout`, and a module built with it."""
    if not hasattr(native.module(), "mse_attention_partials_ragged"):
        return False
    keys = ops.codes_codec(key_codec)
    same = RowLayout.of(keys.format, value_codec.format)
    return (same is not None and same.slots == layout.slots and mse_rows(layout) is not None
            and kernel_supported(keys, value_codec))


def kernel_ragged_supported(settings, key_codec, value_codec, layout, rep: int) -> bool:
    """Whether the GPU kernels' ragged form (`step.ragged`: a batch of sequences of different
    lengths in one launch, `batch_decode.py`) takes these rows: turboquant_mse's in `layout`
    (not the codes behind a key map), on a usable kernel back end, in a shape its kernel takes."""
    name = settings.backend
    return (name in KERNEL_BACKENDS and mse_rows(layout) is not None and ops.codes_codec(key_codec) is key_codec
            and check.usable(name) and _decode_kernel_ok(key_codec, value_codec, rep, name))


def _mse_codes(h) -> bool:
    """mse rows, as the codecs' formats lay them out or as those of the codes behind a map (smoothed
    keys, `ops.codes_codec`), which the C++ kernel and the decode steps (`step.py`) apply themselves."""
    keys = ops.codes_codec(h.key_codec)
    if keys is h.key_codec:
        return _mse(h)
    layout = RowLayout.of(keys.format, h.value_codec.format)
    return (h.count > 0 and h.layout is not None and layout is not None and layout.slots == h.layout.slots
            and mse_rows(layout) is not None)


def _kernels_take(h, queries, mse=_mse) -> bool:
    """One query per head, mse rows (`mse`: which ones), a kernel back end, and a decode kernel for
    this shape (warned once per shape where there is none)."""
    name = h.settings.backend
    if name not in KERNEL_BACKENDS or not mse(h) or not check.usable(name):
        return False
    rep = queries.shape[1] // h.kv_heads
    keys = ops.codes_codec(h.key_codec)
    if not _decode_kernel_ok(keys, h.value_codec, rep, name):
        _warn_no_kernel(name, keys, h.value_codec, rep)
        return False
    return True


def _decode_call(queries, mask) -> bool:
    return queries.shape[2] == 1 and engine.plain_mask(mask)


# ---- decode_store: the pending token encoded, attended and stored by the kernels --------------

def _fused_supports(h, queries, mask) -> bool:
    if not (h.settings.compile_step and h.settings.backend in KERNEL_BACKENDS and _mse_codes(h)):
        return False
    keys = ops.codes_codec(h.key_codec)
    if keys.dim != h.value_codec.dim:
        return False
    if ops.constants(keys)["signs"] is None or ops.constants(h.value_codec)["signs"] is None:
        return False  # the merge encodes the new token: both rotations in-kernel (power-of-two dim)
    parts, fp16 = h.fp16_inputs()
    if parts < 0 or sum(a.shape[2] for a in fp16[::2]) > ops.MAX_PLAIN_TOKENS:
        return False  # merge_encode takes the sinks / window as held, up to MAX_PLAIN_TOKENS
    if queries is None:  # asked whether a decode token may wait (engine.defers)
        return check.usable(h.settings.backend)
    return _decode_call(queries, mask) and _kernels_take(h, queries, _mse_codes)


@engine.register_path("mse_fused_step", "decode_store", _fused_supports, priority=30, takes_kept=True, takes_sinks=True)
def fused_step(h, queries, scale, mask=None):
    """The kernels encode, attend to and store the waiting token (and slide the window). Tokens kept
    in fp16 past the window (`kept.py`) as in `kernel_step`; the token this step encodes left the
    window in it, and the cache settled it before the call (`KeptTokens.decode_step_sliding`)."""
    keys, values = h.pending
    return step.fused(h.settings.backend, h, queries, keys, values, scale)


# ---- decode ----------------------------------------------------------------------------------

def _step_supports(h, queries, mask) -> bool:
    return h.settings.compile_step and _decode_call(queries, mask) and _kernels_take(h, queries, _mse_codes)


@engine.register_path("mse_kernel_step", "decode", _step_supports, priority=20, takes_kept=True, takes_sinks=True)
def kernel_step(h, queries, scale, mask=None):
    """The partial and merge kernels (and the fp16 sinks/window partial), one compiled graph. Tokens
    kept in fp16 past the window (`kept.py`): two more splits take their codes' terms out and add
    them in fp16 (`ops.kept_splits`, one kernel)."""
    return step.attend(h.settings.backend, h, queries, scale)


def _native_supports(h, queries, mask) -> bool:
    # The C++ kernel takes queries mapped by the key codec's to_domain.
    return (h.settings.backend == "native" and _decode_call(queries, mask) and _mse_codes(h)
            and kernel_supported(ops.codes_codec(h.key_codec), h.value_codec))


@engine.register_path("mse_native", "decode", _native_supports, priority=20, takes_kept=True, takes_sinks=True)
def native_decode(h, queries, scale, mask=None):
    o, ml = native.mse_partials(queries, h.key_codec, h.value_codec, h.layout, h.store.rows, h.count, scale)
    return portable.merge(o, ml, h, queries, scale)


def _kivi_native_supports(h, queries, mask) -> bool:
    return h.settings.backend == "native" and h.count > 0 and _decode_call(queries, mask) and native.kivi_supported(h)


@engine.register_path("kivi_native", "decode", _kivi_native_supports, priority=20, takes_sinks=True)
def kivi_native_decode(h, queries, scale, mask=None):
    """KIVI on the CPU with the C++ extension (`csrc/kivi_attention.cpp`)."""
    o, ml = native.kivi_partials(queries, h, scale)
    return portable.merge(o, ml, h, queries, scale)


def _ops_supports(h, queries, mask) -> bool:
    return not h.settings.compile_step and _decode_call(queries, mask) and _kernels_take(h, queries)


@engine.register_path("mse_kernel_ops", "decode", _ops_supports, priority=10, takes_kept=True, takes_sinks=True)
def kernel_ops(h, queries, scale, mask=None, chunk: Optional[int] = None):
    """The kernels launched op by op (VELOXQUANT_COMPILE_STEP=0, and tests with a chunk size); kept
    tokens as in `kernel_step`."""
    run = ops.runner(h.settings.backend)
    tokens = h.fp16
    plain = None if tokens is None else engine.plain_partial(queries, *tokens, scale)
    o, ml, _ = ops.mse_partials(run, queries, h.key_codec, h.value_codec, h.store.rows, h.count, scale,
                                chunk=chunk or h.settings.split_tokens, mma=step.uses_tensor_cores(h.settings.backend, h, queries))
    if h.kept:
        o, ml, _ = ops.kept_splits(run, o, ml, queries, h.store.rows, h.key_codec, h.value_codec,
                                   *h.kept_kernel_inputs(), scale, h.key_mean, h.value_mean)
    o, ml = engine.with_sink_split(o, ml, h.sink_logits, h.value_codec, h.value_mean, queries, h.key_mean,
                                    scale)
    return ops.merge(run, o, ml, h.value_codec, queries.shape, queries.dtype, plain=plain, value_mean=h.value_mean)


def _portable_supports(h, queries, mask) -> bool:
    # On a GPU the engine's compiled decode (one graph per step) serves the portable back end.
    return (h.settings.backend in CPU_BACKENDS and mx.default_device().type == mx.DeviceType.cpu
            and _decode_call(queries, mask) and _mse(h))


@engine.register_path("mse_portable", "decode", _portable_supports, priority=5, takes_kept=True, takes_sinks=True)
def portable_decode(h, queries, scale, mask=None):
    """On the CPU without the C++ kernel: codes decoded a split at a time through a table of
    centroid groups (`portable.decode_unit`), MLX ops."""
    key_fields, value_fields = h.store.fields("keys"), h.store.fields("values")
    o, ml = portable.mse_partials(queries, h.key_codec, h.value_codec, key_fields, value_fields, h.count, scale)
    return portable.merge(o, ml, h, queries, scale)


# ---- prefill -----------------------------------------------------------------------------------

def _dequant_rows(h, role: str, dtype, tokens: int) -> mx.array:
    run = ops.runner(h.settings.backend)
    codec = h.key_codec if role == "keys" else h.value_codec
    return ops.mse_dequant(run, codec, h.layout, role, h.store.rows, tokens, dtype)


def _prefill_supports(h, queries, mask) -> bool:
    return (h.settings.backend in KERNEL_BACKENDS and h.settings.backend != "emulator" and _mse(h)
            and check.usable(h.settings.backend) and max(h.key_codec.dim, h.value_codec.dim) <= 1024
            and engine.sdpa_prefill_supports(h, queries, mask))


@engine.register_path("mse_kernel_prefill", "prefill", _prefill_supports, priority=10, takes_kept=True, takes_sinks=True)
def kernel_prefill(h, queries, scale, mask=None):
    """The engine's SDPA prefill with the history decoded by the dequant kernel."""
    return engine.sdpa_prefill(h, queries, scale, mask, decode=_dequant_rows)


# ---- every format with a decode snippet: the dequant kernel, then MLX's attention ---------------------

def _format_kernel_ok(h) -> bool:
    name = h.settings.backend
    return (name in ("cuda", "metal") and h.count > 0 and dequant.supported(h.key_codec)
            and dequant.supported(h.value_codec) and check.usable(name) and check.format_usable(h))


def _orthogonal(h) -> bool:
    return h.key_codec.format.orthogonal_domain and h.value_codec.format.orthogonal_domain


def _kernel_decoder(h, role: str, dtype, tokens: int) -> mx.array:
    codec = h.key_codec if role == "keys" else h.value_codec
    return dequant.dequantize(ops.runner(h.settings.backend), h.store, role, codec, tokens, dtype)


def _format_step_supports(h, queries, mask) -> bool:
    # The merge kernel attends to at most MAX_PLAIN_TOKENS fp16 tokens as held (a window buffer whole).
    held = h.sinks + (h.window if h.window_capacity is None else h.window_capacity)
    return (h.settings.compile_step and _decode_call(queries, mask) and _format_kernel_ok(h)
            and queries.shape[1] % h.kv_heads == 0 and held <= ops.MAX_PLAIN_TOKENS
            and partial.fits(h.store, h.key_codec, h.value_codec, queries.shape[1] // h.kv_heads, h.settings.backend))


@engine.register_path("format_kernel_step", "decode", _format_step_supports, priority=4, takes_sinks=True)
def format_kernel_step(h, queries, scale, mask=None):
    """Every format with decode snippets: the flash-decoding partial kernel over the codes
    (`partial.py`), the fp16 sinks/window partial and the merge, one compiled graph."""
    return partial.decode(h, queries, scale)


@engine.register_path("format_kernel_decode", "decode",
                      lambda h, q, mask: _decode_call(q, mask) and _format_kernel_ok(h), priority=3, takes_sinks=True)
def format_kernel_decode(h, queries, scale, mask=None):
    """The history decoded by the format's dequant kernel, then MLX's fused decode attention
    (orthogonal domains) or a compiled softmax over the decoded domain vectors."""
    if _orthogonal(h):
        return engine.sdpa_prefill(h, queries, scale, None, decode=_kernel_decoder)
    run, capacity = ops.runner(h.settings.backend), h.store.capacity
    dtype = engine.attention_dtype(queries)
    keys = dequant.dequantize(run, h.store, "keys", h.key_codec, capacity, dtype)
    values = dequant.dequantize(run, h.store, "values", h.value_codec, capacity, dtype)
    return engine.attend_decoded(h, queries, scale, keys, values)


@engine.register_path("format_kernel_prefill", "prefill",
                      lambda h, q, mask: _format_kernel_ok(h) and engine.sdpa_prefill_applies(h, q, mask), priority=5,
                      takes_kept=True, takes_sinks=True)
def format_kernel_prefill(h, queries, scale, mask=None):
    return engine.sdpa_prefill(h, queries, scale, mask, decode=_kernel_decoder)


# ---- encoding ----------------------------------------------------------------------------------

def _format_encoder_supports(layout, key_codec, value_codec, settings) -> bool:
    return (settings.backend in KERNEL_BACKENDS and encode.supported(layout, key_codec, value_codec)
            and check.usable(settings.backend)
            and check.format_encode_usable(settings.backend, layout, key_codec, value_codec))


@engine.register_encoder(_format_encoder_supports)
def _format_encoder(layout, key_codec, value_codec, settings):
    """Every per-token format whose codecs have encode snippets (`encode.py`), into its rows."""
    return functools.partial(encode.encode_rows, ops.runner(settings.backend), layout, key_codec, value_codec)


def _encoder_supports(layout, key_codec, value_codec, settings) -> bool:
    return (settings.backend in KERNEL_BACKENDS and mse_rows(layout) is not None
            and max(layout.key.dim, layout.value.dim) <= 1024 and check.usable(settings.backend))


@engine.register_encoder(_encoder_supports)
def _kernel_encoder(layout, key_codec, value_codec, settings):
    run = ops.runner(settings.backend)
    return functools.partial(ops.mse_encode_rows, run, key_codec, value_codec)


# ---- explicit back ends (tests, self-test, benchmarks) ---------------------------------------------

def _history(cache, using: Optional[str]):
    """The cache's `engine.History` (every pending token stored first), on back end `using`."""
    h = cache.attention_history()
    if using is not None:
        h.settings = h.settings.replace(backend=using)
    return h


def decode_attention(cache, queries: mx.array, scale: float, mask=None, *, using: Optional[str] = None,
                     chunk: Optional[int] = None) -> Optional[mx.array]:
    """Decode attention of `cache` through the mse path of back end `using` (default: the
    cache's): "cuda", "metal", "emulator" (kernels op by op, or the compiled step),
    "native", "portable"; None where no mse path takes the call."""
    h = _history(cache, using)
    if not (_decode_call(queries, mask) and _mse(h)):
        return None
    name = h.settings.backend
    if name == "native":
        return native_decode(h, queries, scale) if _native_supports(h, queries, mask) else None
    if name == "portable":
        return portable_decode(h, queries, scale)
    if not _kernels_take(h, queries):
        return None
    if chunk is None and h.settings.compile_step and name != "emulator":
        return kernel_step(h, queries, scale)
    return kernel_ops(h, queries, scale, chunk=chunk)


def prefill_attention(cache, queries: mx.array, scale: float, mask=None, *,
                      using: Optional[str] = None) -> Optional[mx.array]:
    """The kernel prefill of back end `using` (a GPU one, or "emulator" for tests), or None."""
    h = _history(cache, using)
    if h.settings.backend == "emulator":  # the dequant kernel in C++, MLX's SDPA on the CPU
        ok = _mse(h) and engine.sdpa_prefill_applies(h, queries, mask)
    else:
        ok = _prefill_supports(h, queries, mask)
    return engine.sdpa_prefill(h, queries, scale, mask, decode=_dequant_rows) if ok else None
