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
    return {
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
    """Pack integer codes (..., n), each < 2**bits, into (..., ceil(n*bits/32)) uint32."""
    _check_bits(bits)
    if not mx.issubdtype(codes.dtype, mx.integer):
        raise ValueError(f"codes must have an integer dtype, got {codes.dtype}")
    *lead, n = codes.shape
    if n == 0:
        return mx.zeros((*lead, 0), dtype=mx.uint32)
    layout = _layout(bits)
    blocks = -(-n // _BLOCK)
    # Masking keeps the bit fields disjoint even for out-of-range input.
    codes = _pad_last(codes.astype(mx.uint32) & ((1 << bits) - 1), blocks * _BLOCK)
    codes = codes.reshape(*lead, blocks, _BLOCK)
    low = codes << layout["shift"]
    high = (codes >> 1) >> layout["complement"]
    words = []
    # Disjoint bit fields, so summing the parts of a word is OR-ing them.
    for (begin, end), carry in zip(layout["word_codes"], layout["carry_from"]):
        word = low[..., begin:end].sum(axis=-1)
        words.append(word if carry is None else word + high[..., carry])
    packed = mx.stack(words, axis=-1).reshape(*lead, blocks * bits)
    # Padding codes are 0, so the dropped trailing words are all zero.
    return packed[..., : packed_words(n, bits)]


def unpack(words: mx.array, bits: int, n: int) -> mx.array:
    """Unpack (..., ceil(n*bits/32)) uint32 words into (..., n) uint8 codes."""
    _check_bits(bits)
    expected = packed_words(n, bits)
    if words.shape[-1] != expected:
        raise ValueError(f"{n} codes of {bits} bits need {expected} words, got {words.shape[-1]}")
    *lead, _ = words.shape
    if n == 0:
        return mx.zeros((*lead, 0), dtype=mx.uint8)
    layout = _layout(bits)
    blocks = -(-n // _BLOCK)
    words = _pad_last(words.astype(mx.uint32), blocks * bits).reshape(*lead, blocks, bits)
    following = _pad_last(words[..., 1:], bits)
    # (..., blocks, bits, width): every code, grouped by the word it starts in.
    grouped = (words[..., None] >> layout["group_shift"]) | (
        (following[..., None] << 1) << layout["group_complement"]
    )
    grouped = (grouped & ((1 << bits) - 1)).astype(mx.uint8)
    counts = layout["counts"]
    if min(counts) == max(counts):
        codes = grouped
    else:
        codes = mx.concatenate([grouped[..., w, :c] for w, c in enumerate(counts)], axis=-1)
    return codes.reshape(*lead, blocks * _BLOCK)[..., :n]
