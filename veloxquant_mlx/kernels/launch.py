"""Launch plans (template constants, grid, outputs) and the back ends that run them.

A plan is computed once from shapes and settings and used unchanged by every
runner: `mx.fast.cuda_kernel`, `mx.fast.metal_kernel` and the C++ emulator,
so all of them run the same kernel with the same constants.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from . import templates

PARTIAL_THREADS = 128
TARGET_BLOCKS = 792  # ~6 resident blocks of PARTIAL_THREADS on each of an H200's 132 SMs
MAX_CHUNK = 4096


@dataclass
class Plan:
    kernel: str
    template: List[Tuple[str, object]]
    grid: Tuple[int, int, int]
    threadgroup: Tuple[int, int, int]
    output_shapes: List[Tuple[int, ...]]
    output_dtypes: List[str]
    meta: Dict[str, object] = field(default_factory=dict)


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _words(dim: int, bits: int) -> int:
    return -(-dim * bits // 32)


# ---- plans ------------------------------------------------------------------

def _role_constants(prefix: str, dim: int, bits: int, rotate: bool, scale: int):
    if rotate and not is_power_of_two(dim):
        raise ValueError(f"in-kernel rotation needs a power-of-two dim, got {dim}")
    return [
        (f"{prefix}D", dim), (f"{prefix}BITS", bits), (f"{prefix}W", _words(dim, bits)),
        (f"{prefix}NB", (1 << bits) - 1), (f"{prefix}P2", _pow2(dim)),
        (f"{prefix}ROTATE", bool(rotate)), (f"{prefix}SCALE", int(scale)),
    ]


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@lru_cache(maxsize=256)
def encode_plan(n: int, key: tuple, value: tuple, x_dtype: str) -> Plan:
    """`key` / `value`: (dim, bits, rotate, scale: an index of `turboquant_mse.SCALES`). Keys and
    values of n vectors, one launch."""
    (kd, kb, kr, kn), (vd, vb, vr, vn) = key, value
    threads = max(kd, vd)
    if threads > 1024:
        raise ValueError(f"mse_encode runs one thread per coordinate; dim {threads} > 1024")
    template = _role_constants("K", kd, kb, kr, kn) + _role_constants("V", vd, vb, vr, vn)
    row_words = _words(kd, kb) + _words(vd, vb) + 1
    template += [("NTH", threads), ("P2M", max(_pow2(kd), _pow2(vd))), ("TX", x_dtype), ("RW", row_words)]
    return Plan("mse_encode", template, (n * threads, 2, 1), (threads, 1, 1), [(n, row_words)], ["uint32"])


def choose_chunk(tokens: int, kv_rows: int, threads: int = PARTIAL_THREADS, chunk: Optional[int] = None,
                 minimum: int = 0) -> int:
    """Tokens per split: `chunk` (`EngineSettings.split_tokens`), or enough splits to fill the GPU
    (at least `minimum` tokens where the split is planned rather than given), whole tiles of `threads`."""
    if chunk is None:
        chunk = -(-max(tokens, 1) * kv_rows // TARGET_BLOCKS)
        chunk = max(minimum, min(MAX_CHUNK, chunk))
    return max(threads, -(-chunk // threads) * threads)


def value_group(dim: int, threads: int, value_bits: int = 8) -> int:
    """Value dims per thread in the value phase: G with D % G == 0, D / G dividing
    `threads` and G * bits <= 32 (one 64-bit window holds a thread's codes)."""
    for g in (4, 2, 8, 3, 1, 6, 5, 7):
        if dim % g == 0 and threads % (dim // g) == 0 and g * value_bits <= 32:
            return g
    raise ValueError(f"no value grouping for dim {dim}, {value_bits} bits, {threads} threads")


def partial_shared_bytes(dim: int, rep: int, key_bits: int, value_bits: int, threads: int = PARTIAL_THREADS) -> int:
    """Static shared memory of mse_partial (CUDA allows 48 KB of it)."""
    g = value_group(dim, threads, value_bits)
    r4 = -(-rep // 4) * 4
    floats = dim * r4 + (1 << key_bits) + (1 << value_bits) + threads * r4 + rep * (threads // 32)
    # one buffer for the rotated query, a tile's rows, and the token lanes' value sums
    row_words = _words(dim, key_bits) + _words(dim, value_bits) + 1
    floats += max(rep * dim, threads * row_words, (threads // (dim // g)) * rep * dim)
    return 4 * floats


def _key_scale_constants(heads: int, rotate_query: bool) -> list:
    if heads and not rotate_query:
        raise ValueError("smoothing scales enter the kernels with the in-kernel rotation; without it the "
                         "queries arrive mapped by the key codec's to_domain")
    return [("KSC", heads > 0), ("KH", max(1, heads))]


@lru_cache(maxsize=4096)
def partial_plan(kv_rows: int, rep: int, dim: int, key_bits: int, value_bits: int, tokens: int,
                 capacity: int, *, rotate_query: bool, q_dtype: str,
                 chunk: Optional[int] = None, threads: int = PARTIAL_THREADS, key_scale_heads: int = 0,
                 ragged_heads: int = 0) -> Plan:
    """`key_scale_heads`: the kv heads of smoothed keys' scales, which the query takes before its
    in-kernel rotation (0: none). `ragged_heads`: a batch of sequences of different lengths, this many
    kv rows each, whose token counts follow the four fixed entries of meta (0: one count for all)."""
    if dim % 32:
        raise ValueError(f"mse_partial needs dim % 32 == 0, got {dim}")
    if rotate_query and not is_power_of_two(dim):
        raise ValueError(f"in-kernel rotation needs a power-of-two dim, got {dim}")
    chunk = choose_chunk(tokens, kv_rows, threads, chunk)
    splits = max(1, -(-tokens // chunk))
    kw, vw = _words(dim, key_bits), _words(dim, value_bits)
    g = value_group(dim, threads, value_bits)
    row_words = kw + vw + 1
    template = [
        ("D", dim), ("KB", key_bits), ("VB", value_bits), ("KW", kw), ("VW", vw), ("REP", rep),
        ("NT", threads), ("G", g), ("NDG", dim // g), ("TL", threads // (dim // g)),
        ("ROTQ", bool(rotate_query)), ("TQ", q_dtype), ("RW", row_words),
    ] + _key_scale_constants(key_scale_heads, rotate_query) + [("RAG", ragged_heads)]
    return Plan(
        "mse_partial", template, (splits * threads, kv_rows, 1), (threads, 1, 1),
        [(kv_rows, splits, rep, dim), (kv_rows, splits, rep, 2)], ["float32", "float32"],
        meta={"meta": [tokens, chunk, capacity, splits], "splits": splits, "chunk": chunk},
    )


MMA_MAX_REP = 8  # query heads per kv head: the n = 8 of the mma's B operand
MMA_MAX_DIM = 256  # the value sums live in registers: 4 floats per 16 dims per thread
MMA_MAX_ROLE_BITS = 1024  # a thread holds a quarter of a key row's codes and an eighth of 4 value rows'


def mma_shared_bytes(dim: int, rep: int, key_bits: int, value_bits: int, threads: int = PARTIAL_THREADS) -> int:
    """Static shared memory of mse_partial_mma."""
    warps = threads // 32
    row_words = _words(dim, key_bits) + _words(dim, value_bits) + 1
    pairs = (32 << (2 * key_bits) if key_bits <= 3 else 1) + (1 << (2 * value_bits) if value_bits <= 3 else 1)
    words = max(2 * warps * 16 * row_words, warps * rep * dim) + pairs + (1 << key_bits) + (1 << value_bits)
    return 4 * (words + warps * 64 + warps * 16)


def mma_fits(dim: int, rep: int, key_bits: int, value_bits: int, limit: int) -> bool:
    """Whether mse_partial_mma takes this shape (else mse_partial does)."""
    return (rep <= MMA_MAX_REP and dim % 16 == 0 and dim <= MMA_MAX_DIM
            and key_bits * dim <= MMA_MAX_ROLE_BITS and value_bits * dim <= MMA_MAX_ROLE_BITS
            and mma_shared_bytes(dim, rep, key_bits, value_bits) <= limit)


MMA_BACKENDS = ("cuda", "emulator")
MMA_MIN_CHUNK = 1024


@lru_cache(maxsize=256)  # asked by every layer of every decode step
def use_mma(backend: str, tensor_cores: bool, dim: int, rep: int, key_bits: int, value_bits: int,
            limit: int = 44 * 1024) -> bool:
    """Whether a decode partial of this shape runs on tensor cores (`EngineSettings.tensor_cores`)."""
    return tensor_cores and backend in MMA_BACKENDS and mma_fits(dim, rep, key_bits, value_bits, limit)


def decode_partial_plan(mma: bool, *args, **kwargs) -> Plan:
    """`mma_partial_plan` or `partial_plan` (same arguments, same contract)."""
    return (mma_partial_plan if mma else partial_plan)(*args, **kwargs)


@lru_cache(maxsize=4096)
def mma_partial_plan(kv_rows: int, rep: int, dim: int, key_bits: int, value_bits: int, tokens: int,
                     capacity: int, *, rotate_query: bool, q_dtype: str, chunk: Optional[int] = None,
                     threads: int = PARTIAL_THREADS, key_scale_heads: int = 0, ragged_heads: int = 0) -> Plan:
    """`partial_plan` for the tensor-core kernel: the same grid, inputs and outputs."""
    if not mma_fits(dim, rep, key_bits, value_bits, 48 * 1024):
        raise ValueError(f"mse_partial_mma takes dim % 16 == 0 up to {MMA_MAX_DIM}, at most {MMA_MAX_REP} query "
                         f"heads per kv head and bits x dim <= {MMA_MAX_ROLE_BITS}; got dim {dim}, {rep} heads, "
                         f"K{key_bits}/V{value_bits}")
    if rotate_query and not is_power_of_two(dim):
        raise ValueError(f"in-kernel rotation needs a power-of-two dim, got {dim}")
    # Per-block work (query rotation, tables, the warps' merge) wants longer splits (run30).
    chunk = choose_chunk(tokens, kv_rows, threads, chunk, minimum=MMA_MIN_CHUNK)
    splits = max(1, -(-tokens // chunk))
    kw, vw = _words(dim, key_bits), _words(dim, value_bits)
    template = [
        ("D", dim), ("KB", key_bits), ("VB", value_bits), ("KW", kw), ("VW", vw), ("REP", rep),
        ("NT", threads), ("ROTQ", bool(rotate_query)), ("TQ", q_dtype), ("RW", kw + vw + 1),
    ] + _key_scale_constants(key_scale_heads, rotate_query) + [("RAG", ragged_heads)]
    return Plan(
        "mse_partial_mma", template, (splits * threads, kv_rows, 1), (threads, 1, 1),
        [(kv_rows, splits, rep, dim), (kv_rows, splits, rep, 2)], ["float32", "float32"],
        meta={"meta": [tokens, chunk, capacity, splits], "splits": splits, "chunk": chunk},
    )


@lru_cache(maxsize=4096)
def merge_plan(kv_rows: int, rep: int, dim: int, splits: int, *, unrotate: bool, plain: bool,
               value_mean: bool, out_dtype: str, tokens: int = 0, x_dtype: str = "float32", unmap: int = 0) -> Plan:
    """`plain`: merge a partial over fp16 tokens; `tokens`: a bound on fp16 tokens attended to in
    the kernel instead (0: none), of dtype `x_dtype`; `unmap`: the heads of a dense per-head
    matrix that takes the value sum out of its domain (0: none)."""
    if unrotate and not is_power_of_two(dim):
        raise ValueError(f"in-kernel rotation needs a power-of-two dim, got {dim}")
    template = [
        ("D", dim), ("REP", rep), ("UNROT", bool(unrotate)), ("UNMAP", unmap), ("HAS_PLAIN", bool(plain)),
        ("HAS_VMEAN", bool(value_mean)), ("HAS_TOKENS", tokens > 0), ("PMAX", max(1, tokens)), ("TX", x_dtype),
        ("TO", out_dtype),
    ]
    return Plan("merge", template, (dim, kv_rows * rep, 1), (dim, 1, 1), [(kv_rows * rep, dim)], [out_dtype],
                meta={"meta": [splits]})


@lru_cache(maxsize=4096)
def merge_encode_plan(kv_rows: int, rep: int, dim: int, splits: int, key: tuple, value: tuple, *, center: bool,
                      x_dtype: str, out_dtype: str, plain_tokens: int = 0, slide_window: int = 0,
                      key_scale_heads: int = 0) -> Plan:
    """`key` / `value`: (bits, scale). Both roles rotate in-kernel, so dim is a power of two.
    `plain_tokens`: a bound on the fp16 sinks/window tokens it attends to (0: none).
    `slide_window`: the window's tokens, for `merge_encode_slide` (0: `merge_encode`).
    `key_scale_heads`: the kv heads of smoothed keys' scales (0: none)."""
    if not is_power_of_two(dim) or dim > 1024:
        raise ValueError(f"merge_encode needs a power-of-two dim <= 1024, got {dim}")
    (kb, kn), (vb, vn) = key, value
    row_words = _words(dim, kb) + _words(dim, vb) + 1
    template = _role_constants("K", dim, kb, True, kn) + _role_constants("V", dim, vb, True, vn)
    template += [("D", dim), ("REP", rep), ("NTH", dim), ("RW", row_words), ("HAS_CENTER", bool(center)),
                 ("HAS_PLAIN", plain_tokens > 0), ("PMAX", max(1, plain_tokens)), ("TX", x_dtype), ("TO", out_dtype)]
    template += _key_scale_constants(key_scale_heads, True)
    shapes, dtypes = [(kv_rows * rep, dim), (kv_rows, row_words)], [out_dtype, "uint32"]
    if slide_window:
        shapes += [(kv_rows, slide_window, dim)] * 2
        dtypes += [x_dtype] * 2
    return Plan("merge_encode_slide" if slide_window else "merge_encode", template, (dim, kv_rows * rep, 1),
                (dim, 1, 1), shapes, dtypes, meta={"meta": [splits]})


def _bound(n: int) -> int:
    """A power of two >= n (at least 32): few kernel variants as a count grows."""
    return max(32, 1 << max(0, n - 1).bit_length())


@lru_cache(maxsize=1024)
def kept_splits_plan(kv_rows: int, rep: int, dim: int, key_bits: int, value_bits: int, slots: int, *, center: bool,
                     x_dtype: str, key_scale_heads: int = 0) -> Plan:
    """`kept_splits` over `slots` kept-token slots (the spare one included)."""
    if not is_power_of_two(dim) or dim > 1024 or dim < 32:
        raise ValueError(f"kept_splits needs a power-of-two dim in [32, 1024], got {dim}")
    kw, vw = _words(dim, key_bits), _words(dim, value_bits)
    template = [("D", dim), ("REP", rep), ("KB", key_bits), ("VB", value_bits), ("KW", kw), ("VW", vw),
                ("RW", kw + vw + 1), ("HAS_CENTER", bool(center)), ("SB", _bound(slots)), ("TX", x_dtype)]
    template += _key_scale_constants(key_scale_heads, True)
    return Plan("kept_splits", template, (dim, kv_rows * rep, 1), (dim, 1, 1),
                [(kv_rows, 2, rep, dim), (kv_rows, 2, rep, 2), (5,)], ["float32", "float32", "int32"])


KEPT_SETTLE_THREADS = 128
KEPT_SETTLE_BLOCKS = 16  # block 0 computes the shares; all of them copy the slots


@lru_cache(maxsize=1024)
def kept_settle_plan(heads: int, rep: int, dim: int, window: int, sinks: int, slots: int, *, x_dtype: str) -> Plan:
    """`kept_settle` for `heads` kv heads, a `window`-token ring, `sinks` fp16 sinks and `slots` kept-token slots."""
    threads = KEPT_SETTLE_THREADS
    blocks = KEPT_SETTLE_BLOCKS
    template = [("D", dim), ("H", heads), ("REP", rep), ("W", window), ("TOKB", _bound(sinks + window)),
                ("NT", threads), ("NB", blocks), ("TX", x_dtype)]
    return Plan("kept_settle", template, (blocks * threads, 1, 1), (threads, 1, 1),
                [(window,), (heads, slots, dim), (heads, slots, dim), (slots,), (1,)],
                ["float32", x_dtype, x_dtype, "int32", "int32"])


@lru_cache(maxsize=4096)
def dequant_plan(kv_rows: int, dim: int, bits: int, tokens: int, capacity: int, *, out_dtype: str,
                 row_words: int, offset: int, norm_half: int, threads: int = 256) -> Plan:
    """Decode one role of rows (`rows.py`): its codes start at word `offset`, its norm is
    half `norm_half` of the row."""
    template = [("D", dim), ("BITS", bits), ("W", _words(dim, bits)), ("NT", threads), ("TO", out_dtype),
                ("RW", row_words), ("OFF", offset), ("NORMH", norm_half)]
    return Plan("mse_dequant", template, (max(1, tokens * dim), kv_rows, 1), (threads, 1, 1),
                [(kv_rows, tokens, dim)], [out_dtype], meta={"meta": [tokens, capacity]})


# ---- runners ------------------------------------------------------------------

_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16,
           "uint32": mx.uint32, "int32": mx.int32}


def dtype_name(dtype) -> str:
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported dtype {dtype}")


@lru_cache(maxsize=None)
def _mlx_kernel(dialect: str, kernel: str):
    spec = templates.KERNELS[kernel]
    make = mx.fast.cuda_kernel if dialect == "cuda" else mx.fast.metal_kernel
    return make(
        name=f"vq_{kernel}",
        input_names=list(spec["inputs"]),
        output_names=list(spec["outputs"]),
        source=templates.source(kernel, dialect),
        header=templates.header(dialect),
        ensure_row_contiguous=True,
    )


_MLX_ARGS: Dict[int, tuple] = {}


def mlx_template(plan: Plan) -> list:
    """The plan's template constants as `mx.fast.*_kernel` takes them (dtype names as MLX dtypes)."""
    return [(k, _DTYPES[v] if isinstance(v, str) else v) for k, v in plan.template]


def run_mlx(dialect: str, plan: Plan, inputs: Sequence[mx.array], shapes=None) -> List[mx.array]:
    """Run a plan with `mx.fast.cuda_kernel` (dialect "cuda") or `mx.fast.metal_kernel`;
    `shapes` overrides the plan's output shapes (same sizes, e.g. the caller's final shape)."""
    kernel = _mlx_kernel(dialect, plan.kernel)
    args = _MLX_ARGS.get(id(plan))
    if args is None or args[0] is not plan:
        if len(_MLX_ARGS) > 8192:  # plans are cached by their makers; this only bounds stale ids
            _MLX_ARGS.clear()
        args = (plan, mlx_template(plan), [_DTYPES[d] for d in plan.output_dtypes])
        _MLX_ARGS[id(plan)] = args
    return kernel(
        inputs=list(inputs),
        template=args[1],
        grid=plan.grid,
        threadgroup=plan.threadgroup,
        output_shapes=shapes or plan.output_shapes,
        output_dtypes=args[2],
    )


def run_emulator(plan: Plan, inputs) -> list:
    from . import emulator
    import numpy as np

    arrays = [np.asarray(a) for a in inputs]
    return emulator.run(plan.kernel, arrays, plan.template, plan.grid, plan.threadgroup,
                        plan.output_shapes, plan.output_dtypes)
