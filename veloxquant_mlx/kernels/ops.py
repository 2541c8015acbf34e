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

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from ..rotations import HadamardRotation
from . import launch

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

_SMALL: Dict[tuple, mx.array] = {}


def small_array(values: Tuple, dtype=mx.int32) -> mx.array:
    """A tiny constant array, shared by every call with the same values (all
    layers of a decoding step pass the same token count)."""
    key = (values, dtype)
    arr = _SMALL.get(key)
    if arr is None:
        if len(_SMALL) > 1024:
            _SMALL.clear()
        arr = _SMALL[key] = mx.array(list(values), dtype=dtype)
    return arr


_DUMMY: List[mx.array] = []


def _dummy() -> mx.array:
    if not _DUMMY:
        _DUMMY.append(mx.zeros((1,), dtype=mx.float32))
    return _DUMMY[0]


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


def fwht_signs(rotation) -> Optional[mx.array]:
    """The seeded signs if `rotation` is a Hadamard rotation the kernels apply
    themselves (a power-of-two dim: Sylvester H, symmetric), else None."""
    if isinstance(rotation, HadamardRotation) and launch.is_power_of_two(rotation.dim):
        return rotation.signs.astype(mx.float32)
    return None


# ---- encoding -----------------------------------------------------------------

def _role(codec, x):
    consts = constants(codec)
    rotate = consts["signs"] is not None
    if not rotate:  # a dense (or non power-of-two Hadamard) rotation: rotate first
        x = codec.rotation.apply(x.astype(mx.float32))
    spec = (codec.dim, codec.bits, rotate, bool(getattr(codec, "renorm", False)))
    return x, spec, consts


def mse_encode_kv(run: Runner, key_codec, value_codec, keys: mx.array, values: mx.array):
    """(key fields, value fields) of MSECodec.encode, keys and values in one launch."""
    *lead, _ = keys.shape
    if keys.dtype != values.dtype or keys.dtype not in (mx.float16, mx.float32, mx.bfloat16):
        keys, values = keys.astype(mx.float32), values.astype(mx.float32)
    keys, kspec, kc = _role(key_codec, keys)
    values, vspec, vc = _role(value_codec, values)
    if keys.dtype != values.dtype:
        keys, values = keys.astype(mx.float32), values.astype(mx.float32)
    n = 1
    for s in lead:
        n *= s
    plan = launch.encode_plan(n, kspec, vspec, launch.dtype_name(keys.dtype))
    kw, vw = plan.output_shapes[0][1], plan.output_shapes[2][1]
    kcodes, knorm, vcodes, vnorm = run(plan, [
        keys, values, kc["signs"] if kc["signs"] is not None else _dummy(),
        vc["signs"] if vc["signs"] is not None else _dummy(),
        kc["boundaries"], vc["boundaries"], kc["centroids"], vc["centroids"],
    ], [(*lead, kw), (*lead, 1), (*lead, vw), (*lead, 1)])
    return {"codes": kcodes, "norm": knorm}, {"codes": vcodes, "norm": vnorm}


# ---- decoding attention ---------------------------------------------------------

def mse_partials(run: Runner, queries: mx.array, key_codec, value_codec, key_fields, value_fields,
                 tokens: int, scale: float, chunk: Optional[int] = None):
    """Flash-decoding partials of single-token queries (B, Hq, 1, D) over the first
    `tokens` rows of the packed buffers: (o (BH, S, REP, Dv) in the value domain,
    ml (BH, S, REP, 2)), and the plan used."""
    B, n_heads, L, dim = queries.shape
    if L != 1:
        raise ValueError("the decode kernels take one query per head")
    kcodes, vcodes = key_fields["codes"], value_fields["codes"]
    kv_heads, kcap = kcodes.shape[1], kcodes.shape[2]
    rotate_query = constants(key_codec)["signs"] is not None
    q_dtype = queries.dtype if rotate_query and queries.dtype in (mx.float16, mx.float32, mx.bfloat16) else mx.float32
    plan = launch.partial_plan(B * kv_heads, n_heads // kv_heads, dim, key_codec.bits, value_codec.bits, tokens,
                               kcap, vcodes.shape[2], rotate_query=rotate_query,
                               q_dtype=launch.dtype_name(q_dtype), chunk=chunk)
    o, ml = run_partials(run, plan, queries, key_codec, value_codec, kcodes, key_fields["norm"], vcodes,
                         value_fields["norm"], scale, small_array(tuple(plan.meta["meta"])))
    return o, ml, plan


def run_partials(run: Runner, plan, queries, key_codec, value_codec, kcodes, knorm, vcodes, vnorm,
                 scale: float, meta: mx.array):
    """The partial kernel of `plan`; `meta` = int32 [tokens, chunk, kcap, vcap, splits]."""
    kc, vc = constants(key_codec), constants(value_codec)
    if kc["signs"] is None:
        q = key_codec.to_domain(queries.astype(mx.float32) * scale)
        qscale = small_array((1.0,), mx.float32)
    else:
        q = queries if queries.dtype in (mx.float16, mx.float32, mx.bfloat16) else queries.astype(mx.float32)
        qscale = small_array((float(scale),), mx.float32)
    return run(plan, [
        q, kcodes, knorm, vcodes, vnorm, kc["centroids"], vc["centroids"],
        kc["signs"] if kc["signs"] is not None else _dummy(), meta, qscale,
    ])


def merge(run: Runner, o: mx.array, ml: mx.array, value_codec, out_shape: Tuple[int, ...], out_dtype,
          plain: Optional[Tuple[mx.array, mx.array]] = None, value_mean: Optional[mx.array] = None) -> mx.array:
    """Softmax-merge the splits (and `plain` = (o (BH*REP, Dv) in the output domain,
    ml (BH*REP, 2))), un-rotate, divide: the attention output `out_shape`."""
    bh, splits, rep, dim = o.shape
    signs = constants(value_codec)["signs"]
    if signs is None:
        from .portable import merge_partials

        return merge_partials(o, ml, value_codec, out_shape, out_dtype, plain=plain, value_mean=value_mean)
    plan = launch.merge_plan(bh, rep, dim, splits, unrotate=True, plain=plain is not None,
                             value_mean=value_mean is not None, out_dtype=launch.dtype_name(out_dtype))
    inputs = [
        o, ml, signs, small_array((splits,)),
        plain[0] if plain is not None else _dummy(),
        plain[1] if plain is not None else _dummy(),
        value_mean.astype(mx.float32) if value_mean is not None else _dummy(),
    ]
    (out,) = run(plan, inputs, [tuple(out_shape)])
    return out


def mse_dequant(run: Runner, codec, fields, tokens: int, out_dtype=mx.float16) -> mx.array:
    """codec.decode of rows [0, tokens) of the buffers, (B, H, tokens, D) in the codec's domain."""
    codes, norm = fields["codes"], fields["norm"]
    B, H, cap, _ = codes.shape
    plan = launch.dequant_plan(B * H, codec.dim, codec.bits, tokens, cap, out_dtype=launch.dtype_name(out_dtype))
    (out,) = run(plan, [codes, norm, constants(codec)["centroids"], small_array(tuple(plan.meta["meta"]))],
                 [(B, H, tokens, codec.dim)])
    return out
