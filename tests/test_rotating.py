"""The compressed sliding-window cache against mlx-lm's RotatingKVCache (fp16 reference)."""

import copy
import json

import mlx.core as mx
import pytest
from mlx_lm.models.base import scaled_dot_product_attention as reference_sdpa
from mlx_lm.models.cache import KVCache, RotatingKVCache

from conftest import tiny_gemma3
from veloxquant_mlx import (
    CacheFormatError,
    CompressedKVCache,
    CompressedRotatingKVCache,
    KVCacheConfig,
    load_prompt_cache,
    make_prompt_cache,
    patch_model,
    save_prompt_cache,
)
from veloxquant_mlx.artifacts import CodecSet
from veloxquant_mlx.cache_integrity import header_digest

HEADS, QUERY_HEADS, DIM, MAX_SIZE = 2, 4, 64, 64
# Prefill chunks (some longer than the window), decode steps, and chunks after eviction began.
CHUNKS = [37, 1, 1, 30, 5, 1, 1, 1, 80, 1, 1, 1, 1, 20, 1, 1]


def _tokens(n, heads=HEADS):
    return [mx.random.normal((1, h, n, DIM)).astype(mx.float16) for h in (heads, heads, QUERY_HEADS)]


def _step(cache, keys, values, queries, reference_cache=None):
    """One layer call the way a model makes it: mask first, then update, then attention."""
    n = keys.shape[2]
    mask = cache.make_mask(n, window_size=MAX_SIZE)
    if reference_cache is None:
        cache.update_and_fetch(keys, values)
        return cache.attend(queries, scale=DIM**-0.5, mask=mask)
    k, v = cache.update_and_fetch(keys, values)
    return reference_sdpa(queries, k, v, cache=cache, scale=DIM**-0.5, mask=mask)


def _held(reference: RotatingKVCache) -> int:
    return min(reference.offset, reference.keys.shape[2])


@pytest.mark.parametrize("keep,window", [(0, 0), (4, 0), (0, 8), (4, 8), (0, 63), (4, 59)])
def test_fp16_codes_give_mlx_lm_rotating_outputs(keep, window):
    mx.random.seed(0)
    reference = RotatingKVCache(max_size=MAX_SIZE, keep=keep)
    ours = CompressedRotatingKVCache(KVCacheConfig(method="fp16", bits=16, residual_length=window), MAX_SIZE, keep)
    for n in CHUNKS:
        keys, values, queries = _tokens(n)
        expected = _step(reference, keys, values, queries, reference_cache=True)
        out = _step(ours, keys, values, queries)
        assert ours.offset == reference.offset
        assert ours.held - ours.stale == _held(reference)
        assert mx.abs(out.astype(mx.float32) - expected.astype(mx.float32)).max().item() < 2e-3, n


def test_codes_attend_like_mlx_lm_fed_the_decoded_tokens():
    """turboquant_mse codes each token on its own: mlx-lm's cache fed the decoded tokens is
    the exact reference, so only rounding separates the two."""
    config = KVCacheConfig(method="turboquant_mse", bits=4)
    codecs = CodecSet.for_config(config)
    key_codec, value_codec = codecs.get("keys", DIM), codecs.get("values", DIM)
    roundtrip = lambda codec, x: codec.reconstruct(codec.encode(x.astype(mx.float32))).astype(mx.float16)  # noqa: E731
    mx.random.seed(1)
    reference = RotatingKVCache(max_size=MAX_SIZE, keep=0)
    ours = CompressedRotatingKVCache(config, MAX_SIZE, 0, codecs)
    worst = 0.0
    for n in CHUNKS:
        keys, values, queries = _tokens(n)
        expected = _step(reference, roundtrip(key_codec, keys), roundtrip(value_codec, values), queries, True)
        out = _step(ours, keys, values, queries)
        worst = max(worst, mx.abs(out.astype(mx.float32) - expected.astype(mx.float32)).max().item())
    assert worst < 5e-3
    assert ours.nbytes < 0.4 * reference.nbytes  # 4-bit codes + norms against fp16


def test_block_format_masks_the_evicted_part_of_a_block():
    """KIVI drops codes in whole key groups: the evicted tokens of a group still held are
    masked, so decode attends exactly to the window mlx-lm holds."""
    config = KVCacheConfig(method="kivi", bits=4, group_size=16, residual_length=8)
    mx.random.seed(2)
    reference = RotatingKVCache(max_size=MAX_SIZE, keep=0)
    ours = CompressedRotatingKVCache(config, MAX_SIZE, 0)
    saw_stale = 0
    for n in CHUNKS:
        keys, values, queries = _tokens(n)
        expected = _step(reference, keys, values, queries, reference_cache=True)
        out = _step(ours, keys, values, queries)
        assert ours.held - ours.stale == _held(reference)
        held_keys, held_values = ours.dequantized()
        assert held_keys.shape[2] == _held(reference)
        # The held tokens are the reference's, up to 4-bit error.
        ref_keys = reference._temporal_order(reference.keys)[..., : _held(reference), :]
        assert mx.abs(held_keys - ref_keys.astype(mx.float32)).max().item() < 0.5
        if n == 1 and ours.inner.just_encoded is None:
            # Decode over exactly the held tokens as attention decodes them (stale ones excluded).
            oracle = reference_sdpa(queries.astype(mx.float32), held_keys, held_values, cache=None,
                                    scale=DIM**-0.5, mask=None)
            assert mx.abs(out.astype(mx.float32) - oracle).max().item() < 2e-3
        saw_stale += ours.stale > 0
        assert mx.abs(out.astype(mx.float32) - expected.astype(mx.float32)).max().item() < 0.3
    assert saw_stale  # the case this test is about happened


def test_memory_stays_bounded_by_the_window():
    cache = CompressedRotatingKVCache(KVCacheConfig(method="turboquant_mse", bits=3), MAX_SIZE)
    plain = CompressedKVCache(KVCacheConfig(method="turboquant_mse", bits=3))
    sizes = []
    for step in range(600):
        keys, values, _ = _tokens(1)
        cache.update_and_fetch(keys, values)
        plain.update_and_fetch(keys, values)
        sizes.append(cache.nbytes)
    assert cache.offset == 600 and cache.held == MAX_SIZE
    assert len(set(sizes[MAX_SIZE:])) == 1
    assert cache.nbytes < plain.nbytes / 2


def test_trim_only_before_eviction_like_mlx_lm():
    config = KVCacheConfig(method="turboquant_mse", bits=4)
    mx.random.seed(3)
    chunks = [_tokens(20)[:2], _tokens(10)[:2]]
    trimmed = CompressedRotatingKVCache(config, MAX_SIZE)
    fresh = CompressedRotatingKVCache(config, MAX_SIZE)
    for keys, values in chunks:
        trimmed.update_and_fetch(keys, values)
    fresh.update_and_fetch(*chunks[0])
    assert trimmed.is_trimmable() and trimmed.trim(10) == 10
    assert trimmed.offset == fresh.offset == 20
    assert mx.array_equal(trimmed.dequantized()[0], fresh.dequantized()[0])
    for _ in range(MAX_SIZE):
        trimmed.update_and_fetch(*_tokens(1)[:2])
    reference = RotatingKVCache(max_size=MAX_SIZE)
    reference.update_and_fetch(*_tokens(MAX_SIZE + 20)[:2])
    assert trimmed.is_trimmable() == reference.is_trimmable() is False
    assert trimmed.trim(5) == 0 and trimmed.offset == MAX_SIZE + 20


def test_saved_and_copied_caches_keep_the_window(tmp_path):
    config = KVCacheConfig(method="kivi", bits=4, group_size=16, residual_length=8)
    cache = CompressedRotatingKVCache(config, MAX_SIZE, keep=4)
    for n in CHUNKS[:6]:
        cache.update_and_fetch(*_tokens(n)[:2])
    assert cache.stale  # the saved state includes stale codes
    save_prompt_cache(tmp_path / "c.safetensors", [cache])
    (loaded,) = load_prompt_cache(tmp_path / "c.safetensors", config=config)
    copied = copy.deepcopy(cache)
    keys, values, queries = _tokens(1)
    outs = [_step(c, keys, values, queries) for c in (cache, loaded, copied)]
    assert loaded.offset == copied.offset == cache.offset and loaded.stale == cache.stale
    assert mx.allclose(outs[0], outs[1]) and mx.allclose(outs[0], outs[2])
    copied.update_and_fetch(*_tokens(1)[:2])
    assert copied.offset == cache.offset + 1  # independent of the original

    *inner_state, header = cache.state
    broken = header.replace(f'"offset": {cache.offset}', '"offset": 3')
    with pytest.raises(CacheFormatError, match="fails its digest"):
        CompressedRotatingKVCache.from_state([*inner_state, broken])
    edited = json.loads(broken)
    edited["digest"] = header_digest(edited)  # a deliberate, self-consistent edit
    with pytest.raises(CacheFormatError, match="corrupted rotating"):
        CompressedRotatingKVCache.from_state([*inner_state, json.dumps(edited)])


@pytest.mark.parametrize("max_size,keep", [(8, 0), (8, 4), (5, 4), (2, 0), (1, 0)])
def test_windows_of_any_size_mlx_lm_takes_give_its_outputs(max_size, keep):
    """A sliding window shorter than the fp16 window (residual_length 32) shrinks the fp16 window, with one
    warning; keep up to max_size - 1 (mlx-lm's make_prompt_cache(max_kv_size=5) keeps 4). With fp16 codes
    the outputs are mlx-lm's."""
    mx.random.seed(0)
    reference = RotatingKVCache(max_size=max_size, keep=keep)
    ours = CompressedRotatingKVCache(KVCacheConfig(method="fp16", bits=16, residual_length=32), max_size, keep)
    with pytest.warns(UserWarning, match="does not fit a sliding window") as noted:
        for n in [7, 1, 1, 3, 1, 12, 1, 1]:
            keys, values, queries = _tokens(n)
            mask, reference_mask = ours.make_mask(n, window_size=max_size), reference.make_mask(n, window_size=max_size)
            ours.update_and_fetch(keys, values)
            out = ours.attend(queries, scale=DIM**-0.5, mask=mask)
            k, v = reference.update_and_fetch(keys, values)
            expected = reference_sdpa(queries, k, v, cache=reference, scale=DIM**-0.5, mask=reference_mask)
            assert ours.offset == reference.offset and ours.size() == reference.size()
            assert mx.abs(out.astype(mx.float32) - expected.astype(mx.float32)).max().item() < 2e-3, n
    assert len([w for w in noted if "does not fit" in str(w.message)]) == 1
    assert ours.inner.config.residual_length == max_size - keep - 1


def test_a_token_block_larger_than_the_window_is_refused_and_keep_is_clamped():
    cache = CompressedRotatingKVCache(KVCacheConfig(method="kivi", bits=4, group_size=32), max_size=8)
    with pytest.raises(ValueError, match="blocks of 32"):
        cache.update_and_fetch(*_tokens(1)[:2])
    with pytest.warns(UserWarning, match="keeps at most 7"):
        assert CompressedRotatingKVCache(KVCacheConfig(), max_size=8, keep=8).keep == 7


def _logits(model, tokens, cache, chunks):
    outs, start = [], 0
    for n in chunks:
        outs.append(model(tokens[:, start : start + n], cache=cache))
        start += n
    return mx.concatenate(outs, axis=1).astype(mx.float32)


def test_gemma3_sliding_layers_get_rotating_caches_and_fp16_codes_match_mlx_lm():
    model = tiny_gemma3(sliding_window=32)
    config = KVCacheConfig(method="fp16", bits=16)
    caches = make_prompt_cache(model, config)
    assert [type(c) for c in caches] == [CompressedRotatingKVCache, CompressedRotatingKVCache, CompressedKVCache]
    assert all(c.max_size == 32 and c.keep == 0 for c in caches[:2])

    tokens = mx.random.randint(0, 512, (1, 100))
    chunks = [40, 30] + [1] * 30  # a prefill past the window, then decoding with eviction
    expected = _logits(model, tokens, model.make_cache(), chunks)
    got = _logits(model, tokens, caches, chunks)
    assert mx.abs(got - expected).max().item() < 2e-2 * mx.abs(expected).max().item()
    assert all(c.held == 32 for c in caches[:2]) and caches[2].offset == 100


def test_patched_gemma3_compresses_every_layer_within_the_window():
    model = patch_model(tiny_gemma3(sliding_window=32), KVCacheConfig(method="turboquant_mse", bits=4))
    caches = model.make_cache()
    reference = type(model).make_cache(model)
    tokens = mx.random.randint(0, 512, (1, 90))
    chunks = [50] + [1] * 40
    expected = _logits(model, tokens, reference, chunks)
    got = _logits(model, tokens, caches, chunks)
    # 4-bit codes on random weights (flat logits): the KL to fp16 is what this model shows without
    # any eviction too (~0.17 with a window longer than the prompt); a wrong window would be far off.
    p, q = mx.softmax(expected, axis=-1), mx.softmax(got, axis=-1)
    assert (p * (mx.log(p) - mx.log(q))).sum(-1).mean().item() < 0.5
    assert all(isinstance(c, (CompressedKVCache, CompressedRotatingKVCache)) for c in caches)
    for ours, theirs in zip(caches, reference):
        assert ours.nbytes < 0.5 * theirs.nbytes
    assert isinstance(reference[0], RotatingKVCache) and isinstance(reference[2], KVCache)


def test_mlx_lm_generate_runs_past_the_window_with_compressed_caches():
    from mlx_lm.generate import generate_step

    model = patch_model(tiny_gemma3(sliding_window=32), KVCacheConfig(method="turboquant_mse", bits=4))
    caches = model.make_cache()
    prompt = mx.random.randint(0, 512, (20,))
    steps = list(zip(range(40), generate_step(prompt, model, prompt_cache=caches, max_tokens=40)))
    assert len(steps) == 40
    fed = caches[2].offset  # the prompt and the tokens generate_step has fed back (it runs one ahead)
    assert fed >= 59 and all(c.offset == fed and c.held == 32 for c in caches[:2])


def test_batch_merge_gives_a_batch_of_copies_and_refuses_mixed_kinds():
    """mlx-lm's BatchRotatingKVCache.merge; decoding such batches: tests/test_batch.py."""
    from veloxquant_mlx.batch import BatchCompressedKVCache
    from veloxquant_mlx.cache import CompressedKVCache

    config = KVCacheConfig(method="turboquant_mse", bits=4)
    caches = [CompressedRotatingKVCache(config, MAX_SIZE) for _ in range(2)]
    batch = caches[0].merge(caches)
    assert isinstance(batch, BatchCompressedKVCache) and len(batch.rows) == 2
    assert all(row is not cache and row.max_size == MAX_SIZE for row, cache in zip(batch.rows, caches))
    with pytest.raises(TypeError, match="one kind"):
        caches[0].merge([caches[0], CompressedKVCache(config)])


def test_max_kv_size_gives_full_attention_layers_mlx_lm_rotating_caches():
    """`--max-kv-size N` (generate): as mlx-lm's make_prompt_cache(model, N) for a model without
    its own make_cache, every layer is a rotating cache of N tokens keeping the first 4; fp16
    codes give mlx-lm's outputs."""
    from conftest import tiny_llama
    from veloxquant_mlx.integration import KVCacheBuilder

    model = tiny_llama(layers=2, hidden=128, heads=4, kv_heads=2)
    caches = KVCacheBuilder(KVCacheConfig(method="fp16", bits=16)).for_model(model).build(max_kv_size=24)
    assert all(isinstance(c, CompressedRotatingKVCache) and c.max_size == 24 and c.keep == 4 for c in caches)
    tokens = mx.random.randint(0, 512, (1, 80))
    chunks = [30, 20] + [1] * 30
    expected = _logits(model, tokens, [RotatingKVCache(max_size=24, keep=4) for _ in model.layers], chunks)
    got = _logits(model, tokens, caches, chunks)
    assert mx.abs(got - expected).max().item() < 2e-2 * mx.abs(expected).max().item()
    assert all(c.held == 24 for c in caches)


def test_kernel_slid_window_evicts_like_the_op_by_op_cache():
    """On the kernel back ends the fused decode step slides the fp16 window as a ring
    (`incoming`); the rotating cache evicts codes before each update, so it must see the token
    that waited as held. Emulated kernels against the portable back end, past the eviction."""
    from veloxquant_mlx import EngineSettings
    from veloxquant_mlx.kernels import emulator

    if emulator.compiler() is None:
        pytest.skip("no C++20 compiler for the emulator")
    cfg = KVCacheConfig(method="turboquant_mse", bits=3, value_bits=4, residual_length=8, center=True)
    ref = CompressedRotatingKVCache(cfg, MAX_SIZE, keep=2, settings=EngineSettings.resolve(backend="portable"))
    fused = CompressedRotatingKVCache(cfg, MAX_SIZE, keep=2, settings=EngineSettings.resolve(backend="emulator"))
    k, v, _ = _tokens(40)
    for cache in (ref, fused):
        cache.update_and_fetch(k, v)
    for step in range(43):  # not a multiple of the window: the ring ends turned
        k, v, q = _tokens(1)
        outs = []
        for cache in (ref, fused):
            mask = cache.make_mask(1)
            cache.update_and_fetch(k, v)
            outs.append(cache.attend(q, DIM ** -0.5, mask=mask))
        assert fused.last_path == "mse_fused_step", (step, fused.last_path)
        assert mx.allclose(outs[1], outs[0], rtol=2e-2, atol=2e-3).item(), step
        assert (fused.offset, fused.inner.encoded, fused.inner.window) == (ref.offset, ref.inner.encoded, ref.inner.window)
    assert fused.inner.window_start == 43 % 8 and ref.offset > MAX_SIZE
    assert mx.array_equal(fused.inner.window_keys, ref.inner.window_keys).item()


def test_block_format_window_not_a_multiple_of_its_group():
    """A sliding window of 80 tokens with KIVI's 32-token key groups: the store grows by the window,
    and every field must grow at least as far (the per-group key scales by 3 rows, not 2), or the
    C++ KIVI decode refused the buffers at the first encoded group. The default back end (the C++
    kernel where built) attends as the portable one does, past the eviction."""
    from veloxquant_mlx import EngineSettings

    config = KVCacheConfig(method="kivi", bits=4, group_size=32, residual_length=8)
    default = CompressedRotatingKVCache(config, 80, 4)
    portable = CompressedRotatingKVCache(config, 80, 4, settings=EngineSettings.resolve(backend="portable"))
    keys = mx.random.normal((1, HEADS, 200, DIM), key=mx.random.key(5)).astype(mx.float16)
    queries = mx.random.normal((1, QUERY_HEADS, 1, DIM), key=mx.random.key(6)).astype(mx.float16)
    for i in range(200):
        outs = [_step(cache, keys[..., i : i + 1, :], keys[..., i : i + 1, :], queries) for cache in (default, portable)]
        assert mx.allclose(outs[0].astype(mx.float32), outs[1].astype(mx.float32), atol=2e-3).item(), i
    assert default.inner.store.buffers["keys"]["channel_scale"].shape[2] * 32 >= default.inner.store.buffers[
        "keys"]["codes"].shape[2]


def test_saved_right_after_a_chunk_on_a_full_window_loads(tmp_path):
    """After a chunk of n tokens on a full window the cache holds max_size - 1 + n tokens until the
    next update evicts (as mlx-lm's RotatingKVCache does): such a state is valid and must load, and
    the loaded cache decodes as the original."""
    config = KVCacheConfig(method="kivi", bits=4, group_size=16, residual_length=8)
    cache = CompressedRotatingKVCache(config, MAX_SIZE, keep=4)
    for n in (70, 1, 30):  # the window is full before the 30-token chunk
        cache.update_and_fetch(*_tokens(n)[:2])
    assert cache.held - cache.stale > MAX_SIZE
    save_prompt_cache(tmp_path / "c.safetensors", [cache])
    (loaded,) = load_prompt_cache(tmp_path / "c.safetensors", config=config)
    keys, values, queries = _tokens(1)
    assert mx.allclose(_step(cache, keys, values, queries), _step(loaded, keys, values, queries)).item()


@pytest.mark.parametrize("method", ["kivi", "turboquant_mse"])
def test_a_window_store_grows_by_at_most_the_window(method):
    # Short prompts then decode steps, as a chat starts: before any eviction the store never holds room for more
    # than the window (a field store as a row store; mlx-lm's RotatingKVCache grows by at most its max_size).
    cache = CompressedRotatingKVCache(KVCacheConfig(method=method, bits=4), MAX_SIZE, 0)
    keys = mx.random.normal((1, HEADS, 10, DIM)).astype(mx.float16)
    capacities = []
    for n in [10] + [1] * (2 * MAX_SIZE):
        cache.update_and_fetch(keys[..., :n, :], keys[..., :n, :])
        capacities.append(cache.inner.store.capacity)
    assert 0 < max(capacities) <= 2 * MAX_SIZE, sorted(set(capacities))
