"""The rest of mlx-lm's cache contract on the library's caches: `to_quantized` (mlx-lm's --kv-bits),
`keys_and_values` (KV-sharing layers), `keys`/`values` and `mx.array(history)` (decoded copies), a batch's
padding columns, head dims the codes cannot take, models with no attention layer, and
the non-finite policy (`settings.check_inputs`)."""

import math

import mlx.core as mx
import pytest
from mlx_lm.generate import maybe_quantize_kv_cache
from mlx_lm.models import mamba2

from conftest import config_for
from veloxquant_mlx import CompressedKVCache, CompressedRotatingKVCache, EngineSettings, KVCacheBuilder, KVCacheConfig
from veloxquant_mlx.cache import CacheInputError, CompressedHistory
from veloxquant_mlx.integration import scaled_dot_product_attention


def kv(n, heads=2, dim=32, seed=0):
    key = mx.random.key(seed)
    return tuple(mx.random.normal((1, heads, n, dim), key=k).astype(mx.float16) for k in mx.random.split(key, 2))


@pytest.mark.parametrize("bits,preset", [(4, "vq4"), (3, "vq3"), (2, "vq2"), (8, None)])
def test_to_quantized_converts_into_the_nearest_config(bits, preset):
    """mlx-lm's --kv-bits replaces each cache with `to_quantized(...)`: a cache of the nearest config holding the
    same tokens (its fp16 ones exactly, the rest within the two codes' error), or the cache itself."""
    cache = CompressedKVCache(config_for("fp16"))
    keys, values = kv(80)
    cache.update_and_fetch(keys, values)
    caches = [cache]
    maybe_quantize_kv_cache(caches, quantized_kv_start=0, kv_group_size=64, kv_bits=bits)
    converted = caches[0]
    target = KVCacheConfig.preset(preset) if preset else KVCacheConfig.preset("vq4", bits=8, value_bits=8)
    assert converted is not cache and converted.config.same_encoding(target)
    assert converted.offset == 80 and converted.encoded == 80 - target.sink_tokens - target.residual_length
    got, _ = converted.dequantized()
    assert mx.array_equal(got[..., -target.residual_length:, :].astype(mx.float16),
                          keys[..., -target.residual_length:, :]).item()
    error = float(mx.sqrt(mx.mean(mx.square(got - keys.astype(mx.float32)))))
    assert error < {2: 0.6, 3: 0.35, 4: 0.2, 8: 0.02}[bits], error
    assert converted.to_quantized(group_size=64, bits=bits) is converted  # already that config


def test_to_quantized_refuses_widths_it_has_no_config_for_and_converts_sliding_windows():
    cache = CompressedKVCache(config_for("turboquant_mse", 4))
    cache.update_and_fetch(*kv(8))
    for bits in (1, 9, 4.0):
        with pytest.raises(CacheInputError, match="2 to 8 bits"):
            cache.to_quantized(bits=bits)
    rotating = CompressedRotatingKVCache(config_for("fp16"), max_size=64, keep=4)
    keys, values = kv(100)
    rotating.update_and_fetch(keys, values)
    converted = rotating.to_quantized(bits=4)
    assert converted.config.same_encoding(KVCacheConfig.preset("vq4"))
    assert (converted.offset, converted.size(), converted.max_size, converted.keep) == (100, 64, 64, 4)
    assert converted.dequantized()[0].shape == rotating.dequantized()[0].shape


def test_keys_and_values_is_the_history_attention_reads(model):
    """gemma3n's KV-shared layers and afm7's KV-reuse layers read another layer's `keys_and_values()` and hand
    it to mlx-lm's attention: the hook attends over that cache."""
    caches = KVCacheBuilder(config_for("turboquant_mse", 4, residual_length=8)).for_model(model).build()
    model(mx.array([list(range(1, 41))]), cache=caches)
    keys, values = caches[1].keys_and_values()
    assert isinstance(keys, CompressedHistory) and keys.cache is caches[1] and keys.shape == (1, 2, 40, 32)
    queries = mx.random.normal((1, 8, 1, 32), key=mx.random.key(1))
    shared = scaled_dot_product_attention(queries, keys, values, cache=None, scale=0.2, mask=None)
    assert mx.allclose(shared, caches[1].attend(queries, 0.2), atol=1e-5).item()


@pytest.mark.parametrize("rotating", [False, True])
def test_keys_and_values_decode_what_attention_reads(rotating):
    """mlx-lm's `KVCache.keys`/`.values`, and `mx.array(history)` of what `update_and_fetch` returns, are the
    tokens held, decoded into the model's float type: `dequantized()`'s, the fp16 window bit for bit."""
    config = KVCacheConfig.preset("vq3")
    cache = CompressedRotatingKVCache(config, max_size=64, keep=4) if rotating else CompressedKVCache(config)
    assert cache.keys is None and cache.values is None
    keys, values = kv(90)
    history_keys, history_values = cache.update_and_fetch(keys, values)
    reference_keys, reference_values = cache.dequantized()
    for got in (cache.keys, mx.array(history_keys)) if not rotating else (cache.keys,):
        assert got.dtype == mx.float16 and mx.array_equal(got, reference_keys.astype(mx.float16)).item()
    assert mx.array_equal(cache.values, reference_values.astype(mx.float16)).item()
    window = config.residual_length
    assert mx.array_equal(cache.keys[..., -window:, :], keys[..., -window:, :]).item()
    assert mx.array_equal(mx.array(history_values)[..., -window:, :], values[..., -window:, :]).item()
    assert cache.step == (64 if rotating else 256)


def test_a_history_compares_and_takes_array_methods_on_its_decoded_tokens():
    """Code written for mlx-lm's arrays (its LRU prompt cache's tests) compares what `keys_and_values()` returns
    with `==` and calls array methods on it: both act on the decoded tokens; the history stays hashable."""
    cache = CompressedKVCache(KVCacheConfig.preset("vq3"))
    keys, values = kv(60)
    cache.update_and_fetch(keys, values)
    history_keys, history_values = cache.keys_and_values()
    decoded_keys, decoded_values = mx.array(history_keys), mx.array(history_values)
    assert mx.array_equal(history_keys == decoded_keys, mx.ones(decoded_keys.shape, dtype=mx.bool_)).item()
    assert not (history_keys == history_values).all().item()  # two histories: their decoded tokens, elementwise
    assert mx.array_equal(history_keys.flatten(), decoded_keys.flatten()).item()
    assert history_values.sum().item() == pytest.approx(decoded_values.sum().item())
    assert len({history_keys, history_values}) == 2
    with pytest.raises(AttributeError):
        history_keys._no_such_member


def test_a_batch_keeps_mlx_lm_padding_columns():
    """A batch's history has `BatchKVCache`'s columns (left padding taken, rows right-aligned), `filter` drops
    the columns every kept row pads, `extend` right-aligns both batches, and `keys` decodes each row into its
    columns with zeros before it."""
    from veloxquant_mlx.batch import BatchCompressedKVCache

    config = config_for("turboquant_mse", 4)
    batch = BatchCompressedKVCache([CompressedKVCache(config) for _ in range(3)])
    batch.prepare(left_padding=[2, 3, 4])
    assert batch.left_padding.tolist() == [2, 3, 4] and batch.columns == 0
    keys, values = kv(4, dim=8)
    keys, values = mx.concatenate([keys] * 3), mx.concatenate([values] * 3)
    history, _ = batch.update_and_fetch(keys, values)
    assert history.shape == (3, 2, 4, 8) and batch.offset.tolist() == [2, 1, 0]
    decoded = batch.keys
    assert decoded.shape == (3, 2, 4, 8) and not mx.any(decoded[1, :, :3]).item()
    assert mx.array_equal(decoded[1:2, :, 3:], batch.rows[1].keys).item()
    batch.filter([0, 1])
    assert batch.left_padding.tolist() == [0, 1] and batch.keys.shape == (2, 2, 2, 8)
    assert batch.make_mask(1, return_array=True)[:, 0, 0].tolist() == [[True] * 3, [False, True, True]]
    other = BatchCompressedKVCache([CompressedKVCache(config) for _ in range(2)])
    other.prepare(left_padding=[3, 0])
    other.update_and_fetch(*(mx.concatenate([x[:, :, :1]] * 2) for x in kv(1, dim=8)))
    other.update_and_fetch(*(mx.concatenate([x] * 2) for x in kv(3, dim=8)))
    batch.extend(other)
    assert batch.columns == 4 and batch.left_padding.tolist() == [2, 3, 3, 0]
    assert batch.offset.tolist() == [2, 1, 1, 4]


def test_a_pipeline_tail_is_made_of_the_library_caches_only():
    """mlx-lm's pipelined models tie the send onto `cache[-1].keys`: a compressed cache (whose `keys` is a
    decoded copy) becomes a tail that keeps that array; mlx-lm's own caches hold `keys` and are left alone."""
    from mlx_lm.models.cache import KVCache

    from veloxquant_mlx.sharding import _as_tail, _PipelineTail

    tail = _as_tail(CompressedKVCache(KVCacheConfig.preset("vq4")))
    assert isinstance(tail, _PipelineTail) and isinstance(tail, CompressedKVCache)
    marker = mx.array(3)
    tail.keys = marker
    assert tail.keys is marker
    assert not isinstance(_as_tail(KVCache()), _PipelineTail)


@pytest.mark.parametrize("dim", [1, 2])
def test_head_dims_too_small_to_code_are_held_in_fp16_with_a_warning(dim):
    """Below head dim 3 a vector's fp16 norm alone costs as much as its values: the cache holds them in fp16, says so,
    and reads them back exactly; attention over them matches mlx-lm's."""
    cache = CompressedKVCache(config_for("turboquant_mse", 4, seed=100 + dim))  # a codec set of its own: its warning is new
    keys, values = kv(40, dim=dim)
    with pytest.warns(UserWarning, match=f"head dim {dim} are held in fp16"):
        history = cache.update_and_fetch(keys, values)
    assert mx.array_equal(cache.keys, keys).item() and mx.array_equal(cache.values, values).item()
    queries = mx.random.normal((1, 4, 1, dim)).astype(mx.float16)
    ours = scaled_dot_product_attention(queries, *history, cache=cache, scale=1.0, mask=None)
    reference = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=1.0)
    assert mx.allclose(ours, reference, atol=2e-3).item()


def test_integer_keys_are_held_as_float16_with_a_warning():
    cache = CompressedKVCache(config_for("turboquant_mse", 4))
    keys = mx.arange(24).reshape(1, 1, 24, 1)
    with pytest.warns(UserWarning, match="integer keys and values .* are held as float16"):
        cache.update_and_fetch(keys, keys)
    assert cache.keys.dtype == mx.float16 and mx.array_equal(cache.keys, keys).item()
    with pytest.raises(CacheInputError, match="floating point or integers"):
        CompressedKVCache(config_for("turboquant_mse", 4)).update_and_fetch(keys > 3, keys > 3)


def test_a_model_without_attention_layers_passes_through_with_the_warning():
    args = mamba2.ModelArgs(model_type="mamba2", num_heads=4, head_dim=16, vocab_size=64, hidden_size=32,
                            intermediate_size=64, state_size=8, num_hidden_layers=2, layer_norm_epsilon=1e-5,
                            conv_kernel=4, n_groups=1, use_bias=False, use_conv_bias=True, tie_word_embeddings=True,
                            time_step_limit=(0.0, math.inf), time_step_rank="auto")
    mx.random.seed(0)
    mamba = mamba2.Model(args)
    with pytest.warns(UserWarning, match="2 layer.s. keep their own non-attention cache"):
        caches = KVCacheBuilder(KVCacheConfig()).for_model(mamba).build()
    reference = mamba.make_cache()
    tokens = mx.array([[1, 2, 3, 4, 5]])
    assert [type(c) for c in caches] == [type(c) for c in reference]
    assert mx.array_equal(mamba(tokens, cache=caches), mamba(tokens, cache=reference)).item()


def _snapshot(cache):
    keys, values = cache.dequantized()
    return cache.offset, cache.nbytes, keys, values


@pytest.mark.parametrize("rotating", [False, True])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_chunk_after_the_first_is_refused_and_leaves_the_cache_unchanged(rotating, bad):
    """The default policy checks every prefill chunk, not only the first (issue: a NaN in a later chunk made
    every later decode step NaN)."""
    config = config_for("turboquant_mse", 4, residual_length=4)
    cache = CompressedRotatingKVCache(config, max_size=32) if rotating else CompressedKVCache(config)
    cache.update_and_fetch(*kv(20))
    cache.update_and_fetch(*kv(1, seed=1))
    before = _snapshot(cache)
    keys, values = kv(6, seed=2)
    keys[0, 1, 3, 5] = bad
    with pytest.raises(CacheInputError, match="NaN, Inf"):
        cache.update_and_fetch(keys, values)
    after = _snapshot(cache)
    assert before[:2] == after[:2] and all(mx.array_equal(a, b).item() for a, b in zip(before[2:], after[2:]))
    queries = mx.random.normal((1, 4, 6, 32), key=mx.random.key(3))
    queries[0, 0, 0, 0] = bad
    with pytest.raises(CacheInputError, match="queries hold NaN or Inf"):
        cache.attend(queries, 0.2, mask="causal")


def test_the_check_follows_the_setting():
    keys, values = kv(6, seed=2)
    keys[0, 0, 0, 0] = math.nan
    for check, refused in (("always", (True, True)), ("prefill", (True, False)), ("first", (False, False)),
                           ("off", (False, False))):
        for tokens, expect in zip((6, 1), refused):
            cache = CompressedKVCache(config_for("turboquant_mse", 4), settings=EngineSettings.resolve(check_inputs=check))
            cache.update_and_fetch(*kv(8))
            if expect:
                with pytest.raises(CacheInputError):
                    cache.update_and_fetch(keys[..., :tokens, :], values[..., :tokens, :])
            else:
                cache.update_and_fetch(keys[..., :tokens, :], values[..., :tokens, :])
