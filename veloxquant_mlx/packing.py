"""Dense bit packing of b-bit codes into uint32 words (b = 1..8).

Code i occupies bits [i*b, (i+1)*b) of one little-endian bitstream, so n codes
take exactly ceil(n*b/32) words and codes straddle words when 32 % b != 0.
Every 32 codes fill exactly b words, so both directions work on blocks of 32
codes with small constant index tables: no per-element Python work.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import numpy as np

MAX_BITS = 8
_BLOCK = 32  # codes per block; a block is exactly `bits` words


def _check_bits(bits: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= MAX_BITS:
        raise ValueError(f"bits must be an integer in 1..{MAX_BITS}, got {bits!r}")


def packed_words(n: int, bits: int) -> int:
    """Number of uint32 words holding n codes of `bits` bits."""
    _check_bits(bits)
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}")
    return -(-n * bits // 32)


@lru_cache(maxsize=None)
def _layout(bits: int) -> dict:
    """Constant tables for one block of 32 codes (= `bits` words).

    Code j starts at bit j*bits: in word j*bits // 32, at shift s = j*bits % 32.
    Its low part (code << s) belongs to that word; if s + bits > 32 it straddles
    and its high part (code >> (32 - s)) belongs to the next word.
    """
    start = np.arange(_BLOCK) * bits
    word, shift = start // 32, start % 32
    straddles = shift + bits > 32
    counts = np.bincount(word, minlength=bits)  # codes starting in each word
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    # Codes grouped by starting word, padded to `width` per word (pads: shift 0).
    width = int(counts.max())
    group_shift = np.zeros((bits, width), np.uint32)
    group_complement = np.full((bits, width), 31, np.uint32)  # 31: contributes 0
    for w in range(bits):
        js = np.arange(first[w], first[w] + counts[w])
        group_shift[w, : counts[w]] = shift[js]
        group_complement[w, : counts[w]] = np.where(straddles[js], 31 - shift[js], 31)
    # x >> (32 - s) and x << (32 - s) are written as a shift by 1 and then by
    # 31 - s, so that s = 0 gives 0 rather than an undefined shift by 32.
    in_word = np.arange(bits)[:, None]
    ends_in_word = straddles[None] & (word[None] + 1 == in_word)  # a straddling code's high part
    return {
        "starts_in_word": mx.array(word[None] == in_word),
        "shift_in_word": mx.array(np.where(word[None] == in_word, shift[None], 0).astype(np.uint32)),
        "ends_in_word": mx.array(ends_in_word),
        "complement_in_word": mx.array(np.where(ends_in_word, 31 - shift[None], 0).astype(np.uint32)),
        "starts_at": [mx.array(word == k) for k in range(bits)],
        "straddle_complement": mx.array(np.where(straddles, 31 - shift, 31).astype(np.uint32)),
        "shift": mx.array(shift.astype(np.uint32)),
        "complement": mx.array((31 - shift).astype(np.uint32)),
        "word_codes": [(int(a), int(a + c)) for a, c in zip(first, counts)],
        "carry_from": [int(a - 1) if a > 0 and straddles[a - 1] else None for a in first],
        "counts": [int(c) for c in counts],
        "group_shift": mx.array(group_shift),
        "group_complement": mx.array(group_complement),
    }


def _pad_last(x: mx.array, size: int) -> mx.array:
    if x.shape[-1] == size:
        return x
    return mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])])


def pack(codes: mx.array, bits: int) -> mx.array:
    """Pack integer codes (..., n), each < 2**bits, into (..., ceil(n*bits/32)) uint32.

    Written as a broadcast and one sum over each word's codes (the fields are disjoint, so
    summing is OR-ing): a handful of launches on a GPU, where a decode step packs one token."""
    _check_bits(bits)
    if not mx.issubdtype(codes.dtype, mx.integer):
        raise ValueError(f"codes must have an integer dtype, got {codes.dtype}")
    *lead, n = codes.shape
    if n == 0:
        return mx.zeros((*lead, 0), dtype=mx.uint32)
    # Masking keeps the bit fields disjoint even for out-of-range input.
    codes = codes.astype(mx.uint32) & ((1 << bits) - 1)
    if 32 % bits == 0:  # no code straddles two words
        per_word = 32 // bits
        words = -(-n // per_word)
        codes = _pad_last(codes, words * per_word).reshape(*lead, words, per_word)
        return (codes << _word_shifts(bits)).sum(axis=-1).astype(mx.uint32)
    layout = _layout(bits)
    blocks = -(-n // _BLOCK)
    codes = _pad_last(codes, blocks * _BLOCK).reshape(*lead, blocks, _BLOCK)
    if mx.default_device() == mx.gpu:
        packed = _pack_by_masks(codes, layout).reshape(*lead, blocks * bits)
    else:
        low = codes << layout["shift"]
        high = (codes >> 1) >> layout["complement"]
        words = []
        for (begin, end), carry in zip(layout["word_codes"], layout["carry_from"]):
            word = low[..., begin:end].sum(axis=-1)
            words.append(word if carry is None else word + high[..., carry])
        packed = mx.stack(words, axis=-1).reshape(*lead, blocks * bits)
    # Padding codes are 0, so the dropped trailing words are all zero.
    return packed[..., : packed_words(n, bits)]


def _pack_by_masks(codes: mx.array, layout: dict) -> mx.array:
    """(..., blocks, 32) codes -> (..., blocks, bits) words: every code's part of every word of
    its block (zero where it has none), summed per word. Two launches on a GPU; on the CPU the
    per-word sums of `pack` are faster."""
    parts = codes[..., None, :]  # against the block's words
    low = mx.where(layout["starts_in_word"], parts << layout["shift_in_word"], 0)
    high = mx.where(layout["ends_in_word"], (parts >> 1) >> layout["complement_in_word"], 0)
    return (low + high).sum(axis=-1).astype(mx.uint32)


def unpack(words: mx.array, bits: int, n: int) -> mx.array:
    """Unpack (..., ceil(n*bits/32)) uint32 words into (..., n) uint8 codes.

    Only broadcasting elementwise ops where it pays: `mx.compile` fuses them into one
    kernel on a GPU, where slices, pads and concatenations would each be a copy."""
    _check_bits(bits)
    expected = packed_words(n, bits)
    if words.shape[-1] != expected:
        raise ValueError(f"{n} codes of {bits} bits need {expected} words, got {words.shape[-1]}")
    *lead, count = words.shape
    if n == 0:
        return mx.zeros((*lead, 0), dtype=mx.uint8)
    words = words.astype(mx.uint32)
    mask = (1 << bits) - 1
    if 32 % bits == 0:  # no code straddles two words
        per_word = 32 // bits
        codes = (words[..., None] >> _word_shifts(bits)) & mask
        return codes.astype(mx.uint8).reshape(*lead, count * per_word)[..., :n]
    layout = _layout(bits)
    blocks = -(-n // _BLOCK)
    words = _pad_last(words, blocks * bits).reshape(*lead, blocks, bits)
    if mx.default_device() == mx.gpu:
        return _unpack_by_selects(words, bits, layout)[..., :n]
    following = _pad_last(words[..., 1:], bits)
    # (..., blocks, bits, width): every code, grouped by the word it starts in.
    grouped = (words[..., None] >> layout["group_shift"]) | (
        (following[..., None] << 1) << layout["group_complement"]
    )
    grouped = (grouped & mask).astype(mx.uint8)
    codes = mx.concatenate([grouped[..., w, :c] for w, c in enumerate(layout["counts"])], axis=-1)
    return codes.reshape(*lead, blocks * _BLOCK)[..., :n]


def _unpack_by_selects(words: mx.array, bits: int, layout: dict) -> mx.array:
    """(..., blocks, bits) words -> (..., blocks * 32) codes: each code's word and the next
    one picked by broadcast selects, so the whole unpack is one fused elementwise kernel (the
    grouped form's concatenation is a copy per word; on the CPU it is the faster one)."""
    *lead, blocks, _ = words.shape
    words = words[..., None]  # (..., blocks, bits, 1) against the block's 32 codes
    starts_at = layout["starts_at"]
    low, high = words[..., 0, :], words[..., 1, :]
    for k in range(1, bits):
        low = mx.where(starts_at[k], words[..., k, :], low)
        if k + 1 < bits:
            high = mx.where(starts_at[k], words[..., k + 1, :], high)
    codes = (low >> layout["shift"]) | ((high << 1) << layout["straddle_complement"])
    return (codes & ((1 << bits) - 1)).astype(mx.uint8).reshape(*lead, blocks * _BLOCK)


@lru_cache(maxsize=None)
def _word_shifts(bits: int) -> mx.array:
    return mx.array(np.arange(32 // bits, dtype=np.uint32) * bits)
