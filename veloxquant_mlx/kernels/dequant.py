"""One dequant kernel for every format with a decode snippet (CUDA, Metal, the C++ emulator).

A codec may define `kernel_decode(access) -> str`: C statements that set `float v` to
element `j` of token `t`'s decoded vector in its domain (what `decode` computes), written
against an `Access`, which turns field names into loads from wherever the store keeps
them (one row per token in a `RowStore`, one buffer per field in a `FieldStore`, a row
per group of tokens for per-block fields) and registers constant tables. The kernel body
around it is the same for every format: one thread per element, grid (T * DD, B * H).
The rendered kernel is registered under a name derived from its text, so each format
compiles once per process and back end.

`dequantize(...)` gives (B, H, tokens, domain) in the requested dtype: the engine feeds
it to MLX's fused attention (prefill, decode) or to its compiled decode step.
"""

from __future__ import annotations

import functools
import hashlib
import weakref
from dataclasses import dataclass
from typing import List, Tuple

import mlx.core as mx
import numpy as np

from ..engine import CODEC_KEYED, small_array
from ..formats import PACKED
from ..storage import RowStore
from . import launch, templates
from .launch import Plan

THREADS = 256

_BODY = r"""
  const int T = meta[0];
  const int bh = vq_by;
  const int x = vq_bx * NT + vq_tid;
  const int t = x / DD;
  const int j = x % DD;
  if (t < T) {
    float v = 0.0f;
@SNIPPET
    out[((size_t)bh * T + t) * DD + j] = VQ_CAST(TO, v);
  }
"""


def tile_stride(words: int) -> int:
    """Words between tokens in a shared tile: odd, so that threads reading one token each
    fall in different memory banks."""
    return words | 1


class CodecTables:
    """One codec's constant tables for every kernel that reads them (dequant, partial, encode), in one
    device array: a table is stored once however many kernels or snippets ask for it (by content),
    and appended tables leave the earlier offsets where they were, so a kernel rendered before
    still indexes the grown array right. Kernels take `array()` at launch."""

    def __init__(self):
        self.parts: List[np.ndarray] = []
        self.size = 0
        self._offsets = {}  # content digest -> offset
        self._array = None

    def offset(self, table: np.ndarray) -> int:
        key = hashlib.sha1(table.tobytes()).hexdigest()
        if key not in self._offsets:
            self._offsets[key] = self.size
            self.parts.append(table)
            self.size += table.size
            self._array = None
        return self._offsets[key]

    def array(self) -> mx.array:
        if self._array is None:
            self._array = mx.array(np.concatenate(self.parts) if self.parts else np.zeros(1, np.float32))
        return self._array


_CODEC_TABLES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def codec_tables(codec) -> CodecTables:
    """`codec`'s `CodecTables` (made on first use, freed with the codec)."""
    tables = _CODEC_TABLES.get(codec)
    if tables is None:
        tables = _CODEC_TABLES[codec] = CodecTables()
    return tables


class ConstantTables:
    """A snippet's constant tables. They are stored in the codec's `CodecTables` (`tables`), and the
    snippet indexes them there through `table_base`; with `compact`, the snippet indexes a kernel's
    shared-memory copy instead, which holds them one after the other from `table_start` on, and
    `copies` says where each one comes from: (offset in the copy, offset in `tables`, size)."""

    def __init__(self, tables: CodecTables, table_base: str = "tab", compact: bool = False, table_start: int = 0):
        self.tables = tables
        self.table_base = table_base
        self.compact = compact
        self.table_start = table_start
        self.table_size = 0  # floats of the compact copy
        self.copies: List[Tuple[int, int, int]] = []

    def table(self, values) -> str:
        """`values` (floats) as a constant table; the C expression of its first element's address."""
        arr = np.ascontiguousarray(np.asarray(values, dtype=np.float32).reshape(-1))
        stored = self.tables.offset(arr)
        if not self.compact:
            return f"({self.table_base} + {stored})"
        offset = self.table_start + self.table_size
        self.copies.append((offset, stored, arr.size))
        self.table_size += arr.size
        return f"({self.table_base} + {offset})"


class Access(ConstantTables):
    """C expressions for one role's fields, for the store's layout. Capacities (rows per
    buffer) are runtime values in `meta` (they change as the store grows; the kernel text
    does not)."""

    def __init__(self, layout, role: str, codec, meta_base: int = 2, table_base: str = "tab",
                 compact: bool = False, table_start: int = 0):
        """`layout`: the `RowStore`'s row layout, or None for a `FieldStore`. `meta_base`: where
        this role's per-field capacities start in `meta`; the tables as `ConstantTables`'s (a kernel
        reading both roles gives each its own base, or compact range)."""
        ConstantTables.__init__(self, codec_tables(codec), table_base, compact, table_start)
        self.role, self.codec = role, codec
        self.meta_base = meta_base
        self.rows = layout is not None
        self.layout = layout
        self.fields = {f.name: f for f in codec.format.fields}
        self.staged = {}  # field name -> word offset in the kernel's shared tile (`stage`)
        self.lines: List[str] = []
        self._n = 0

    def _var(self) -> str:
        self._n += 1
        return f"{self.role[0]}{self._n}"

    def buffer(self, name: str) -> str:
        return f"{self.role[0]}_{name}"

    def _row(self, name: str) -> str:
        """Index of this token's row in the buffer holding field `name`."""
        if self.rows:
            return "((size_t)bh * meta[1] + t)"
        f = self.fields[name]
        cap = f"meta[{self.meta_index(name)}]"
        return f"((size_t)bh * {cap} + t / {f.tokens_per_row})" if f.tokens_per_row > 1 else f"((size_t)bh * {cap} + t)"

    def meta_index(self, name: str) -> int:
        return self.meta_base + [f.name for f in self.codec.format.fields].index(name)

    def stage(self, offset: int, tokens: int, scalars: bool = True) -> int:
        """Read this role's fields for tokens [tile, tile + `tokens`) from a shared tile `vq_tile`,
        from word `offset` on; returns the next free word. A field store stages its per-token
        packed fields (a token's words at an odd stride, `tile_stride`) and, with `scalars`, its
        per-token fp16 fields and the rows of its per-block fp16 fields that the tile's tokens
        fall in (every thread of a warp reads the same row); the others are read from memory."""
        if self.rows:
            self.staged = {f.name: offset for f in self.codec.format.fields}
            return offset  # the rows' tile is laid out by the caller (`tile_copy`)
        for f in self.codec.format.fields:
            if f.tokens_per_row == 1 and (scalars or f.kind == PACKED):
                self.staged[f.name] = offset
                offset += tile_stride(f.words) * tokens
            elif f.kind != PACKED and scalars:
                self.staged[f.name] = offset
                offset += -(-(self._block_rows(f, tokens) * f.width) // 2)
        return offset

    @staticmethod
    def _block_rows(f, tokens: int) -> int:
        """Rows of per-block field `f` that `tokens` consecutive tokens can touch."""
        return (tokens - 1) // f.tokens_per_row + 2

    def tile_copy(self) -> str:
        """C statements copying this role's staged fields of tokens [tile, tile + ntok) into
        the shared tile (field stores; a row store's rows are copied whole by the caller)."""
        out = []
        for name, offset in self.staged.items():
            f = self.fields[name]
            cap = f"meta[{self.meta_index(name)}]"
            if f.kind == PACKED:
                src = f"{self.buffer(name)} + ((size_t)bh * {cap} + tile) * {f.words}"
                out.append(f"  {{ const VQ_GLOBAL uint32_t* src_ = {src};\n"
                           f"    for (int i_ = tid; i_ < ntok * {f.words}; i_ += NT)"
                           f" vq_tile[{offset} + (i_ / {f.words}) * {tile_stride(f.words)} + i_ % {f.words}] = src_[i_]; }}")
            elif f.tokens_per_row == 1:
                src = f"{self.buffer(name)} + ((size_t)bh * {cap} + tile) * {f.width}"
                out.append(f"  {{ const VQ_GLOBAL vq_half* src_ = {src};\n"
                           f"    for (int i_ = tid; i_ < ntok * {f.width}; i_ += NT) VQ_SHALF_PTR(vq_tile)"
                           f"[{2 * offset} + (i_ / {f.width}) * {2 * tile_stride(f.words)} + i_ % {f.width}] = src_[i_]; }}")
            else:
                g = f.tokens_per_row
                src = f"{self.buffer(name)} + ((size_t)bh * {cap} + tile / {g}) * {f.width}"
                out.append(f"  {{ const VQ_GLOBAL vq_half* src_ = {src};\n"
                           f"    for (int i_ = tid; i_ < ((tile + ntok - 1) / {g} - tile / {g} + 1) * {f.width}; i_ += NT)"
                           f" VQ_SHALF_PTR(vq_tile)[{2 * offset} + i_] = src_[i_]; }}")
        return "\n".join(out)

    def word(self, name: str, k: str) -> str:
        f = self.fields[name]
        if name in self.staged:
            if self.rows:
                return f"vq_tile[(t - tile) * RWP + {self.layout.slot(self.role, name).start} + ({k})]"
            return f"vq_tile[{self.staged[name]} + (t - tile) * {tile_stride(f.words)} + ({k})]"
        if self.rows:
            return f"rows[{self._row(name)} * RW + {self.layout.slot(self.role, name).start} + ({k})]"
        return f"{self.buffer(name)}[{self._row(name)} * {f.words} + ({k})]"

    def half(self, name: str, k: str) -> str:
        f = self.fields[name]
        if self.rows and name in self.staged:
            return f"VQ_F(VQ_SHALF_CPTR(vq_tile)[(t - tile) * (2 * RWP) + {self.layout.slot(self.role, name).start} + ({k})])"
        if name in self.staged:
            first = 2 * self.staged[name]
            if f.tokens_per_row == 1:
                return f"VQ_F(VQ_SHALF_CPTR(vq_tile)[{first} + (t - tile) * {2 * tile_stride(f.words)} + ({k})])"
            g = f.tokens_per_row
            return f"VQ_F(VQ_SHALF_CPTR(vq_tile)[{first} + (t / {g} - tile / {g}) * {f.width} + ({k})])"
        if self.rows:
            return f"VQ_F(VQ_HALF_CPTR(rows)[{self._row(name)} * (2 * RW) + {self.layout.slot(self.role, name).start} + ({k})])"
        return f"VQ_F({self.buffer(name)}[{self._row(name)} * {f.width} + ({k})])"

    def code(self, name: str, index: str) -> str:
        """A variable holding code `index` of packed field `name` (dense little-endian)."""
        f = self.fields[name]
        assert f.kind == PACKED
        return self.bits_at(name, f"({index}) * {f.bits}", f.bits)

    def bits_at(self, name: str, start: str, width: int) -> str:
        """A variable holding the `width` (<= 32) bits of packed field `name` from bit `start` on
        (dense little-endian: a stream of codes of several widths, as polarquant's)."""
        assert self.fields[name].kind == PACKED and 0 < width <= 32
        v = self._var()
        mask = "0xffffffffu" if width == 32 else f"{(1 << width) - 1}u"
        self.lines.append(
            f"    uint32_t {v}; {{ const int b_ = {start}; const int w_ = b_ >> 5; const int s_ = b_ & 31;"
            f" {v} = {self.word(name, 'w_')} >> s_;"
            f" if (s_ + {width} > 32) {v} |= {self.word(name, 'w_ + 1')} << (32 - s_);"
            f" {v} &= {mask}; }}")
        return v

    def snippet(self) -> str:
        body = self.codec.kernel_decode(self)  # first: it emits the code loads into self.lines
        return "\n".join(self.lines + [f"    {body}"])


def supported(codec) -> bool:
    return callable(getattr(codec, "kernel_decode", None))


@dataclass(frozen=True)
class Program:
    kernel: str
    inputs: Tuple[str, ...]
    tables: CodecTables
    domain_dim: int


@functools.lru_cache(maxsize=CODEC_KEYED)
def _program(layout, role: str, codec) -> Program:
    access = Access(layout, role, codec)
    snippet = access.snippet()
    if access.rows:
        inputs = ("rows",)
    else:
        inputs = tuple(access.buffer(f.name) for f in codec.format.fields)
    body = _BODY.replace("@SNIPPET", snippet)
    name = "dequant_" + hashlib.sha1((body + repr(inputs)).encode()).hexdigest()[:16]
    if name not in templates.KERNELS:
        templates.KERNELS[name] = {"body": body, "inputs": inputs + ("tab", "meta"), "outputs": ("out",)}
    return Program(name, inputs, access.tables, codec.format.domain_dim)


def program(store, role: str, codec) -> Program:
    return _program(store.layout if isinstance(store, RowStore) else None, role, codec)


def dequantize(run, store, role: str, codec, tokens: int, out_dtype) -> mx.array:
    """The first `tokens` of `role` decoded into the codec's domain: (B, H, tokens, domain)."""
    prog = program(store, role, codec)
    dd = prog.domain_dim
    if isinstance(store, RowStore):
        rows = store.rows
        B, H, cap, rw = rows.shape
        arrays = [rows]
        caps = (cap,)
        template = [("DD", dd), ("NT", THREADS), ("TO", launch.dtype_name(out_dtype)), ("RW", rw)]
    else:
        buffers = store.buffers[role]
        arrays = [buffers[f.name] for f in codec.format.fields]
        B, H = arrays[0].shape[:2]
        caps = (0,) + tuple(a.shape[2] for a in arrays)
        template = [("DD", dd), ("NT", THREADS), ("TO", launch.dtype_name(out_dtype))]
    plan = _plan(prog.kernel, tuple(template), tokens, dd, B * H, launch.dtype_name(out_dtype))
    (out,) = run(plan, arrays + [prog.tables.array(), small_array((tokens,) + caps)], [(B, H, tokens, dd)])
    return out


@functools.lru_cache(maxsize=4096)
def _plan(kernel: str, template: tuple, tokens: int, dd: int, rows: int, out_dtype: str) -> Plan:
    # One plan object per shape: the runners cache their launch arguments by plan.
    return Plan(kernel, list(template), (max(1, tokens * dd), rows, 1), (THREADS, 1, 1), [(rows, tokens, dd)],
                [out_dtype])
