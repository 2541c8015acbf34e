"""One encode kernel for every per-token format with an encode snippet (CUDA, Metal, the C++ emulator).

A decode step stores the token it adds. Encoding that token with the codec's MLX ops costs a
few dozen small kernels per layer (rotation, reductions, codebook searches, packing, the
row's concatenation), and on a GPU each is a launch: `turboquant_rvq`'s decode step ran 75
kernels per layer that way (`docs/kernels.md`). This kernel encodes keys
and values of N tokens in one launch, into their rows (`formats.RowLayout`, a `RowStore`: every
per-token format is stored so).

A codec may define `kernel_encode(e)`: it emits, through an `Emit`, C statements that thread
t of a block runs for element t of one token's vector (keys or values, already centred), as
`kernel_decode` does for decoding (`dequant.py`). `e.x` holds the element (0 past the dim);
`e.sum(expr)` is a reduction over the block, which every thread reaches, so snippets do not
branch around it; `e.rotated()` is the codec's rotation of the vector (a seeded-sign Hadamard
transform, or a dense matrix); `e.within(dim)` a scope for a nested codec of a smaller dim;
`e.nearest(var, boundaries)` the index of the nearest of sorted centroids, as
`codebooks.quantize`; `e.code(field, var)` and `e.half(field, expr)` store the thread's code
and a token scalar; `e.head()` is the token's kv head, for per-head constants (the kernel then
takes the tokens per head and the heads as an input, `emeta`). The template packs the codes
into the row's words at the layout's slots. One block per token and role: grid (N * NTH, 2),
block row 0 keys, 1 values.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
from dataclasses import dataclass
from typing import List, Tuple

import mlx.core as mx
import numpy as np

from ..engine import CODEC_KEYED, small_array
from ..formats import FLOAT16, PACKED
from ..rotations import DenseRotation, HadamardRotation
from . import launch, ops, templates
from .dequant import CodecTables, ConstantTables, codec_tables
from .launch import Plan

MAX_DIM = 1024  # one thread per coordinate


class Unsupported(Exception):
    """The snippet cannot be emitted for this codec (e.g. its rotation is not a power-of-two
    Hadamard transform)."""


class Emit(ConstantTables):
    """C statements of one role's encode snippet, with its constant tables."""

    def __init__(self, layout, role: str, codec):
        self.layout, self.role, self.codec = layout, role, codec
        self.dim = codec.dim
        self.p2 = launch._pow2(codec.dim)
        ConstantTables.__init__(self, codec_tables(codec), f"{role[0]}tab")
        self.lines: List[str] = []
        self.code_offsets = {}  # packed field name -> its first element in vq_codes
        self.code_slots = 0
        self.halves = set()  # fp16 fields stored
        self._n = 0
        self.x = "x"
        self.uses_head = False

    def var(self) -> str:
        """A fresh C variable name."""
        self._n += 1
        return f"e{self._n}"

    def head(self) -> str:
        """The C expression of the token's kv head: tokens come flattened from (B, H, T)."""
        self.uses_head = True
        return "((n / emeta[0]) % emeta[1])"

    def emit(self, line: str):
        self.lines.append("    " + line)

    def sum(self, expr: str) -> str:
        """A float variable holding the block's sum of `expr` over the active threads."""
        v = self.var()
        self.emit(f"if (t < P2) vq_red[t] = act ? ({expr}) : 0.0f;")
        self.emit("for (int i_ = t + NTH; i_ < P2; i_ += NTH) vq_red[i_] = 0.0f;")
        self.emit("VQ_SYNC();")
        self.emit("for (int s_ = P2 / 2; s_ > 0; s_ >>= 1) { if (t < s_) vq_red[t] += vq_red[t + s_]; VQ_SYNC(); }")
        self.emit(f"const float {v} = vq_red[0];")
        self.emit("VQ_SYNC();")  # vq_red is written again by the next sum
        return v

    def rotated(self, rotation=None) -> str:
        """A float variable holding element t of R x: R = H diag(signs) / sqrt(D) (`HadamardRotation`),
        or a `DenseRotation`'s matrix."""
        rotation = rotation if rotation is not None else self.codec.rotation
        if isinstance(rotation, DenseRotation):
            return self._matrix_times(self.x, np.array(rotation.matrix).T)
        signs = self._signs(rotation)
        return self._hadamard(f"{self.x} * {signs}[t]", "")

    def unrotated(self, value: str, rotation=None) -> str:
        """A float variable holding element t of R^T y, y the block's `value`s: the inverse of
        `rotated` (H is symmetric, so R^T = diag(signs) H / sqrt(D))."""
        rotation = rotation if rotation is not None else self.codec.rotation
        if isinstance(rotation, DenseRotation):
            return self._matrix_times(value, np.array(rotation.matrix))
        signs = self._signs(rotation)
        return self._hadamard(value, f" * {signs}[t]")

    def _matrix_times(self, value: str, transposed: np.ndarray) -> str:
        """A float variable holding element t of M v, v the block's `value`s, given M^T (row i of M^T
        is read by consecutive threads at consecutive words)."""
        n = transposed.shape[0]
        vec = self.shared(value)
        columns = self.table(transposed)
        v = self.var()
        self.emit(f"float {v} = 0.0f;")
        self.emit(f"if (act) for (int i_ = 0; i_ < {n}; ++i_) {v} += {columns}[i_ * {n} + t] * {vec}[i_];")
        self.emit("VQ_SYNC();")  # vq_buf is written again by the next helper
        return v

    def _signs(self, rotation) -> str:
        if not isinstance(rotation, HadamardRotation) or not launch.is_power_of_two(rotation.dim):
            raise Unsupported(f"the encode kernel rotates with power-of-two Hadamard transforms, not {rotation!r}")
        return self.table(np.array(rotation.signs.astype(mx.float32)))

    def _hadamard(self, load: str, after: str) -> str:
        """H (load) / sqrt(D) `after`: the Walsh-Hadamard transform (Sylvester order) in shared memory."""
        v = self.var()
        self.emit(f"if (act) vq_buf[t] = {load};")
        self.emit("VQ_SYNC();")
        self.emit("for (int h_ = 1; h_ < D; h_ <<= 1) {")
        self.emit("  if (act && (t & h_) == 0) { const float a_ = vq_buf[t], b_ = vq_buf[t + h_];"
                  " vq_buf[t] = a_ + b_; vq_buf[t + h_] = a_ - b_; }")
        self.emit("  VQ_SYNC();")
        self.emit("}")
        self.emit(f"const float {v} = act ? vq_buf[t] * (1.0f / VQ_SQRT((float)D)){after} : 0.0f;")
        self.emit("VQ_SYNC();")
        return v

    def maximum(self, expr: str) -> str:
        """A float variable holding the block's maximum of `expr` over the active threads (-inf for none)."""
        v = self.var()
        self.emit(f"if (t < P2) vq_red[t] = act ? ({expr}) : VQ_NEG_INF;")
        self.emit("for (int i_ = t + NTH; i_ < P2; i_ += NTH) vq_red[i_] = VQ_NEG_INF;")
        self.emit("VQ_SYNC();")
        self.emit("for (int s_ = P2 / 2; s_ > 0; s_ >>= 1) {"
                  " if (t < s_) vq_red[t] = VQ_MAXF(vq_red[t], vq_red[t + s_]); VQ_SYNC(); }")
        self.emit(f"const float {v} = vq_red[0];")
        self.emit("VQ_SYNC();")
        return v

    @contextlib.contextmanager
    def within(self, dim: int):
        """A scope in which the snippet's vector is its first `dim` elements: `act`, `D` and `P2` are
        redefined there (a codec of a smaller dim nested in another, the `outliers` option's base)."""
        self.emit(f"{{ const bool act = t < {dim}; constexpr int D = {dim}; constexpr int P2 = {launch._pow2(dim)};")
        yield
        self.emit("}")

    def shared(self, value: str) -> str:
        """The block's `value`s in shared memory (the C array's name; valid until the next helper)."""
        self.emit(f"if (act) vq_buf[t] = {value};")
        self.emit("VQ_SYNC();")
        return "vq_buf"

    def sketch_signs(self, name: str, sketch, value: str):
        """Packed field `name` is sign(S v) >= 0 for the (m, D) matrix `sketch` and the block's
        vector v of `value`s (QJL, arXiv 2406.03482, Def. 3.1): thread t takes rows t, t + NTH, ..."""
        sketch = np.asarray(sketch, dtype=np.float32)
        m = sketch.shape[0]
        vec = self.shared(value)
        columns = self.table(sketch.T)  # S^T: threads of consecutive rows read consecutive words
        offset = self._codes_of(name, m)
        self.emit(f"for (int i_ = t; i_ < {m}; i_ += NTH) {{")
        self.emit(f"  float d_ = 0.0f; for (int k_ = 0; k_ < D; ++k_) d_ += {columns}[k_ * {m} + i_] * {vec}[k_];")
        self.emit(f"  vq_codes[{offset} + i_] = d_ >= 0.0f ? 1u : 0u;")
        self.emit("}")
        self.emit("VQ_SYNC();")

    def group_range(self, value: str, group: int):
        """(lo, hi) float variables: the min and max of the finite `value`s of thread t's group of
        `group` consecutive elements (the last group may be shorter); 0 for a group with none."""
        vec = self.shared(value)
        lo, hi = self.var(), self.var()
        self.emit(f"float {lo} = -VQ_NEG_INF, {hi} = VQ_NEG_INF;")
        self.emit(f"if (act) {{ const int g0_ = (t / {group}) * {group};")
        self.emit(f"  for (int k_ = g0_; k_ < VQ_MINI(g0_ + {group}, D); ++k_) {{ const float u_ = {vec}[k_];"
                  f" if (VQ_ISFINITE(u_)) {{ {lo} = u_ < {lo} ? u_ : {lo}; {hi} = u_ > {hi} ? u_ : {hi}; }} }} }}")
        self.emit(f"if (!VQ_ISFINITE({lo})) {lo} = 0.0f;")
        self.emit(f"if (!VQ_ISFINITE({hi})) {hi} = 0.0f;")
        self.emit("VQ_SYNC();")
        return lo, hi

    def half_down(self, value: str) -> str:
        """A float variable: fp16(value) rounded toward -inf (`kivi._fp16_round_down`)."""
        w, v = self.var(), self.var()
        self.emit(f"uint32_t {w} = vq_half_word({value});")
        self.emit(f"if (vq_half_bits({w}) > ({value})) {w} = {w} == 0u ? 0x8001u : ({w} >= 0x8000u ? {w} + 1u : {w} - 1u);")
        self.emit(f"const float {v} = vq_half_bits({w});")
        return v

    def nearest(self, value: str, boundaries) -> str:
        """A uint32 variable: how many of the sorted `boundaries` `value` exceeds."""
        bnd = self.table(boundaries)
        n = int(np.asarray(boundaries).size)
        v = self.var()
        self.emit(f"uint32_t {v} = 0u; for (int k_ = 0; k_ < {n}; ++k_) {v} += ({value} > {bnd}[k_]) ? 1u : 0u;")
        return v

    def code(self, name: str, value: str, index: str = "t"):
        """Element `index` of packed field `name` is `value` (threads whose index is in range)."""
        f = self.codec.format.field(name)
        offset = self._codes_of(name, f.width)
        self.emit(f"if (act && ({index}) >= 0 && ({index}) < {f.width}) vq_codes[{offset} + ({index})] = {value};")

    def stream(self, name: str) -> str:
        """The C index of element 0 of packed field `name` in `vq_codes`, for snippets that write
        a code stream themselves (`vq_codes[stream + i] = code`, one element per code of the
        field's width, stored by the threads that own them; visible after the next barrier)."""
        return str(self._codes_of(name, self.codec.format.field(name).width))

    def _codes_of(self, name: str, width: int) -> int:
        """The first element of packed field `name` in vq_codes."""
        f = self.codec.format.field(name)
        if f.kind != PACKED or f.tokens_per_row != 1 or f.width != width:
            raise Unsupported(f"field {name!r} is not a per-token packed field of {width} elements")
        if name not in self.code_offsets:
            self.code_offsets[name] = self.code_slots
            self.code_slots += f.width
        return self.code_offsets[name]

    def half(self, name: str, value: str, index: str = "0", when: str = "t == 0"):
        """Element `index` of fp16 field `name` is `value`, stored by the thread(s) where `when`."""
        f = self.codec.format.field(name)
        if f.kind != FLOAT16 or f.tokens_per_row != 1:
            raise Unsupported(f"field {name!r} is not a per-token fp16 field")
        self.halves.add(name)
        dst = f"VQ_HALF_PTR(rows)[(size_t)n * (2 * RW) + {self.layout.slot(self.role, name).start} + ({index})]"
        self.emit(f"if ({when}) {dst} = VQ_CAST(vq_half, {value});")

    def pack(self) -> List[str]:
        """Statements writing the role's codes (in `vq_codes`) into the row's words."""
        out = []
        for name, offset in self.code_offsets.items():
            f = self.codec.format.field(name)
            dst = f"rows[(size_t)n * RW + {self.layout.slot(self.role, name).start} + w_]"
            out.append(templates.pack_codes(f.bits, f.width, f.words, offset, f"{dst} = word_;"))
        return out

    def snippet(self) -> str:
        self.codec.kernel_encode(self)
        missing = {f.name for f in self.codec.format.fields} - set(self.code_offsets) - self.halves
        if missing:
            raise Unsupported(f"{type(self.codec).__name__}.kernel_encode stores no {sorted(missing)}")
        head = [f"    constexpr int D = {self.dim};", f"    constexpr int P2 = {self.p2};",
                "    const bool act = t < D;",
                f"    const float x = act ? VQ_F({self.role[0]}x[(size_t)n * D + t]) : 0.0f;"]
        return "\n".join(head + self.lines + ["    VQ_SYNC();"] + self.pack())


_BODY = r"""
  const int n = vq_bx;
  const int t = vq_tid;
  VQ_SHARED float vq_red[P2M];
  VQ_SHARED float vq_buf[P2M];
  VQ_SHARED uint32_t vq_codes[NCODES];
  if (vq_by == 0) {
@KEYS
  } else {
@VALUES
@PAD
  }
"""


@dataclass(frozen=True)
class Program:
    kernel: str
    tables: Tuple[CodecTables, CodecTables]  # keys', values'
    threads: int
    p2: int
    codes: int
    per_head: bool  # a snippet reads per-head constants: the `emeta` input (T, H)


def supported(layout, key_codec, value_codec) -> bool:
    """Whether both codecs emit an encode snippet for this row layout (None, a field store of
    block formats: no)."""
    if layout is None or max(key_codec.dim, value_codec.dim) > MAX_DIM:
        return False
    if not all(callable(getattr(c, "kernel_encode", None)) for c in (key_codec, value_codec)):
        return False
    try:
        program(layout, key_codec, value_codec)
    except Unsupported:
        return False
    return True


@functools.lru_cache(maxsize=CODEC_KEYED)
def program(layout, key_codec, value_codec) -> Program:
    keys = Emit(layout, "keys", key_codec)
    key_snippet = keys.snippet()
    values = Emit(layout, "values", value_codec)
    value_snippet = values.snippet()
    pad = ""
    outputs = ("rows",)
    halves = sum(s.field.width for s in layout.slots if s.field.kind == FLOAT16)
    if halves % 2:  # the last half-word of the row is padding: zero, as RowLayout.pack writes it
        pad = (f"    if (t == 0) VQ_HALF_PTR(rows)[(size_t)n * (2 * RW) + {2 * layout.fp16_start + halves}]"
               " = VQ_CAST(vq_half, 0.0f);")
    body = _BODY.replace("@KEYS", key_snippet).replace("@VALUES", value_snippet).replace("@PAD", pad)
    name = "encode_" + hashlib.sha1((body + repr(outputs)).encode()).hexdigest()[:16]
    per_head = keys.uses_head or values.uses_head
    if name not in templates.KERNELS:
        inputs = ("kx", "vx", "ktab", "vtab") + (("emeta",) if per_head else ())
        templates.KERNELS[name] = {"body": body, "inputs": inputs, "outputs": outputs}
    return Program(name, (keys.tables, values.tables), max(key_codec.dim, value_codec.dim), max(keys.p2, values.p2),
                   max(1, keys.code_slots, values.code_slots), per_head)


@functools.lru_cache(maxsize=1024)
def _plan(kernel: str, n: int, threads: int, p2: int, codes: int, row_words: int, x_dtype: str) -> Plan:
    template = [("NTH", threads), ("P2M", p2), ("NCODES", codes), ("RW", row_words), ("TX", x_dtype)]
    return Plan(kernel, template, (n * threads, 2, 1), (threads, 1, 1), [(n, row_words)], ["uint32"])


def plan(layout, key_codec, value_codec, n: int, x_dtype: str) -> Plan:
    prog = program(layout, key_codec, value_codec)
    return _plan(prog.kernel, n, prog.threads, prog.p2, prog.codes, layout.words, x_dtype)


def _launch(run, layout, key_codec, value_codec, keys: mx.array, values: mx.array):
    prog = program(layout, key_codec, value_codec)
    *lead, _ = keys.shape
    keys, values = ops.encode_inputs(keys, values)
    plan_ = plan(layout, key_codec, value_codec, math.prod(lead), launch.dtype_name(keys.dtype))
    inputs = [keys, values] + [tables.array() for tables in prog.tables]
    if prog.per_head:
        if len(lead) != 3:
            raise ValueError(f"per-head encode snippets take (B, H, T, D) inputs, got shape {keys.shape}")
        inputs.append(small_array((lead[2], lead[1])))
    return run(plan_, inputs, [(*lead, shape[-1]) for shape in plan_.output_shapes])


def encode_rows(run, layout, key_codec, value_codec, keys: mx.array, values: mx.array) -> mx.array:
    """Rows (..., n, layout.words) of keys and values (..., n, D): what `layout.pack` of the
    codecs' `encode` gives, in one launch."""
    (rows,) = _launch(run, layout, key_codec, value_codec, keys, values)
    return rows


# A coordinate within float rounding of a boundary may round either way (sums in another order),
# and a token scalar is then equal to an fp16 ulp (selftest.py's encode tolerance).
CHECK_MIN_EQUAL = 0.999
CHECK_HALF_ERROR = 2 ** -10


# (method, options): every family of encode snippets; the first-use check runs the first.
CHECK_FORMATS = (
    ("turboquant_rvq", {"bits": 2, "value_bits": 3}),  # two packed fields and two fp16 scalars per role
    ("qjl", {"bits": 2, "value_bits": 4, "group_size": 48}),  # a sketch; per-group value scales, ragged
    ("turboquant_prod", {"bits": 3, "value_bits": 4}),  # mse stage, un-rotated residual, sketch
    ("polarquant", {"bits": 4, "value_bits": 3}),  # a code stream of several widths, atan2
    ("rabitq", {"bits": 1, "value_bits": 4}),  # sign codes and two scalars (B > 1 adds a search whose
    # near-ties may round either way: tests/test_rabitq.py checks those codes)
)


def fields_agreement(got, refs):
    """(share of equal packed words, worst relative error of the fp16 scalars, whether every field
    has the reference's name and shape) of (key fields, value fields) `got` against `refs`."""
    equal, half_error, same = 1.0, 0.0, True
    for g, r in zip(got, refs):
        same &= set(g) == set(r)
        for field, ref in r.items():
            if field not in g:
                continue
            a, b = np.array(g[field]), np.array(ref)
            same &= a.shape == b.shape and a.dtype == b.dtype
            if a.shape != b.shape:
                continue
            if a.dtype == np.uint32:
                equal = min(equal, float(np.mean(a == b)))
            else:
                a, b = a.astype(np.float32), b.astype(np.float32)
                half_error = max(half_error, float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-30))))
    return equal, half_error, same


def check_record(backend: str, formats=CHECK_FORMATS, tokens: int = 300) -> dict:
    """The encode kernel of `backend` against the codecs' MLX encode (on the CPU) for each of
    `formats`, `tokens` tokens of 2 heads, fp16 inputs, dim 128."""
    from ..config import KVCacheConfig
    from ..methods import get_method
    from ..storage import row_layout
    from . import ops

    equal, half_error, same = 1.0, 0.0, True
    for i, (name, options) in enumerate(formats):
        config = KVCacheConfig(method=name, **options)
        kc, vc = get_method(name).key_codec(config, 128), get_method(name).value_codec(config, 128)
        layout = row_layout(kc, vc)  # as the cache stores them
        keys = mx.random.normal((1, 2, tokens, 128), key=mx.random.key(60 + i)).astype(mx.float16)
        values = mx.random.normal((1, 2, tokens, 128), key=mx.random.key(70 + i)).astype(mx.float16)
        got = layout.views(encode_rows(ops.runner(backend), layout, kc, vc, keys, values))
        with mx.stream(mx.cpu):  # float32 sketches (MLX's GPU matmuls run at TF32 by default)
            refs = (kc.encode(keys), vc.encode(values))
            mx.eval(refs)
        e, h, s = fields_agreement(got, refs)
        equal, half_error, same = min(equal, e), max(half_error, h), same and s
    ok = equal >= CHECK_MIN_EQUAL and half_error <= CHECK_HALF_ERROR and same
    return {"case": "format_encode", "backend": backend, "formats": [f for f, _ in formats], "codes_equal": equal,
            "norm_rel_error": half_error, "status": "ok" if ok else "FAIL"}
