"""Where encoded tokens live: one small class per storage strategy.

* `RowStore`: every field of both roles in one uint32 row per token
  (`formats.RowLayout`): a token is stored with one slice update, and the kernels
  read one contiguous row. For formats whose fields are all per token.
* `FieldStore`: one buffer per field, for formats with per-block fields (KIVI's
  per-channel key scales, one row per group of tokens).

Both grow in steps of `step` tokens (shapes stay fixed between growths, which is
what lets compiled decode steps replay), hand out read-only field views of a token
range, and count `nbytes` as the live buffers, unused capacity included. A
`RowStore` can also hold one *pending* decode token, stored by the next reader
(`flush`) or by a fused attention kernel that encodes it on the way.
"""

from __future__ import annotations

import copy
import inspect
import math
import weakref
from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx

from .formats import Fields, RowLayout

STEP = 256


def _padded(buffer: mx.array, capacity: int) -> mx.array:
    """`buffer` with zero rows appended up to `capacity` rows."""
    spare = capacity - buffer.shape[2]
    if not spare:
        return buffer
    return mx.concatenate([buffer, mx.zeros((*buffer.shape[:2], spare, buffer.shape[3]), buffer.dtype)], axis=2)


def grow(buffer: Optional[mx.array], rows_needed: int, like: mx.array, step: int) -> mx.array:
    """`buffer` (or a new zero one shaped like `like`) with room for `rows_needed` rows, grown in
    whole `step`s of rows."""
    capacity = 0 if buffer is None else buffer.shape[2]
    if rows_needed <= capacity:
        return buffer
    new_capacity = math.ceil(rows_needed / step) * step
    if buffer is None:
        return mx.zeros((*like.shape[:2], new_capacity, like.shape[3]), dtype=like.dtype)
    return _padded(buffer, new_capacity)


def _with_spare_capacity(buffer: mx.array, step: int) -> mx.array:
    """A loaded buffer of exactly its stored rows, grown to the capacity that appending them
    would have left: the loaded store then computes on the shapes of the one that was saved
    (its decode reads the whole capacity, masked), so its outputs match it bit for bit."""
    return _padded(buffer, math.ceil(buffer.shape[2] / step) * step)


def _drop_front(buffer: mx.array, rows: int, used: int, step: int) -> mx.array:
    """`buffer` without its first `rows` rows, of which `used` hold data: the rest keeps the
    capacity (shapes stay fixed, so compiled steps replay) unless whole steps of it are free."""
    if rows == 0:
        return buffer
    left = used - rows
    capacity = min(buffer.shape[2], max(step, math.ceil(left / step) * step))
    return _padded(buffer[..., rows:used, :], capacity)


# (names (key field names, value field names), tokens per row ((name, tokens) pairs of keys, of values),
# key buffers, value buffers), names sorted and buffers in their order: what keys and feeds a compiled decode step.
CapacityInputs = Tuple[Tuple[Tuple[str, ...], Tuple[str, ...]], tuple, List[mx.array], List[mx.array]]


def _sorted_per_row(tokens_per_row: Dict[str, Dict[str, int]]) -> tuple:
    return tuple(tuple(sorted(tokens_per_row[role].items())) for role in ("keys", "values"))


def _capacity_inputs(key_fields: Fields, value_fields: Fields, per_row: tuple) -> CapacityInputs:
    names = (tuple(sorted(key_fields)), tuple(sorted(value_fields)))
    return names, per_row, [key_fields[n] for n in names[0]], [value_fields[n] for n in names[1]]


class RowStore:
    def __init__(self, layout: RowLayout, encode: Callable[[mx.array, mx.array], mx.array], step: int = STEP):
        self.layout, self.encode, self.step = layout, encode, step
        self.rows: Optional[mx.array] = None  # (B, H, capacity, layout.words) uint32
        self.count = 0
        self.pending: Optional[Tuple[mx.array, mx.array]] = None
        self.tokens_per_row: Dict[str, Dict[str, int]] = {
            role: {s.field.name: 1 for s in layout.slots if s.role == role} for role in ("keys", "values")}
        self._per_row = _sorted_per_row(self.tokens_per_row)

    @property
    def capacity(self) -> int:
        return 0 if self.rows is None else self.rows.shape[2]

    def reserve(self, tokens: int, like: Optional[mx.array] = None):
        """Capacity for `tokens` more tokens (`like`: any (B, H, n, words) uint32 array)."""
        self.rows = grow(self.rows, self.count + tokens, like if like is not None else self.rows, self.step)

    def append_rows(self, rows: mx.array):
        self.reserve(rows.shape[2], rows)
        self.rows[..., self.count : self.count + rows.shape[2], :] = rows
        self.count += rows.shape[2]

    def append(self, keys: mx.array, values: mx.array):
        self.flush()
        self.append_rows(self.encode(keys, values))

    def defer(self, keys: mx.array, values: mx.array):
        """Keep one decode token for the next reader (`flush`) or a fused kernel (`take_pending`)."""
        self.flush()
        self.pending = (keys, values)

    def take_pending(self) -> Tuple[mx.array, mx.array]:
        pending, self.pending = self.pending, None
        self.reserve(1)
        return pending

    def put_row(self, rows: mx.array):
        """`rows` (the same buffer, with the pending token's row written by a kernel)."""
        self.rows = rows
        self.count += 1

    def flush(self):
        if self.pending is not None:
            keys, values = self.pending
            self.pending = None
            self.append(keys, values)

    def fields(self, role: str, start: int = 0, stop: Optional[int] = None) -> Fields:
        self.flush()
        if self.rows is None:
            return {}
        stop = self.count if stop is None else stop
        views = self.layout.views(self.rows[..., start:stop, :])
        return views[0] if role == "keys" else views[1]

    def capacity_inputs(self) -> CapacityInputs:
        """The fields over the whole capacity, as compiled decode steps take them (`CapacityInputs`)."""
        self.flush()
        return _capacity_inputs(*(({}, {}) if self.rows is None else self.layout.views(self.rows)), self._per_row)

    def truncate(self, count: int):
        self.flush()
        self.count = min(count, self.count)

    def drop_front(self, count: int):
        """Forget the oldest `count` tokens (a sliding window's eviction)."""
        self.flush()
        count = min(count, self.count)
        if count:
            self.rows = _drop_front(self.rows, count, self.count, self.step)
            self.count -= count

    @property
    def nbytes(self) -> int:
        self.flush()
        return 0 if self.rows is None else self.rows.nbytes

    @property
    def used_nbytes(self) -> int:
        """The rows of stored tokens (the pending one included), not the spare capacity."""
        self.flush()
        return 0 if self.rows is None else self.rows.nbytes // self.rows.shape[2] * self.count

    def load(self, key_fields: Fields, value_fields: Fields, count: int):
        self.rows = _with_spare_capacity(self.layout.pack(key_fields, value_fields), self.step) if count else None
        self.count = count


class FieldStore:
    def __init__(self, key_format, value_format, encode: Callable[[mx.array, mx.array], Tuple[Fields, Fields]],
                 step: int = STEP):
        self.encode = encode
        self.formats = {"keys": key_format, "values": value_format}
        self.buffers: Dict[str, Fields] = {"keys": {}, "values": {}}
        self.count = 0
        self.pending = None  # never used: decode tokens of block formats wait in the window
        self.tokens_per_row: Dict[str, Dict[str, int]] = {
            role: {f.name: f.tokens_per_row for f in fmt.fields} for role, fmt in self.formats.items()}
        self._per_row = _sorted_per_row(self.tokens_per_row)
        self._block = max(fmt.token_block for fmt in self.formats.values())
        self.step = step
        self._capacity = 0  # `capacity`, kept up to date where the buffers change
        self._inputs: Optional[CapacityInputs] = None  # `capacity_inputs` while it is the buffers themselves

    @property
    def step(self) -> int:
        """Tokens each growth adds at least (a sliding window lowers it to its size)."""
        return self._step

    @step.setter
    def step(self, tokens: int):
        self._step = tokens
        # Per role and field: (tokens per row, growth step in rows), what every append reads.
        self._growth = {role: {name: (n, self._rows_step(n)) for name, n in per_row.items()}
                        for role, per_row in self.tokens_per_row.items()}

    def _rows_step(self, tokens_per_row: int) -> int:
        """A field's growth step in rows: at least `step` tokens (a step that is not a multiple of
        a block, as a sliding window's `max_size` may be, still grows every field as far)."""
        return -(-self.step // tokens_per_row)

    @property
    def capacity(self) -> int:
        """Tokens every field has room for, in whole blocks."""
        return self._capacity

    def _buffers_changed(self):
        per_row = self.tokens_per_row
        rows = [buf.shape[2] * per_row[role][name] for role, fields in self.buffers.items()
                for name, buf in fields.items()]
        self._capacity = min(rows) // self._block * self._block if rows else 0
        self._inputs = None

    def append(self, keys: mx.array, values: mx.array):
        count = keys.shape[2]
        grown = False
        for role, encoded in zip(("keys", "values"), self.encode(keys, values)):
            growth, buffers = self._growth[role], self.buffers[role]
            for name, field in encoded.items():
                per_row, step = growth[name]
                row = self.count // per_row
                stop = row + field.shape[2]
                buf = buffers.get(name)
                if buf is None or stop > buf.shape[2]:
                    buf = buffers[name] = grow(buf, stop, field, step)
                    grown = True
                buf[:, :, row:stop] = field
        self.count += count
        if grown:
            self._buffers_changed()

    def flush(self):
        pass

    def fields(self, role: str, start: int = 0, stop: Optional[int] = None) -> Fields:
        stop = self.count if stop is None else stop
        per_row = self.tokens_per_row[role]
        return {name: buf[..., start // per_row[name] : -(-stop // per_row[name]), :]
                for name, buf in self.buffers[role].items()}

    def capacity_inputs(self) -> CapacityInputs:
        """The fields over the whole capacity, as compiled decode steps take them (`CapacityInputs`): the
        buffers themselves where they hold no more, which appends write in place, so that these stay
        current until a buffer is replaced (`_buffers_changed`)."""
        if self._inputs is not None:
            return self._inputs
        capacity, per_row = self._capacity, self.tokens_per_row
        whole = True
        fields = ({}, {})
        for role, views in zip(("keys", "values"), fields):
            for name, buf in self.buffers[role].items():
                rows = -(-capacity // per_row[role][name])
                if rows == buf.shape[2]:
                    views[name] = buf
                else:
                    views[name], whole = buf[..., :rows, :], False
        inputs = _capacity_inputs(*fields, self._per_row)
        if whole:
            self._inputs = inputs
        return inputs

    def truncate(self, count: int):
        self.count = min(count, self.count)

    def drop_front(self, count: int):
        """Forget the oldest `count` tokens, a multiple of every field's tokens per row."""
        for role, fields in self.buffers.items():
            per_row = self.tokens_per_row[role]
            for name, buf in fields.items():
                if count % per_row[name]:
                    raise ValueError(f"cannot drop {count} tokens from {role}.{name} ({per_row[name]} per row)")
                fields[name] = _drop_front(buf, count // per_row[name], -(-self.count // per_row[name]),
                                           self._rows_step(per_row[name]))
        self.count -= count
        self._buffers_changed()

    @property
    def nbytes(self) -> int:
        return sum(buf.nbytes for role in self.buffers.values() for buf in role.values())

    @property
    def used_nbytes(self) -> int:
        """The rows that hold stored tokens (a started block counts whole), not the spare capacity."""
        per_row = self.tokens_per_row
        return sum(buf.nbytes // buf.shape[2] * -(-self.count // per_row[role][name])
                   for role, fields in self.buffers.items() for name, buf in fields.items())

    def load(self, key_fields: Fields, value_fields: Fields, count: int):
        per_row = self.tokens_per_row
        self.buffers = {role: {name: _with_spare_capacity(buf, self._rows_step(per_row[role][name]))
                               for name, buf in fields.items()}
                        for role, fields in (("keys", key_fields), ("values", value_fields))}
        self.count = count
        self._buffers_changed()


def row_layout(key_codec, value_codec) -> Optional[RowLayout]:
    """The rows of a `RowStore` where both formats are per token; None: a `FieldStore`.

    A row costs the fields' bits rounded up to a whole word: where the fp16 scalars fill an odd
    number of halves (polarquant, qjl, turboquant_prod), 16 bits per token more than one buffer
    per field (about 1.5% of a 4-bit cache of head dim 128). That buys one slice update and one
    kernel output per decode step instead of one per field, which a GPU's host pays for on every
    layer (docs/kernels.md)."""
    layout = RowLayout.of(key_codec.format, value_codec.format)
    bits = key_codec.format.bits_per_token + value_codec.format.bits_per_token
    if layout is not None and layout.words == -(-int(bits) // 32):
        return layout
    return None


def stored_bits_per_token(key_codec, value_codec) -> float:
    """Bits one token of both roles takes in the store `store_for` makes: a row's whole words, or
    the fields' bits."""
    layout = row_layout(key_codec, value_codec)
    if layout is not None:
        return 32.0 * layout.words
    return key_codec.format.bits_per_token + value_codec.format.bits_per_token


class _WeakMethod:
    """`owner.method`, callable, without a strong reference to `owner`. A store belongs to its cache and calls
    the cache's encoder: a strong reference back would make every cache a reference cycle, which only Python's
    cyclic collector frees, so a dropped cache would keep its MLX buffers (and, through a lazy slice, a batch's
    whole decode buffers) until a collection ran. A deep copy calls the copy of the owner (`memo`)."""

    def __init__(self, method):
        self._owner, self._name = weakref.ref(method.__self__), method.__name__

    def __call__(self, *args):
        return getattr(self._owner(), self._name)(*args)

    def __deepcopy__(self, memo):
        new = copy.copy(self)
        owner = self._owner()
        new._owner = weakref.ref(memo.get(id(owner), owner))
        return new


def store_for(key_codec, value_codec, encode, step: int = STEP):
    """A `RowStore` where the codecs' fields pack into rows (`encode` returns rows), else a `FieldStore`
    (`encode` returns (key fields, value fields)). A bound method is held weakly (`_WeakMethod`)."""
    if inspect.ismethod(encode):
        encode = _WeakMethod(encode)
    layout = row_layout(key_codec, value_codec)
    if layout is not None:
        return RowStore(layout, encode, step)
    return FieldStore(key_codec.format, value_codec.format, encode, step)
