"""Validation at the door: config, builder, update_and_fetch, trim, attend; the non-finite policy."""

import copy

import mlx.core as mx
import pytest
from conftest import ALL_METHODS, config_for

from veloxquant_mlx import CompressedKVCache, KVCacheBuilder, KVCacheConfig
from veloxquant_mlx.cache import CacheInputError
from veloxquant_mlx.settings import EngineSettings


def kv(tokens, heads=2, dim=32, batch=1, seed=0, dtype=mx.float16):
    mx.random.seed(seed)
    return (mx.random.normal((batch, heads, tokens, dim)).astype(dtype),
            mx.random.normal((batch, heads, tokens, dim)).astype(dtype))


# ---- config and builder ----------------------------------------------------------------------

def test_replace_bits_moves_the_value_width_too():
    """Regression: replace(bits=2) kept the old value width (K2/V4)."""
    config = KVCacheConfig(bits=4)
    assert config.replace(bits=2).value_bits == 2
    assert config.replace(bits=2, value_bits=4).value_bits == 4
    assert KVCacheConfig(bits=4, value_bits=8).replace(bits=2).value_bits == 8  # differing widths stay


def test_builder_bit_width_moves_the_value_width_too():
    """Regression: with_bit_width(inlier=2) on a K4/V4 config built K2/V4."""
    config = KVCacheBuilder(KVCacheConfig(bits=4)).with_bit_width(inlier=2).config()
    assert (config.bits, config.value_bits) == (2, 2)
    config = KVCacheBuilder(KVCacheConfig(bits=4)).with_bit_width(inlier=2, values=3).config()
    assert (config.bits, config.value_bits) == (2, 3)
    assert KVCacheBuilder(KVCacheConfig(bits=4), bits=3).config().value_bits == 3


@pytest.mark.parametrize("seed", [-1, 2**63])
def test_bad_seed_is_refused_at_construction(seed):
    """Regression: seed=-1 was accepted and failed only at first use."""
    with pytest.raises(ValueError, match="seed must be in"):
        KVCacheConfig(seed=seed)


@pytest.mark.parametrize("options", [None, "renorm", ["renorm"], {1: True}])
def test_bad_options_are_named(options):
    """Regression: options=None or 'renorm' raised raw Python errors."""
    with pytest.raises(TypeError, match="option"):
        KVCacheConfig(options=options)


def test_describe_tells_seed_and_group_size_apart():
    base = KVCacheConfig(method="kivi", bits=2)
    assert len({base.describe(), base.replace(seed=3).describe(), base.replace(group_size=32).describe()}) == 3
    assert "seed=3" in base.replace(seed=3).describe() and "group=32" in base.replace(group_size=32).describe()


def test_builder_refuses_bad_arguments():
    with pytest.raises(TypeError, match="KVCacheConfig"):
        KVCacheBuilder({"bits": 4})
    with pytest.raises(ValueError, match="head_dim"):
        KVCacheBuilder().with_head_dim(0)
    with pytest.raises(TypeError, match="mlx-lm model"):
        KVCacheBuilder().for_model(object())
    with pytest.raises(TypeError, match="option"):
        KVCacheBuilder(options=None).config()


# ---- update_and_fetch, trim, attend ----------------------------------------------------------

@pytest.mark.parametrize("change", ["head_dim", "kv_heads", "batch", "value_dim"])
def test_shape_change_between_calls_is_named(change):
    """Regression: a head dim or KV head change crashed deep inside (rotations.py, cache.py)."""
    cache = CompressedKVCache(config_for("turboquant_mse", 4))
    cache.update_and_fetch(*kv(8))
    k, v = kv(1, heads=3 if change == "kv_heads" else 2, dim=16 if change == "head_dim" else 32,
              batch=2 if change == "batch" else 1)
    if change == "value_dim":
        v = v[..., :16]
    with pytest.raises(CacheInputError, match="since its first update"):
        cache.update_and_fetch(k, v)
    assert cache.offset == 8


def test_malformed_updates_are_named():
    cache = CompressedKVCache(config_for("turboquant_mse", 4))
    k, v = kv(4)
    with pytest.raises(CacheInputError, match="batch, kv_heads, tokens, head_dim"):
        cache.update_and_fetch(k[0], v[0])
    with pytest.raises(CacheInputError, match="same first"):
        cache.update_and_fetch(k, v[..., :3, :])
    with pytest.raises(CacheInputError, match="floating point or integers"):
        cache.update_and_fetch(k.astype(mx.complex64), v.astype(mx.complex64))
    with pytest.raises(TypeError, match="mx.array"):
        cache.update_and_fetch([[1.0]], v)


@pytest.mark.parametrize("window", [0, 4])
def test_negative_trim_is_refused(window):
    """Regression: trim(-5) raised a TypeError without a window and grew the offset with one."""
    cache = CompressedKVCache(config_for("turboquant_mse", 4, residual_length=window))
    cache.update_and_fetch(*kv(10))
    for bad in (-5, 1.5, True):
        with pytest.raises(CacheInputError, match="trim takes"):
            cache.trim(bad)
    assert cache.offset == 10 and cache.trim(3) == 3 and cache.offset == 7


def test_zero_length_query_and_bad_queries():
    """Regression: a zero-length query crashed in attention.py."""
    cache = CompressedKVCache(config_for("turboquant_mse", 4))
    with pytest.raises(CacheInputError, match="holds no tokens"):
        cache.attend(mx.zeros((1, 4, 1, 32)), scale=1.0)
    cache.update_and_fetch(*kv(10))
    out = cache.attend(mx.zeros((1, 4, 0, 32)), scale=1.0, mask="causal")
    assert out.shape == (1, 4, 0, 32)
    for shape in ((1, 3, 1, 32), (1, 4, 1, 16), (2, 4, 1, 32), (4, 1, 32)):
        with pytest.raises(CacheInputError, match="queries"):
            cache.attend(mx.zeros(shape), scale=1.0)


# ---- non-finite and overflowing inputs ---------------------------------------------------------

@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e5])
def test_non_finite_or_overflowing_chunks_are_refused(bad):
    """Regression: a NaN in the chunk that sets the means made them NaN for good; fp32 values
    above 65504 became Inf in the fp16 window and scales."""
    cache = CompressedKVCache(config_for("turboquant_mse", 4, center=True))
    k, v = kv(16, dtype=mx.float32)
    k[0, 0, 3, 5] = bad
    with pytest.raises(CacheInputError, match="NaN, Inf or a vector whose norm exceeds"):
        cache.update_and_fetch(k, v)
    assert cache.offset == 0
    cache.update_and_fetch(*kv(16, dtype=mx.float32))  # a healthy chunk is taken afterwards
    assert cache.offset == 16


@pytest.mark.parametrize("method", ["turboquant_mse", "kivi", "polarquant"])
def test_trimming_a_bad_token_heals_the_cache(method):
    """With the check off (or on a decode step), a NaN token spoils only itself: trimming it
    leaves finite outputs, centering means and KIVI key groups included."""
    settings = EngineSettings.resolve(check_inputs="off")
    config = config_for(method, 4, center=True, group_size=8)
    cache = CompressedKVCache(config, settings=settings)
    k, v = kv(16)
    k[0, 1, 15, 2] = float("nan")  # in the chunk that sets the means and the last key group
    v[0, 0, 15, 0] = float("inf")
    cache.update_and_fetch(k, v)
    assert cache.trim(1) == 1
    finite = 0
    for step in range(20):
        nk, nv = kv(1, seed=100 + step)
        cache.update_and_fetch(nk, nv)
        out = cache.attend(mx.random.normal((1, 4, 1, 32)), scale=32**-0.5)
        finite += bool(mx.all(mx.isfinite(out)).item())
    assert finite == 20
    reference = CompressedKVCache(config, settings=settings)
    reference.update_and_fetch(k[..., :15, :], v[..., :15, :])
    assert reference.key_mean is not None and bool(mx.all(mx.isfinite(reference.key_mean)).item())


def test_decode_steps_are_checked_with_always():
    cache = CompressedKVCache(config_for("kivi", 4), settings=EngineSettings.resolve(check_inputs="always"))
    cache.update_and_fetch(*kv(4))
    k, v = kv(1)
    k[0, 0, 0, 0] = float("nan")
    with pytest.raises(CacheInputError):
        cache.update_and_fetch(k, v)
    with pytest.raises(ValueError, match="check_inputs"):
        EngineSettings.resolve(check_inputs="sometimes")


def test_bf16_and_fp16_inputs_keep_their_window_dtype():
    for dtype in (mx.float16, mx.bfloat16):
        cache = CompressedKVCache(config_for("turboquant_mse", 4, residual_length=8))
        cache.update_and_fetch(*kv(4, dtype=dtype))
        assert cache.window_keys.dtype == dtype


@pytest.mark.parametrize("method", ALL_METHODS)
def test_deepcopy_after_validation_still_independent(method):
    cache = CompressedKVCache(config_for(method, 4))
    cache.update_and_fetch(*kv(40))
    twin = copy.deepcopy(cache)
    twin.update_and_fetch(*kv(1, seed=3))
    assert twin.offset == 41 and cache.offset == 40
    with pytest.raises(CacheInputError):
        twin.update_and_fetch(*kv(1, dim=16))


def test_default_check_covers_every_prefill_chunk(monkeypatch):
    """The default ("prefill") checks every chunk of more than one token, not only the one that sets the
    means; "first" checks that one only."""
    monkeypatch.delenv("VELOXQUANT_CHECK_INPUTS", raising=False)
    assert EngineSettings.resolve().check_inputs == "prefill"
    for check, refused in (("first", False), ("prefill", True)):
        cache = CompressedKVCache(config_for("turboquant_mse", 4), settings=EngineSettings.resolve(check_inputs=check))
        cache.update_and_fetch(*kv(16))
        k, v = kv(8, seed=3)
        k[0, 0, 2, 1] = float("nan")
        if refused:
            with pytest.raises(CacheInputError):
                cache.update_and_fetch(k, v)
            assert cache.offset == 16
        else:
            cache.update_and_fetch(k, v)
            assert cache.offset == 24
