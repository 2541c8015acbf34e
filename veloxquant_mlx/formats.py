"""Storage formats as data: what a codec stores per token, declared once.

A codec's `format` is a frozen `Format`: its fields (packed b-bit codes or fp16
scalars, per token or per block of tokens), its token block and the name of the
kernel family that can decode it in place. This is ggml's `type_traits` idea
(block size, to_float, from_float, vec_dot per type): the codec holds the maths
(encode = from_float, decode = to_float, `to_domain` for the score), the format
holds the layout, and every consumer reads the layout from here:

* `RowLayout` puts both roles' per-token fields side by side in one uint32 row
  (`storage.RowStore`), so a decode step stores a token with one slice update;
* the kernels take their word offsets from the `RowLayout`;
* `nbytes` budgets and `Codec.bits_per_token` are `Format.bits_per_token`;
* saved caches record `tokens_per_row` from the fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
from typing import Dict, Optional, Tuple

import mlx.core as mx

from .packing import packed_words

Fields = Dict[str, mx.array]

PACKED, FLOAT16 = "packed", "float16"


def _cached_hash(self) -> int:
    """The dataclass's hash of its fields, computed once: formats and row layouts key the kernels'
    caches, which a decode step looks up for every layer (a nested format hashes about 30 objects)."""
    h = self.__dict__.get("_hash")
    if h is None:
        h = hash(tuple(getattr(self, f.name) for f in dataclass_fields(self)))
        object.__setattr__(self, "_hash", h)
    return h


def _state_without_hash(self) -> dict:
    """Pickled state: the fields only (a string's hash differs between processes)."""
    return {k: v for k, v in self.__dict__.items() if k != "_hash"}


@dataclass(frozen=True)
class Field:
    """One stored array of a format. `width` elements per row: codes of `bits` bits
    (PACKED, dense little-endian in uint32 words, `packing.py`) or fp16 scalars
    (FLOAT16). A row holds one token, or `tokens_per_row` tokens (per-group scales)."""

    name: str
    kind: str
    width: int
    bits: int = 16
    tokens_per_row: int = 1

    def __post_init__(self):
        if self.kind not in (PACKED, FLOAT16):
            raise ValueError(f"field kind must be {PACKED!r} or {FLOAT16!r}, got {self.kind!r}")
        if self.kind == FLOAT16 and self.bits != 16:
            raise ValueError(f"a float16 field has 16 bits per element, got {self.bits}")

    @property
    def words(self) -> int:
        """uint32 words of one row stored on its own."""
        return packed_words(self.width, self.bits) if self.kind == PACKED else -(-self.width // 2)

    @property
    def bits_per_token(self) -> float:
        """Packed codes take whole words; fp16 scalars 16 bits each (`RowLayout` shares words)."""
        bits = 32.0 * self.words if self.kind == PACKED else 16.0 * self.width
        return bits / self.tokens_per_row


def packed(name: str, width: int, bits: int, tokens_per_row: int = 1) -> Field:
    return Field(name, PACKED, width, bits, tokens_per_row)


def fp16(name: str, width: int = 1, tokens_per_row: int = 1) -> Field:
    return Field(name, FLOAT16, width, 16, tokens_per_row)


@dataclass(frozen=True)
class Format:
    """What one codec stores. `kernel` names the kernel family that decodes it in place
    (e.g. "mse": `kernels/`), with its constants in `kernel_params`; None: no kernel,
    the engine's compiled MLX-ops paths decode it with the codec. `orthogonal_domain`:
    `to_domain` is an orthogonal map of the head vector (rotations, identity), so fp16
    vectors mapped into the domain score and sum exactly as in the original space.
    `separate_buffers`: keep one buffer per field even for a per-token format (no `RowLayout`),
    for codecs whose attention hands the fields to an MLX op that reads them contiguous."""

    name: str
    dim: int
    domain_dim: int
    fields: Tuple[Field, ...]
    token_block: int = 1
    kernel: Optional[str] = None
    kernel_params: Tuple[Tuple[str, object], ...] = ()
    orthogonal_domain: bool = True
    separate_buffers: bool = False

    __hash__ = _cached_hash
    __getstate__ = _state_without_hash

    @property
    def bits_per_token(self) -> float:
        return sum(f.bits_per_token for f in self.fields)

    @property
    def per_token(self) -> bool:
        return all(f.tokens_per_row == 1 for f in self.fields)

    def field(self, name: str) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"format {self.name} has no field {name!r}")

    def param(self, name: str):
        return dict(self.kernel_params)[name]


@dataclass(frozen=True)
class Slot:
    role: str
    field: Field
    start: int  # first word (PACKED) or first half-word (FLOAT16) of the row


@dataclass(frozen=True)
class RowLayout:
    """One uint32 row per token holding every field of both roles:

        packed key fields | packed value fields | fp16 scalars of keys then values (halves)

    The fp16 scalars share words (turboquant_mse: key norm in the low half, value norm in
    the high half of one word), so the row costs no bit over the fields on their own beyond
    rounding the halves up to a whole word. Only for per-token formats (`of` gives None else)."""

    key: Format
    value: Format
    slots: Tuple[Slot, ...] = field(init=False)
    words: int = field(init=False)

    __hash__ = _cached_hash
    __getstate__ = _state_without_hash

    def __post_init__(self):
        slots, word = [], 0
        for role, fmt in (("keys", self.key), ("values", self.value)):
            for f in fmt.fields:
                if f.kind == PACKED:
                    slots.append(Slot(role, f, word))
                    word += f.words
        half = 2 * word
        for role, fmt in (("keys", self.key), ("values", self.value)):
            for f in fmt.fields:
                if f.kind == FLOAT16:
                    slots.append(Slot(role, f, half))
                    half += f.width
        object.__setattr__(self, "slots", tuple(slots))
        object.__setattr__(self, "words", -(-half // 2))

    @classmethod
    def of(cls, key: Format, value: Format) -> Optional["RowLayout"]:
        whole_rows = key.per_token and value.per_token and not (key.separate_buffers or value.separate_buffers)
        return cls(key, value) if whole_rows else None

    def slot(self, role: str, name: str) -> Slot:
        for s in self.slots:
            if s.role == role and s.field.name == name:
                return s
        raise KeyError(f"no field {name!r} for {role}")

    @property
    def fp16_start(self) -> int:
        """The first word holding fp16 scalars."""
        return sum(s.field.words for s in self.slots if s.field.kind == PACKED)

    def pack(self, key_fields: Fields, value_fields: Fields) -> mx.array:
        """The codecs' fields (..., n, width) -> rows (..., n, words)."""
        fields = {"keys": key_fields, "values": value_fields}
        words = [fields[s.role][s.field.name] for s in self.slots if s.field.kind == PACKED]
        halves = [fields[s.role][s.field.name].astype(mx.float16) for s in self.slots if s.field.kind == FLOAT16]
        if halves:
            halves = mx.concatenate(halves, axis=-1)
            if halves.shape[-1] % 2:
                halves = mx.concatenate([halves, mx.zeros((*halves.shape[:-1], 1), mx.float16)], axis=-1)
            words.append(halves.view(mx.uint32))
        return mx.concatenate(words, axis=-1)

    def views(self, rows: mx.array) -> Tuple[Fields, Fields]:
        """(key fields, value fields) of `rows`, as the codecs' `encode` returns them."""
        out: Dict[str, Fields] = {"keys": {}, "values": {}}
        first = self.fp16_start
        halves = rows[..., first:].view(mx.float16) if first < self.words else None
        for s in self.slots:
            if s.field.kind == PACKED:
                out[s.role][s.field.name] = rows[..., s.start : s.start + s.field.words]
            else:
                a = s.start - 2 * first
                out[s.role][s.field.name] = halves[..., a : a + s.field.width]
        return out["keys"], out["values"]
