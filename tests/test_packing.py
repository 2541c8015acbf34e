import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from veloxquant_mlx import packing
from veloxquant_mlx.packing import pack, packed_words, unpack

LENGTHS = [1, 7, 31, 32, 33, 80, 100, 127, 128, 129]


def reference_pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Bit-by-bit little-endian bitstream, the layout pack() promises."""
    stream = ((codes[..., None].astype(np.uint64) >> np.arange(bits, dtype=np.uint64)) & 1)
    stream = stream.reshape(*codes.shape[:-1], -1)
    words = packed_words(codes.shape[-1], bits)
    stream = np.concatenate(
        [stream, np.zeros((*codes.shape[:-1], words * 32 - stream.shape[-1]), np.uint64)], axis=-1
    ).reshape(*codes.shape[:-1], words, 32)
    return (stream << np.arange(32, dtype=np.uint64)).sum(-1).astype(np.uint32)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", LENGTHS)
def test_round_trip_and_layout(bits, n):
    rng = np.random.default_rng(bits * 1000 + n)
    codes = rng.integers(0, 1 << bits, size=(2, 3, n), dtype=np.uint8)
    words = pack(mx.array(codes), bits)
    assert words.dtype == mx.uint32
    assert words.shape == (2, 3, math.ceil(n * bits / 32))
    np.testing.assert_array_equal(np.array(words), reference_pack(codes, bits))
    unpacked = unpack(words, bits, n)
    assert unpacked.dtype == mx.uint8 and unpacked.shape == codes.shape
    np.testing.assert_array_equal(np.array(unpacked), codes)


@settings(deadline=None, max_examples=150)
@given(
    bits=st.integers(1, 8),
    lead=st.lists(st.integers(1, 3), max_size=3),
    n=st.integers(0, 300),
    seed=st.integers(0, 2**32 - 1),
)
def test_round_trip_property(bits, lead, n, seed):
    codes = np.random.default_rng(seed).integers(0, 1 << bits, size=(*lead, n), dtype=np.uint8)
    words = pack(mx.array(codes), bits)
    assert words.shape == (*lead, packed_words(n, bits))
    np.testing.assert_array_equal(np.array(unpack(words, bits, n)), codes)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [0, 1, 10, 11, 32, 33, 100, 4096])
def test_packed_words_is_dense(bits, n):
    assert packed_words(n, bits) == math.ceil(n * bits / 32)


def test_known_three_bit_pattern():
    codes = mx.array([(i + 1) % 8 for i in range(32)], dtype=mx.uint8)  # 1,2,...,7,0,1,...
    # Code i sits at bits [3i, 3i+3): word 0 = 1 | 2<<3 | 3<<6 | ... | 3<<30.
    assert np.array(pack(codes, 3)).tolist() == [0xD11F58D1, 0x58D11F58, 0x1F58D11F]


def test_straddling_code_spans_two_words():
    # 11 three-bit codes = 33 bits; code 10 covers bits 30, 31 and 32.
    words = pack(mx.full((11,), 7, dtype=mx.uint8), 3)
    assert np.array(words).tolist() == [0xFFFFFFFF, 0x1]
    words = pack(mx.array([0] * 10 + [4], dtype=mx.uint8), 3)
    assert np.array(words).tolist() == [0x0, 0x1]


def test_byte_and_bit_layouts_are_little_endian():
    assert np.array(pack(mx.array([1, 2, 3, 4], dtype=mx.uint8), 8)).tolist() == [0x04030201]
    assert np.array(pack(mx.array([1] + [0] * 30 + [1], dtype=mx.uint8), 1)).tolist() == [0x80000001]


@pytest.mark.parametrize("dtype", [mx.uint8, mx.uint16, mx.uint32, mx.int32, mx.int64])
def test_accepts_integer_dtypes(dtype):
    codes = mx.array([5, 0, 7, 3, 1], dtype=dtype)
    np.testing.assert_array_equal(np.array(unpack(pack(codes, 3), 3, 5)), [5, 0, 7, 3, 1])


def test_empty():
    words = pack(mx.zeros((2, 0), dtype=mx.uint8), 4)
    assert words.shape == (2, 0)
    assert unpack(words, 4, 0).shape == (2, 0)


@pytest.mark.parametrize("bits", [0, 9, -1, 2.0, True])
def test_bad_bits(bits):
    with pytest.raises(ValueError):
        pack(mx.zeros((4,), dtype=mx.uint8), bits)
    with pytest.raises(ValueError):
        unpack(mx.zeros((1,), dtype=mx.uint32), bits, 4)
    with pytest.raises(ValueError):
        packed_words(4, bits)


def test_bad_inputs():
    with pytest.raises(ValueError):
        pack(mx.zeros((4,), dtype=mx.float32), 3)
    with pytest.raises(ValueError):
        unpack(mx.zeros((3,), dtype=mx.uint32), 3, 10)  # 10 codes of 3 bits need 1 word


@pytest.mark.parametrize("bits", [3, 5, 6, 7])
@pytest.mark.parametrize("n", [1, 31, 64, 100, 257])
def test_gpu_forms_of_pack_and_unpack_equal_the_cpu_forms(bits, n):
    # On a GPU, codes that straddle words are packed by masked sums and unpacked by selects (one
    # fused kernel each); on the CPU by per-word sums and a concatenation. Both forms, on the CPU.
    codes = mx.array(np.random.default_rng(bits * 1000 + n).integers(0, 1 << bits, (2, 3, n)).astype(np.uint32))
    words = pack(codes, bits)
    layout, blocks = packing._layout(bits), -(-n // 32)
    padded = packing._pad_last(codes, blocks * 32).reshape(2, 3, blocks, 32)
    by_masks = packing._pack_by_masks(padded, layout).reshape(2, 3, blocks * bits)[..., : words.shape[-1]]
    assert mx.array_equal(by_masks, words)
    by_selects = packing._unpack_by_selects(packing._pad_last(words, blocks * bits).reshape(2, 3, blocks, bits),
                                            bits, layout)[..., :n]
    assert mx.array_equal(by_selects, codes.astype(mx.uint8))
