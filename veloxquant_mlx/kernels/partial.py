"""One flash-decoding partial kernel for every format with a decode snippet (CUDA, Metal,
the C++ emulator).

The dequant kernel (`dequant.py`) writes the whole history out as floats and MLX's
attention reads it back: more bytes than the fp16 cache it replaces. This kernel reads
the codes once. Block (split s, kv row bh) walks its tokens in tiles of NT: thread t
decodes token t's key element by element with the key codec's `kernel_decode` snippet and
scores it against the REP query heads of its group (queries already in the key domain),
the block updates a running softmax (max, sum) as flash-decoding does, and then thread
(lane, g) adds elements [g G, g G + G) of every TL-th token's values, decoded by the value
codec's snippet, weighted by p (`value_group` picks G). Tiles, queries, weights, constant
tables and a field store's fp16 scalars sit in shared memory as far as the back end's limit
allows (`program` picks the variant). Each split leaves (o, m, l) in the value domain; `engine.merge_partials`
merges the splits with the fp16 sinks/window partial, leaves the value domain and adds
the value mean, in the same compiled graph. A codec whose element is offset + scale * code,
with offset and scale shared by a key block or a group of value channels, may give them
apart (`kernel_key_fold` / `kernel_value_fold`, KIVI): the kernel then folds the query into
each key block and the scale into each token's weight. The kernel text is rendered from the
snippets and registered under a name derived from it, so each pair of formats compiles once
per process and back end.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import Optional, Tuple

import mlx.core as mx

from .. import engine
from ..storage import RowStore
from . import launch, ops, templates
from .dequant import Access, CodecTables, tile_stride
from .launch import Plan

THREADS = 128
META_FIXED = 4  # meta: [tokens, rows' capacity, tokens per split, splits, per-field capacities...]
SHARED_LIMIT = 44 * 1024  # of CUDA's 48 KB of static shared memory per block
SHARED_LIMITS = {"metal": 32 * 1024}  # Apple GPUs' threadgroup memory


def shared_limit(backend: Optional[str]) -> int:
    """Static shared memory a kernel of `backend` may use."""
    return SHARED_LIMITS.get(backend, SHARED_LIMIT)

_BODY = r"""
  constexpr int NW = NT / 32;
  constexpr int R4 = (REP + 3) / 4;
  // The tile's codes, and after the last tile the lanes' value sums (vq_red).
  constexpr int BIG = (TILE_WORDS > TL * REP * DDV) ? TILE_WORDS : TL * REP * DDV;
  const int tid = vq_tid;
  const int s = vq_bx;
  const int bh = vq_by;
  const int T = meta[0];
  const int CH = meta[2];
  const int S = meta[3];
  const int start = s * CH;
  const int end = VQ_MINI(start + CH, T);
  // Queries (per key element) and weights (per token) of the REP heads, padded to float4s.
  VQ_SHARED vq_f4 vq_q4[DDK * R4];
  VQ_SHARED vq_f4 vq_w4[NT * R4];
  VQ_SHARED float vq_wred[REP * NW];
  VQ_SHARED uint32_t vq_tile[BIG];
  auto vq_red = VQ_FPTR(vq_tile);
@TABLES
@FOLD_DECL
  for (int i = tid; i < R4 * 4 * DDK; i += NT) {
    const int r = i / DDK;
    VQ_FPTR(vq_q4)[(i % DDK) * (R4 * 4) + r] = (r < REP) ? q[(size_t)bh * REP * DDK + i] : 0.0f;
  }
  VQ_SYNC();

  float m_run[REP];
  float l_part[REP];
  float alpha[REP];
  float acc[G * REP];
  float accm[REP];  // a folded value format's offsets, summed once per token for the thread's G elements
  VQ_UNROLL
  for (int r = 0; r < REP; ++r) { m_run[r] = VQ_NEG_INF; l_part[r] = 0.0f; accm[r] = 0.0f; }
  VQ_UNROLL
  for (int i = 0; i < G * REP; ++i) acc[i] = 0.0f;
  const int g = tid % NDG;
  const int lane = tid / NDG;

  for (int tile = start; tile < end; tile += NT) {
    const int ntok = VQ_MINI(NT, end - tile);
    // The tile's codes, copied with coalesced loads: each thread then decodes its own token.
@STAGE
    VQ_SYNC();
@FOLD
    const bool valid = tid < ntok;
    float sc[R4 * 4];
    VQ_UNROLL
    for (int r = 0; r < R4 * 4; ++r) sc[r] = 0.0f;
    if (valid) {
      const int t = tile + tid;
@QROW_DECL
      // Unrolled whole: each element's bit offset in the token's words is a constant.
      VQ_UNROLL
      for (int j = 0; j < DDK; ++j) {
        float v = 0.0f;
        {
@KEY
        }
        VQ_UNROLL
        for (int r4 = 0; r4 < R4; ++r4) {
          const vq_f4 qv = @QROW[j * R4 + r4];
          sc[4 * r4] += qv.x * v;
          if (4 * r4 + 1 < REP) sc[4 * r4 + 1] += qv.y * v;
          if (4 * r4 + 2 < REP) sc[4 * r4 + 2] += qv.z * v;
          if (4 * r4 + 3 < REP) sc[4 * r4 + 3] += qv.w * v;
        }
      }
@BIAS
    }
""" + templates.ONLINE_SOFTMAX.replace("@TID", "tid").replace("@STORE", "VQ_FPTR(vq_w4)[tid * (R4 * 4) + r] = p;") + r"""    VQ_SYNC();
    VQ_UNROLL
    for (int i = 0; i < G * REP; ++i) acc[i] *= alpha[i % REP];
    VQ_UNROLL
    for (int r = 0; r < REP; ++r) accm[r] *= alpha[r];
    // Thread (lane, g) adds value elements [g * G, g * G + G) of tokens lane, lane + TL, ...
    if (lane < TL) {
      for (int jj = lane; jj < ntok; jj += TL) {
        const int t = tile + jj;
        float wv[R4 * 4];
        VQ_UNROLL
        for (int r4 = 0; r4 < R4; ++r4) {
          const vq_f4 u = vq_w4[jj * R4 + r4];
          wv[4 * r4] = u.x; wv[4 * r4 + 1] = u.y; wv[4 * r4 + 2] = u.z; wv[4 * r4 + 3] = u.w;
        }
@VFOLD
        VQ_UNROLL
        for (int k = 0; k < G; ++k) {
          const int j = g * G + k;
          float v = 0.0f;
          {
@VALUE
          }
          VQ_UNROLL
          for (int r = 0; r < REP; ++r) acc[k * REP + r] += wv[r] * v;
        }
      }
    }
    VQ_SYNC();
  }

  VQ_UNROLL
  for (int r = 0; r < REP; ++r) {
    const float ls = vq_warp_sum(l_part[r]);
    if ((tid & 31) == 0) vq_wred[r * NW + (tid >> 5)] = ls;
  }
  if (lane < TL) {
    VQ_UNROLL
    for (int k = 0; k < G; ++k) {
      VQ_UNROLL
      for (int r = 0; r < REP; ++r) vq_red[(lane * REP + r) * DDV + g * G + k] = acc[k * REP + r] + accm[r];
    }
  }
  VQ_SYNC();
""" + templates.PARTIAL_RESULT.replace("@TID", "tid").replace("@DV", "DDV")

# A key format whose element is offset + scale * value(code), with offset and scale shared by a block
# of tokens (`kernel_key_fold`: KIVI's per-channel keys), is scored with the query folded into each
# block the tile touches (q_j * scale_j, and sum_j q_j * offset_j once per block and head), so an element
# costs its code and one multiply-add per head (the KIVI paper's kernel; ggml's `vec_dot` beside
# `to_float`). @OFFSET / @SCALE are the codec's expressions of (j, t); t is set to the block's first token.
_FOLD_DECL = """  constexpr int MB = FOLD_BLOCKS;
  VQ_SHARED vq_f4 vq_qf[MB * DDK * R4];
  VQ_SHARED vq_f4 vq_bias[MB * R4];"""

_FOLD = r"""    {
      const int nb = (tile + ntok - 1) / TB - tile / TB + 1;
      for (int i = tid; i < nb * DDK * R4 * 4; i += NT) {
        const int r = i % (R4 * 4);
        const int j = (i / (R4 * 4)) % DDK;
        const int t = (tile / TB + i / (R4 * 4 * DDK)) * TB;
        VQ_FPTR(vq_qf)[i] = VQ_FPTR(vq_q4)[j * (R4 * 4) + r] * (@SCALE);
      }
      // The biases: one warp per (block, head), its lanes splitting the elements; the same trip
      // count in every warp.
      for (int p0 = 0; p0 < nb * R4 * 4; p0 += NW) {
        const int p = p0 + (tid >> 5);
        const int t = (tile / TB + p / (R4 * 4)) * TB;
        float b = 0.0f;
        if (p < nb * R4 * 4) {
          for (int j = tid & 31; j < DDK; j += 32) b += VQ_FPTR(vq_q4)[j * (R4 * 4) + p % (R4 * 4)] * (@OFFSET);
        }
        b = vq_warp_sum(b);
        if ((tid & 31) == 0 && p < nb * R4 * 4) VQ_FPTR(vq_bias)[p] = b;
      }
    }
    VQ_SYNC();"""

_FOLD_ROW = "      const int rb = t / TB - tile / TB;"
_FOLD_BIAS = """      VQ_UNROLL
      for (int r = 0; r < REP; ++r) sc[r] += VQ_FPTR(vq_bias)[rb * (R4 * 4) + r];"""

# A value format whose element is offset + scale * value(code), with offset and scale shared by groups
# of channels that the G elements of a thread never straddle (`kernel_value_fold`: KIVI's per-token
# values), takes the scale into the token's weights and sums the offset once per token.
_VFOLD = """        {
          const int j = g * G;
          const float fs = @SCALE;
          const float fo = @OFFSET;
          VQ_UNROLL
          for (int r = 0; r < REP; ++r) { accm[r] += wv[r] * fo; wv[r] *= fs; }
        }"""

# Folded query rows take this much shared memory at most (else the element decodes its scale and offset).
FOLD_LIMIT = 12 * 1024

# Constant tables up to this many floats are copied into shared memory (polarquant's angle
# tables, centroids); larger ones are read from `tab`.
SHARED_TABLE_LIMIT = 2048


def _indent(snippet: str, spaces: int) -> str:
    return "\n".join(" " * spaces + line.lstrip() for line in snippet.splitlines())


@dataclass(frozen=True)
class Program:
    kernel: str
    tables: Tuple[CodecTables, CodecTables]  # keys', values' (`dequant.CodecTables`)
    key_dim: int
    value_dim: int
    tile_bytes: int
    table_bytes: int  # constant tables copied into shared memory
    fold_bytes: int  # the folded queries and biases, per float4 of query heads (0: no fold)

    def shared_bytes(self, rep: int) -> int:
        return shared_bytes(self.key_dim, self.value_dim, rep, self.tile_bytes, self.table_bytes, self.fold_bytes)


def _fold_blocks(layout, key_codec, rep: int) -> int:
    """Blocks of keys one tile can touch when the query is folded into them (0: no fold)."""
    tb = key_codec.format.token_block
    if layout is not None or tb == 1 or not callable(getattr(key_codec, "kernel_key_fold", None)):
        return 0
    blocks = (THREADS - 1) // tb + 2
    return blocks if blocks * key_codec.format.domain_dim * 16 * -(-rep // 4) <= FOLD_LIMIT else 0


def _value_fold(value_codec, g: int) -> bool:
    """Whether the value codec's fold applies with G elements per thread."""
    fold = getattr(value_codec, "kernel_value_fold", None)
    return callable(fold) and value_codec.kernel_fold_channels % g == 0


def _accesses(layout, key_codec, value_codec, shared_tables: bool, fold: bool, value_fold: bool, scalars: bool):
    """The roles' `Access`es and snippets: the tables indexed in the codecs' arrays (`ktab`, `vtab`),
    or with `shared_tables` in the kernel's copy of them in shared memory (`vq_tab`), keys' first."""
    bases = ("vq_tab", "vq_tab") if shared_tables else ("ktab", "vtab")
    keys = Access(layout, "keys", key_codec, meta_base=META_FIXED, table_base=bases[0], compact=shared_tables)
    values = Access(layout, "values", value_codec, meta_base=META_FIXED + len(key_codec.format.fields),
                    table_base=bases[1], compact=shared_tables)
    tile_words = values.stage(keys.stage(0, THREADS, scalars), THREADS, scalars)
    if fold:
        scale, offset, value = key_codec.kernel_key_fold(keys)
        key_snippet = "\n".join(keys.lines + [f"    v = {value};"])
    else:
        scale = offset = None
        key_snippet = keys.snippet()
    values.table_start = keys.table_size
    if value_fold:
        vscale, voffset, value = value_codec.kernel_value_fold(values)
        value_snippet = "\n".join(values.lines + [f"    v = {value};"])
        vfold = _VFOLD.replace("@SCALE", vscale).replace("@OFFSET", voffset)
    else:
        value_snippet, vfold = values.snippet(), ""
    return keys, values, tile_words, key_snippet, value_snippet, (scale, offset), vfold


def _copy_tables(keys, values) -> str:
    """Statements copying the tables the snippets read into `vq_tab` (compact `Access`es)."""
    size = keys.table_size + values.table_size
    lines = [f"  VQ_SHARED float vq_tab[{max(1, size)}];"]
    for access, source in ((keys, "ktab"), (values, "vtab")):
        for offset, stored, count in access.copies:
            lines.append(f"  for (int i = tid; i < {count}; i += NT) vq_tab[{offset} + i] = {source}[{stored} + i];")
    return "\n".join(lines)


@functools.lru_cache(maxsize=engine.CODEC_KEYED)
def _program(layout, key_codec, value_codec, fold_blocks: int, value_fold: bool, scalars: bool = True,
             shared_tables: bool = True) -> Program:
    """`scalars`: stage a field store's fp16 scalars in shared memory; `shared_tables`: copy the
    constant tables there (both where they fit, see `program`)."""
    rows = layout is not None
    fold = fold_blocks > 0
    key_fields, value_fields = key_codec.format.fields, value_codec.format.fields
    keys, values, tile_words, key_snippet, value_snippet, folded, vfold = _accesses(
        layout, key_codec, value_codec, shared_tables, fold, value_fold, scalars)
    table_size = keys.table_size + values.table_size
    if table_size > SHARED_TABLE_LIMIT and shared_tables:  # known once the snippets are rendered
        shared_tables = False
        keys, values, tile_words, key_snippet, value_snippet, folded, vfold = _accesses(
            layout, key_codec, value_codec, shared_tables, fold, value_fold, scalars)
    copy_tables = _copy_tables(keys, values) if shared_tables else ""
    if rows:
        tile_words = tile_stride(layout.words) * THREADS
        stage = (f"  constexpr int RWP = {tile_stride(layout.words)};\n"
                 "  { const VQ_GLOBAL uint32_t* src_ = rows + ((size_t)bh * meta[1] + tile) * RW;\n"
                 "    for (int i_ = tid; i_ < ntok * RW; i_ += NT) vq_tile[(i_ / RW) * RWP + i_ % RW] = src_[i_]; }")
    else:
        stage = "\n".join(code for code in (keys.tile_copy(), values.tile_copy()) if code)
    if rows:
        inputs = ("rows",)
    else:
        inputs = tuple(keys.buffer(f.name) for f in key_fields) + tuple(values.buffer(f.name) for f in value_fields)
    if fold:
        scale, offset = folded
        fold_parts = {"@FOLD_DECL": _FOLD_DECL.replace("FOLD_BLOCKS", str(fold_blocks)),
                      "@FOLD": _FOLD.replace("TB", str(key_codec.format.token_block)).replace(
                          "@SCALE", scale).replace("@OFFSET", offset),
                      "@QROW_DECL": _FOLD_ROW.replace("TB", str(key_codec.format.token_block)),
                      "@QROW": "(vq_qf + rb * (DDK * R4))", "@BIAS": _FOLD_BIAS}
    else:
        fold_parts = {"@FOLD_DECL": "", "@FOLD": "", "@QROW_DECL": "", "@QROW": "vq_q4", "@BIAS": ""}
    body = _BODY
    for token in ("@FOLD_DECL", "@FOLD", "@QROW_DECL", "@QROW", "@BIAS"):  # longest first: @FOLD after @FOLD_DECL
        body = body.replace(token, fold_parts[token])
    body = (body.replace("@VFOLD", vfold).replace("@STAGE", stage).replace("@KEY", _indent(key_snippet, 10))
            .replace("@VALUE", _indent(value_snippet, 12)).replace("@TABLES", copy_tables)
            .replace("TILE_WORDS", str(max(1, tile_words))))
    name = "partial_" + hashlib.sha1((body + repr(inputs)).encode()).hexdigest()[:16]
    if name not in templates.KERNELS:
        templates.KERNELS[name] = {"body": body, "inputs": ("q",) + inputs + ("ktab", "vtab", "meta"), "outputs": ("o", "ml")}
    table_bytes = 4 * table_size if copy_tables else 0
    fold_bytes = fold_blocks * (key_codec.format.domain_dim + 1) * 16  # per R4
    return Program(name, (keys.tables, values.tables), key_codec.format.domain_dim, value_codec.format.domain_dim,
                   4 * max(1, tile_words), table_bytes, fold_bytes)


def program(store, key_codec, value_codec, rep: int, backend: Optional[str] = None) -> Program:
    """The kernel for these formats at `rep` query heads per kv head: the first of its variants whose
    shared memory fits `backend`'s limit (with everything in shared memory, then without the key fold,
    then without the staged fp16 scalars, then without the shared tables), else the last."""
    return _fitting_program(store.layout if isinstance(store, RowStore) else None, key_codec, value_codec, rep,
                            backend)


@functools.lru_cache(maxsize=engine.CODEC_KEYED)
def _fitting_program(layout, key_codec, value_codec, rep: int, backend: Optional[str]) -> Program:
    """`program`'s choice, made once per layout, codecs, heads and back end (decode steps ask every layer)."""
    g = value_group(value_codec.format.domain_dim, rep)
    value_fold = g is not None and _value_fold(value_codec, g)
    fold_blocks = _fold_blocks(layout, key_codec, rep)
    limit = shared_limit(backend)
    variants = ((fold_blocks, True, True), (0, True, True), (0, False, True), (0, False, False))
    for fold, scalars, tables in variants:
        prog = _program(layout, key_codec, value_codec, fold, value_fold, scalars, tables)
        if g is None or prog.shared_bytes(rep) <= limit:
            break
    return prog


def value_group(value_dim: int, rep: int):
    """Consecutive value elements per thread: the most of 8, 4, 2, 1 that divides the value
    dim, leaves at most NT groups and keeps the accumulator (G * REP floats) to 32
    registers (64 for one element); None when none does."""
    for g in (8, 4, 2, 1):
        if value_dim % g == 0 and value_dim // g <= THREADS and (g * rep <= 32 or (g == 1 and rep <= 64)):
            return g
    return None


def _shape_constants(key_dim: int, value_dim: int, rep: int) -> dict:
    g = value_group(value_dim, rep)
    ndg = value_dim // g
    return {"DDK": key_dim, "DDV": value_dim, "REP": rep, "NT": THREADS, "G": g, "NDG": ndg, "TL": THREADS // ndg}


def shared_bytes(key_dim: int, value_dim: int, rep: int, tile_bytes: int = 0, table_bytes: int = 0,
                 fold_bytes: int = 0) -> int:
    """Static shared memory of the kernel; `fold_bytes`: the folded queries' per float4 of heads."""
    c = _shape_constants(key_dim, value_dim, rep)
    r4 = -(-rep // 4)
    return (16 * r4 * (key_dim + THREADS) + 4 * rep * (THREADS // 32)
            + max(tile_bytes, 4 * c["TL"] * rep * value_dim) + table_bytes + r4 * fold_bytes)


def fits(store, key_codec, value_codec, rep: int, backend: Optional[str] = None) -> bool:
    """Whether this kernel takes the pair at `rep` query heads per kv head on `backend` (static
    shared memory, registers of the value accumulator)."""
    if value_group(value_codec.format.domain_dim, rep) is None:
        return False
    return program(store, key_codec, value_codec, rep, backend).shared_bytes(rep) <= shared_limit(backend)


def arrays_of(store, key_codec, value_codec):
    """The store's buffers in the kernel's input order, and their capacities for `meta`."""
    if isinstance(store, RowStore):
        return [store.rows], (store.rows.shape[2],), ()
    bufs = [store.buffers["keys"][f.name] for f in key_codec.format.fields]
    bufs += [store.buffers["values"][f.name] for f in value_codec.format.fields]
    return bufs, (0,), tuple(b.shape[2] for b in bufs)


@functools.lru_cache(maxsize=1024)
def plan(kernel: str, template: tuple, kv_rows: int, rep: int, value_dim: int, splits: int) -> Plan:
    return Plan(kernel, list(template), (splits * THREADS, kv_rows, 1), (THREADS, 1, 1),
                [(kv_rows, splits, rep, value_dim), (kv_rows, splits, rep, 2)], ["float32", "float32"])


def split_tokens(capacity: int, kv_rows: int, chunk=None) -> int:
    """Tokens per split, planned from the capacity (not the count), so the launch shape and
    with it the compiled decode graph change only when the store grows."""
    return launch.choose_chunk(capacity, kv_rows, threads=THREADS, chunk=chunk)


@dataclass(frozen=True)
class Launch:
    """What one decode step passes to the kernel: the plan, and the store's buffers plus the
    constant tables (keys', values') and `meta` (count first) in the kernel's input order."""
    plan_key: tuple  # the arguments of `plan`
    inputs: Tuple[mx.array, ...]

    @property
    def plan(self) -> Plan:
        return plan(*self.plan_key)


def prepare(store, key_codec, value_codec, kv_rows: int, rep: int, count, chunk=None,
            backend: Optional[str] = None) -> Launch:
    """`count`: tokens held as codes (an int); `backend`: the one that will run it (its shared
    memory limit picks the kernel's variant, `program`)."""
    prog = program(store, key_codec, value_codec, rep, backend)
    arrays, row_caps, field_caps = arrays_of(store, key_codec, value_codec)
    capacity = store.capacity
    chunk = split_tokens(capacity, kv_rows, chunk)
    splits = -(-capacity // chunk)
    consts = _shape_constants(prog.key_dim, prog.value_dim, rep)
    template = tuple(consts.items()) + ((("RW", store.rows.shape[3]),) if isinstance(store, RowStore) else ())
    meta = engine.small_array((count,) + row_caps + (chunk, splits) + field_caps)
    return Launch((prog.kernel, template, kv_rows, rep, prog.value_dim, splits), tuple(arrays) + tuple(t.array() for t in prog.tables) + (meta,))


@functools.lru_cache(maxsize=engine.CODEC_KEYED)
def _tokens_in_merge(value_codec, value_dim: int, out_dim: int, fp16_parts: int) -> bool:
    """Whether the merge kernel attends to the fp16 sinks / window itself (and gets them as held):
    where it can leave the value domain. One launch instead of a dozen small ops per layer and step.
    (The kernel scores the fp16 keys against the queries in its value-dim threads: equal head dims only.)"""
    from .ops import merge_domain

    return fp16_parts >= 0 and out_dim == value_dim and merge_domain(value_codec, value_dim) is not None


@functools.lru_cache(maxsize=engine.CODEC_KEYED)
def _step_fn(backend: str, plan_key: tuple, key_codec, value_codec, out_shape: Tuple[int, ...], out_dtype, scale: float,
             fp16_parts: int, centered: bool, compiled: bool, window_buffer: bool = False, sinks: bool = False):
    """`window_buffer`: the window comes as a buffer of fixed capacity, with the merge kernel's
    meta saying how much of it is filled (`ops.merge_meta`). `sinks`: learned attention sinks
    (`sink_logits`), one more split (`engine.with_sink_split`)."""
    from .ops import FP16Tokens, merge, runner

    run, plan_ = runner(backend), plan(*plan_key)
    in_kernel = _tokens_in_merge(value_codec, plan_.output_shapes[0][3], out_shape[-1], fp16_parts)

    def step(queries, inputs, fp16, key_mean, value_mean, tokens_meta, sink_logits):
        B, n_heads, _, dim = queries.shape
        kv_rows, rep = plan_.grid[1], plan_.output_shapes[0][2]
        q = key_codec.to_domain((queries.astype(mx.float32) * scale).reshape(B, kv_rows // B, rep, dim))
        o, ml = run(plan_, [q.astype(mx.float32)] + list(inputs))
        if sinks:
            o, ml = engine.with_sink_split(o, ml, sink_logits, value_codec, value_mean if centered else None,
                                           queries, key_mean if centered else None, scale)
        if in_kernel:
            tokens = (FP16Tokens(queries, list(fp16), scale, key_mean if centered else None,
                                 tokens_meta if window_buffer else None) if fp16_parts else None)
            return merge(run, o, ml, value_codec, out_shape, out_dtype, value_mean=value_mean if centered else None,
                         tokens=tokens)
        tokens = engine.fp16_tokens(fp16_parts, fp16, key_mean if centered else None)
        plain = None if tokens is None else engine.plain_partial(queries, *tokens, scale)
        return engine.merge_partials(o, ml, value_codec, out_shape, out_dtype, plain=plain,
                                     value_mean=value_mean if centered else None)

    return mx.compile(step) if compiled else step


def decode(h, queries: mx.array, scale: float, chunk=None) -> mx.array:
    """One decode step over `h` (an `engine.History`): the partial kernel, the fp16
    sinks/window partial and the merge, one compiled graph per plan (the emulator runs it
    op by op)."""
    B, n_heads = queries.shape[:2]
    rep = n_heads // h.kv_heads
    backend = h.settings.backend
    launch_ = prepare(h.store, h.key_codec, h.value_codec, B * h.kv_heads, rep, h.count,
                      chunk if chunk is not None else h.settings.split_tokens, backend)
    held = (h.window_capacity is not None and h.window > 0
            and _tokens_in_merge(h.value_codec, launch_.plan_key[4], queries.shape[-1], 0))
    parts, fp16 = h.fp16_inputs(held=held)
    tokens_meta = engine.small_array((0,))
    if held:
        sinks = fp16[0].shape[2] if parts == 2 else 0
        splits = launch_.plan_key[-1] + (h.sink_logits is not None)  # the learned sinks' split merged too
        tokens_meta = ops.merge_meta(splits, sinks, h.window, h.window_capacity)
    centered = h.value_mean is not None
    fn = _step_fn(backend, launch_.plan_key, h.key_codec, h.value_codec, tuple(queries.shape), queries.dtype,
                  float(scale), parts, centered, backend != "emulator" and h.settings.compile_step, held,
                  h.sink_logits is not None)
    none = engine.small_array((0.0,), mx.float32)
    return fn(queries, list(launch_.inputs), fp16, h.key_mean if centered else none,
              h.value_mean if centered else none, tokens_meta, none if h.sink_logits is None else h.sink_logits)


# Of the largest output: float32 sums taken in another order than MLX's, and the GPU's exp.
CHECK_TOLERANCE = 1e-3
CHECK_METHODS = (
    {"method": "kivi", "bits": 4, "group_size": 32},  # a field store with per-block key fields
    {"method": "turboquant_rvq", "bits": 2},  # a row store
    {"method": "qjl", "bits": 3, "sink_tokens": 2, "residual_length": 8},  # a non-orthogonal key domain, fp16 partial
)
