"""turboquant_mse operations on packed codes, written once against a kernel runner.

A runner maps (plan, input arrays, output shapes) to output arrays:
`mx.fast.cuda_kernel`, `mx.fast.metal_kernel` or the C++ emulator
(`runner(name)`). `portable.py` has the same operations in MLX ops.

Decoding runs once per layer per generated token, so these functions keep
their MLX graph small: codec constants and the small int32 parameter arrays are
built once and reused, arrays go to the kernels in their stored shapes (the
kernels index flat memory), and outputs come back in their final shapes.
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx

from ..methods.smoothing import scale_queries
from ..methods.turboquant_mse import SCALES
from ..rotations import HadamardRotation
from . import launch, templates

Runner = Callable[..., List[mx.array]]


_RUNNERS: Dict[str, Runner] = {}



def runner(name: str) -> Runner:
    """"cuda", "metal" (mx.fast kernels) or "emulator" (the C++ emulation, CPU)."""
    run = _RUNNERS.get(name)
    if run is None:
        run = _RUNNERS[name] = _make_runner(name)
    return run


def _make_runner(name: str) -> Runner:
    if name in ("cuda", "metal"):
        return lambda plan, inputs, shapes=None: launch.run_mlx(name, plan, inputs, shapes)
    if name == "emulator":
        import numpy as np

        def run(plan, inputs, shapes=None):
            outs = launch.run_emulator(plan, [np.array(a) for a in inputs])
            shapes = shapes or [o.shape for o in outs]
            return [mx.array(o.reshape(s)) for o, s in zip(outs, shapes)]

        return run
    raise ValueError(f"unknown kernel runner {name!r}")


# ---- constants, built once --------------------------------------------------

from ..engine import FP16_HELD_LIMIT, small_array  # noqa: E402  (re-exported for the kernels' callers)


_DUMMY: Dict[object, mx.array] = {}


def _dummy(dtype=mx.float32) -> mx.array:
    # Built from host data, not mx.zeros: a lazily computed zeros first made while
    # mx.compile traces a step would be recomputed (one more kernel) on every call.
    # METAL_CONSTANT_ELEMENTS long: Metal passes a shorter input in its constant address space,
    # and a kernel's pointer that may point into a dummy or a real input (pa_k or pb_k) must
    # see both in one address space.
    if dtype not in _DUMMY:
        _DUMMY[dtype] = mx.array([0.0] * templates.METAL_CONSTANT_ELEMENTS, dtype=dtype)
        mx.eval(_DUMMY[dtype])
    return _DUMMY[dtype]


def codes_codec(codec):
    """The codec whose codes `codec` stores and whose domain elements it decodes to (a smoothed key
    codec's base, `methods/smoothing.py`; else `codec` itself): a kernel that takes queries already
    mapped by `codec.to_domain` reads the codes with this codec's constants."""
    return getattr(codec, "codes_codec", codec)


def constants(codec) -> dict:
    """float32 signs (None unless the kernels rotate themselves), centroids, boundaries."""
    cached = getattr(codec, "_vq_kernel_constants", None)
    if cached is None:
        signs = None
        if isinstance(codec.rotation, HadamardRotation) and launch.is_power_of_two(codec.rotation.dim):
            signs = codec.rotation.signs.astype(mx.float32)
        cached = {
            "signs": signs,
            "centroids": codec.centroids.astype(mx.float32),
            "boundaries": codec.boundaries.astype(mx.float32),
        }
        mx.eval([v for v in cached.values() if v is not None])
        codec._vq_kernel_constants = cached
    return cached


# ---- encoding -----------------------------------------------------------------

def scale_index(codec) -> int:
    """The kernels' SCALE constant for an mse codec: its stored scale's index in `SCALES`."""
    return SCALES.index(codec.scale)


def _role(codec, x):
    consts = constants(codec)
    rotate = consts["signs"] is not None
    if not rotate:  # a dense (or non power-of-two Hadamard) rotation: rotate first
        x = codec.rotation.apply(x.astype(mx.float32))
    spec = (codec.dim, codec.bits, rotate, scale_index(codec))
    return x, spec, consts


def encode_inputs(keys: mx.array, values: mx.array):
    """Keys and values in one input dtype an encode kernel takes (float32 unless both are the same
    float16, bfloat16 or float32)."""
    if keys.dtype != values.dtype or keys.dtype not in (mx.float16, mx.float32, mx.bfloat16):
        return keys.astype(mx.float32), values.astype(mx.float32)
    return keys, values


def mse_encode_rows(run: Runner, key_codec, value_codec, keys: mx.array, values: mx.array) -> mx.array:
    """Rows (..., n, KW + VW + 1) of `rows.py` for keys and values (..., n, D), one launch:
    what `RowLayout.encode` computes with the codecs' MLX ops."""
    *lead, _ = keys.shape
    keys, values = encode_inputs(keys, values)
    keys, kspec, kc = _role(key_codec, keys)
    values, vspec, vc = _role(value_codec, values)
    keys, values = encode_inputs(keys, values)  # a role rotated by MLX ops comes back float32
    plan = launch.encode_plan(math.prod(lead), kspec, vspec, launch.dtype_name(keys.dtype))
    (rows,) = run(plan, [
        keys, values, kc["signs"] if kc["signs"] is not None else _dummy(),
        vc["signs"] if vc["signs"] is not None else _dummy(),
        kc["boundaries"], vc["boundaries"], kc["centroids"], vc["centroids"],
    ], [(*lead, plan.output_shapes[0][1])])
    return rows


# ---- decoding attention ---------------------------------------------------------

def mse_partials(run: Runner, queries: mx.array, key_codec, value_codec, rows: mx.array,
                 tokens: int, scale: float, chunk: Optional[int] = None, mma: bool = False,
                 threads: Optional[int] = None):
    """Flash-decoding partials of single-token queries (B, Hq, 1, D) over the first
    `tokens` of `rows` (B, H, capacity, RW; `rows.py`): (o (BH, S, REP, Dv) in the
    value domain, ml (BH, S, REP, 2)), and the plan used; `mma`: the tensor-core kernel;
    `threads`: per block, instead of the plan's default."""
    B, n_heads, L, dim = queries.shape
    if L != 1:
        raise ValueError("the decode kernels take one query per head")
    kv_heads, capacity = rows.shape[1], rows.shape[2]
    rotate_query = constants(key_codec)["signs"] is not None
    q_dtype = queries.dtype if rotate_query and queries.dtype in (mx.float16, mx.float32, mx.bfloat16) else mx.float32
    plan = launch.decode_partial_plan(mma, B * kv_heads, n_heads // kv_heads, dim, key_codec.bits, value_codec.bits,
                                      tokens, capacity, rotate_query=rotate_query,
                                      q_dtype=launch.dtype_name(q_dtype), chunk=chunk,
                                      **({} if threads is None else {"threads": threads}))
    o, ml = run_partials(run, plan, queries, key_codec, value_codec, rows, scale,
                         small_array(tuple(plan.meta["meta"])))
    return o, ml, plan


def run_partials(run: Runner, plan, queries, key_codec, value_codec, rows, scale: float, meta: mx.array,
                 key_scale: Optional[mx.array] = None):
    """The partial kernel of `plan`; `meta` = int32 [tokens, chunk, capacity, splits]. `key_scale`:
    smoothed keys' scales (H, D), whose codes `key_codec` (the base's) reads; the queries take
    them in the kernel when it rotates them (the plan's KSC), else here."""
    kc, vc = constants(key_codec), constants(value_codec)
    if kc["signs"] is None:
        q = queries.astype(mx.float32) * scale
        q = key_codec.to_domain(q if key_scale is None else scale_queries(q, key_scale))
        qscale, key_scale = small_array((1.0,), mx.float32), None
    else:
        q = queries if queries.dtype in (mx.float16, mx.float32, mx.bfloat16) else queries.astype(mx.float32)
        qscale = small_array((float(scale),), mx.float32)
    return run(plan, [
        q, rows, kc["centroids"], vc["centroids"],
        kc["signs"] if kc["signs"] is not None else _dummy(), meta, qscale,
        _dummy() if key_scale is None else key_scale,
    ])


def merge(run: Runner, o: mx.array, ml: mx.array, value_codec, out_shape: Tuple[int, ...], out_dtype,
          plain: Optional[Tuple[mx.array, mx.array]] = None, value_mean: Optional[mx.array] = None,
          tokens: Optional["FP16Tokens"] = None) -> mx.array:
    """Softmax-merge the splits (and `plain` = (o (BH*REP, Dv) in the output domain,
    ml (BH*REP, 2)), or the fp16 `tokens` attended to in the kernel), leave the value
    domain, divide: the attention output `out_shape`. The kernel takes value codecs that
    `merge_domain` names; others merge with MLX ops (`engine.merge_partials`)."""
    bh, splits, rep, dim = o.shape
    domain = merge_domain(value_codec, dim)
    if domain is None:
        from ..engine import fp16_tokens, merge_partials, plain_partial

        if tokens is not None:
            joined = fp16_tokens(len(tokens.parts) // 2, tokens.parts, tokens.key_mean)
            plain = None if joined is None else plain_partial(tokens.queries, *joined, tokens.scale)
        return merge_partials(o, ml, value_codec, out_shape, out_dtype, plain=plain, value_mean=value_mean)
    signs = domain[1] if domain[0] == "hadamard" else None
    vmap = domain[1] if domain[0] == "dense" else None
    parts = tokens.parts if tokens is not None else []
    x_dtype = parts[0].dtype if parts else mx.float32
    if x_dtype not in (mx.float16, mx.float32, mx.bfloat16) or any(a.dtype != x_dtype for a in parts):
        parts, x_dtype = [a.astype(mx.float32) for a in parts], mx.float32
    held_window = tokens is not None and tokens.meta is not None  # pb: a window buffer filled in part
    pa, pb, na, nb, bound = _token_slots(parts, _dummy(x_dtype), held_window, "merge")
    meta = tokens.meta if held_window else small_array((splits, na, nb, nb))
    plan = launch.merge_plan(bh, rep, dim, splits, unrotate=signs is not None, plain=plain is not None,
                             value_mean=value_mean is not None, out_dtype=launch.dtype_name(out_dtype),
                             tokens=bound, x_dtype=launch.dtype_name(x_dtype),
                             unmap=0 if vmap is None else vmap.shape[0])
    centered = bool(bound) and value_mean is not None
    if centered and tokens.key_mean is None:
        raise ValueError("centred values need the key mean to centre the fp16 keys (FP16Tokens.key_mean)")
    inputs = [
        o, ml, signs if signs is not None else _dummy(), meta,
        plain[0] if plain is not None else _dummy(),
        plain[1] if plain is not None else _dummy(),
        value_mean.astype(mx.float32) if value_mean is not None else _dummy(),
        tokens.queries if bound else _dummy(), small_array((float(tokens.scale if bound else 1.0),), mx.float32),
        tokens.key_mean.astype(mx.float32) if centered else _dummy(), *pa, *pb,
        vmap if vmap is not None else _dummy(),
    ]
    (out,) = run(plan, inputs, [tuple(out_shape)])
    return out


@dataclass(frozen=True)
class FP16Tokens:
    """What `merge` needs to attend to the fp16 sinks / window itself: the queries (B, Hq, 1, D),
    the parts as held ([keys, values] or [keys, values, keys, values], (B, H, n, D), keys not
    centred), the softmax scale and the key mean (None: not centred). `meta`: the merge kernel's
    int32 [splits, sinks, window, window capacity] where the window is held in a buffer of fixed
    capacity that it fills only in part (`merge_meta`); None: every part is held exactly."""
    queries: mx.array
    parts: List[mx.array]
    scale: float
    key_mean: Optional[mx.array] = None
    meta: Optional[mx.array] = None


def merge_meta(splits: int, sinks: int, window: int, capacity: int) -> mx.array:
    """`FP16Tokens.meta` (one small array per step, shared by every layer)."""
    return small_array((splits, sinks, window, capacity))


def _token_slots(parts: List[mx.array], dummy: mx.array, window_last: bool, kernel: str):
    """The merge kernels' two fp16 slots from `parts` ([keys, values] or [keys, values, keys,
    values]): (pa, pb, tokens held in pa, in pb, PMAX bound), a missing slot filled with `dummy`.
    `window_last`: the last pair is the window and goes to pb (a ring slid by the kernel, or a
    buffer filled in part), the sinks if any to pa; else the parts fill pa, then pb."""
    if window_last:
        pa, pb = (parts[:2] if len(parts) > 2 else [dummy, dummy]), parts[-2:]
    else:
        pa, pb = (parts[:2] or [dummy, dummy]), (parts[2:4] or [dummy, dummy])
    na = pa[0].shape[2] if pa[0] is not dummy else 0
    nb = pb[0].shape[2] if pb[0] is not dummy else 0
    if na + nb > MAX_PLAIN_TOKENS:
        raise ValueError(f"{kernel} attends to at most {MAX_PLAIN_TOKENS} fp16 tokens, got {na + nb}")
    bound = 0 if na + nb == 0 else max(32, 1 << (na + nb - 1).bit_length())  # few kernel variants as a window fills
    return pa, pb, na, nb, bound


def merge_domain(value_codec, dim: int):
    """How the merge kernel leaves `value_codec`'s domain: ("identity", None), ("hadamard", signs)
    for a seeded-sign Hadamard rotation it undoes in-kernel, ("dense", matrices) for any other
    linear map, one (D, D) per head (`dense_value_map`), or None (MLX ops) for a dim the
    kernel's one-thread-per-coordinate block does not take."""
    if not launch.is_power_of_two(dim) or dim > 1024 or value_codec.format.domain_dim != dim:
        return None
    if value_codec.domain == "identity":
        return "identity", None
    rotation = getattr(value_codec, "rotation", None)
    if value_codec.domain == "rotation" and isinstance(rotation, HadamardRotation) and rotation.dim == dim:
        signs = getattr(value_codec, "_vq_merge_signs", None)
        if signs is None:
            signs = value_codec._vq_merge_signs = rotation.signs.astype(mx.float32)
            mx.eval(signs)
        return "hadamard", signs
    return "dense", dense_value_map(value_codec, dim)


def dense_value_map(value_codec, dim: int) -> mx.array:
    """(H, D, D) float32 with from_domain(y) = y @ m[head] for each of the codec's H heads (1 for a map
    shared by all heads): from_domain of the identity, which is linear (`methods/base.py`), computed once."""
    matrices = getattr(value_codec, "_vq_merge_map", None)
    if matrices is None:
        heads = getattr(value_codec, "heads", 1)
        eye = mx.broadcast_to(mx.eye(dim, dtype=mx.float32), (1, heads, dim, dim))
        with mx.stream(mx.cpu):  # float32 exactly (MLX's GPU matmuls run at TF32 by default)
            matrices = value_codec.from_domain(eye)[0].astype(mx.float32)
            mx.eval(matrices)
        value_codec._vq_merge_map = matrices
    return matrices


def mse_dequant(run: Runner, codec, layout, role: str, rows: mx.array, tokens: int, out_dtype=mx.float16) -> mx.array:
    """codec.decode of the first `tokens` of `rows` for `role` ("keys" or "values"):
    (B, H, tokens, D) in the codec's domain; word offsets from the row `layout`."""
    B, H, cap, _ = rows.shape
    codes, norm = layout.slot(role, "codes"), layout.slot(role, "norm")
    plan = launch.dequant_plan(B * H, codec.dim, codec.bits, tokens, cap, out_dtype=launch.dtype_name(out_dtype),
                               row_words=layout.words, offset=codes.start, norm_half=norm.start)
    (out,) = run(plan, [rows, constants(codec)["centroids"], small_array(tuple(plan.meta["meta"]))],
                 [(B, H, tokens, codec.dim)])
    return out


MAX_PLAIN_TOKENS = FP16_HELD_LIMIT  # fp16 sinks + window tokens merge_encode attends to itself


def merge_encode(run: Runner, o: mx.array, ml: mx.array, queries: mx.array, keys: mx.array, values: mx.array,
                 key_codec, value_codec, scale: float, out_dtype, key_mean=None, value_mean=None,
                 fp16: Optional[List[mx.array]] = None, slide: Optional[mx.array] = None,
                 key_scale: Optional[mx.array] = None):
    """`merge` that also encodes the new token (keys / values (B, H, 1, D)) and attends to
    it from its codes, and to `fp16` tokens: [keys, values] or [keys, values, keys, values]
    (B, H, n, D) as held (the sinks and the window; keys not centred), at most
    MAX_PLAIN_TOKENS. (out (B, Hq, 1, D), its row (B, H, 1, RW) for `rows.py`).

    `slide`: the window is the last pair of `fp16`, held as a ring, and this step slides it
    (`merge_encode_slide`): the token encoded is the window's at slot `slide[3]`, keys / values
    take its place, and the window after the slide comes back too. `slide` is the kernel's
    int32 meta array [splits, sinks, window, slot, kept], made by the caller (a compiled step takes
    it as an input: the slot changes every step); kept != 0: the encoded token is not attended
    to from its codes (`kept.py`). (out, row, window keys, window values).
    `key_scale`: smoothed keys' scales (H, D), whose codes `key_codec` (the base's) makes: the
    key is encoded as (k - mean) / s and scored with q * s; the fp16 tokens meet q as held."""
    bh, splits, rep, dim = o.shape
    kc, vc = constants(key_codec), constants(value_codec)
    if keys.dtype != values.dtype or keys.dtype not in (mx.float16, mx.float32, mx.bfloat16):
        keys, values = keys.astype(mx.float32), values.astype(mx.float32)
    centered = key_mean is not None
    parts = [a if a.dtype == keys.dtype else a.astype(keys.dtype) for a in (fp16 or [])]
    pa, pb, na, nb, bound = _token_slots(parts, _dummy(keys.dtype), slide is not None, "merge_encode")
    window = nb if slide is not None else 0
    meta = slide if slide is not None else small_array((splits, na, nb))
    B, H = keys.shape[:2]
    plan = launch.merge_encode_plan(bh, rep, dim, splits, (key_codec.bits, scale_index(key_codec)),
                                    (value_codec.bits, scale_index(value_codec)), center=centered,
                                    x_dtype=launch.dtype_name(keys.dtype), out_dtype=launch.dtype_name(out_dtype),
                                    plain_tokens=bound, slide_window=window,
                                    key_scale_heads=0 if key_scale is None else key_scale.shape[0])
    shapes = [tuple(queries.shape), (B, H, 1, plan.output_shapes[1][1])] + [(B, H, window, dim)] * (2 if window else 0)
    return tuple(run(plan, [
        o, ml, queries, keys, values, kc["signs"], vc["signs"], kc["boundaries"], vc["boundaries"],
        kc["centroids"], vc["centroids"], meta, small_array((float(scale),), mx.float32),
        key_mean if centered else _dummy(), value_mean if centered else _dummy(), *pa, *pb,
        _dummy() if key_scale is None else key_scale,
    ], shapes))


# ---- tokens kept in fp16 past the window (`kept.py`) ---------------------------------------------

def kept_splits(run: Runner, o: mx.array, ml: mx.array, queries: mx.array, rows: mx.array, key_codec, value_codec,
                kept_keys: mx.array, kept_values: mx.array, positions: mx.array, meta: mx.array, scale: float,
                key_mean=None, value_mean=None, key_scale: Optional[mx.array] = None,
                slide: Optional[mx.array] = None):
    """The splits `o` (BH, S, REP, D), `ml` (BH, S, REP, 2) of a decode step that scored every stored
    code with the two of `engine.kept_partials` after them, made in one kernel (`templates.KEPT_SPLITS`),
    as `engine.kept_splits` makes them with MLX ops: (o, ml, slide meta with two more splits and [4]
    set where the token at row meta[0] is kept, or None without `slide`). `kept_*` are the slots whole
    (spare included), `meta` int32 [stored rows, first coded position, rows' capacity, slots];
    `key_codec` the codes' (smoothed keys: the base's, `key_scale`)."""
    kc, vc = constants(key_codec), constants(value_codec)
    B, n_heads, _, dim = queries.shape
    kv_rows = rows.shape[0] * rows.shape[1]
    centered = key_mean is not None
    plan = launch.kept_splits_plan(kv_rows, n_heads // (kv_rows // B), dim, key_codec.bits, value_codec.bits,
                                   positions.shape[0], center=centered, x_dtype=launch.dtype_name(kept_keys.dtype),
                                   key_scale_heads=0 if key_scale is None else key_scale.shape[0])
    o_kept, ml_kept, kept_slide = run(plan, [
        queries, rows, kc["centroids"], vc["centroids"], kc["signs"], vc["signs"], kept_keys, kept_values, positions,
        meta, small_array((float(scale),), mx.float32), key_mean if centered else _dummy(),
        value_mean if centered else _dummy(), _dummy() if key_scale is None else key_scale,
        small_array((0, 0, 0, 0, 0)) if slide is None else slide,
    ])
    return (mx.concatenate([o, o_kept], axis=1), mx.concatenate([ml, ml_kept], axis=1),
            None if slide is None else kept_slide)


def kept_settle(run: Runner, queries: mx.array, ring_keys: mx.array, ring_values: mx.array, entering_keys: mx.array,
                sink_keys: Optional[mx.array], running: mx.array, meta: mx.array, scale: float, threshold: float,
                count: mx.array, kept_keys: mx.array, kept_values: mx.array, positions: mx.array):
    """`KeptTokens.decode_step_sliding`'s bookkeeping in one kernel (`templates.KEPT_SETTLE`): (running
    shares, kept keys, kept values, positions, count) after the step. `meta` int32 [ring slot, first
    position, query position, first fp16 position, slots' capacity, sinks, slots]."""
    _, heads, window, dim = ring_keys.shape
    plan = launch.kept_settle_plan(heads, queries.shape[1] // heads, dim, window,
                                   0 if sink_keys is None else sink_keys.shape[2], positions.shape[0],
                                   x_dtype=launch.dtype_name(ring_keys.dtype))
    shapes = [running.shape, kept_keys.shape, kept_values.shape, positions.shape, count.shape]
    return tuple(run(plan, [
        queries, ring_keys, ring_values, entering_keys.astype(ring_keys.dtype),
        _dummy(ring_keys.dtype) if sink_keys is None else sink_keys.astype(ring_keys.dtype), running, meta,
        small_array((float(scale), float(threshold)), mx.float32), count, kept_keys, kept_values, positions,
    ], shapes))
