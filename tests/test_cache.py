"""The compressed cache: storage budget, attention correctness, mlx-lm protocol, trim, save/load."""

import json
import math

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache

from conftest import ALL_METHODS, config_for
from veloxquant_mlx import CacheFormatError, CompressedKVCache, EngineSettings, KVCacheConfig
from veloxquant_mlx.cache_integrity import split_state
from veloxquant_mlx.integration import install_attention_hook
from veloxquant_mlx.storage import stored_bits_per_token

install_attention_hook()


def random_kv(T, heads=2, dim=64, seed=0, batch=1):
    mx.random.seed(seed)
    k = mx.random.normal((batch, heads, T, dim)) * 2
    v = mx.random.normal((batch, heads, T, dim))
    return k, v


def fill(cache, k, v, chunks):
    start = 0
    for size in chunks:
        cache.update_and_fetch(k[..., start : start + size, :], v[..., start : start + size, :])
        start += size
    assert start == k.shape[2]


def reference_attention(q, k, v, scale, mask):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


@pytest.mark.parametrize("method", ALL_METHODS)
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_nbytes_matches_bit_budget(method, bits):
    """Live buffers hold exactly the method's bits per token (no hidden fp16 copy)."""
    config = config_for(method, bits)
    cache = CompressedKVCache(config)
    T, heads, dim = 1024, 3, 64  # a multiple of the buffer step: no unused capacity
    k, v = random_kv(T, heads, dim)
    fill(cache, k, v, [300, 1, 211, 512])
    mx.eval(cache.state)
    budget_bits = stored_bits_per_token(cache.key_codec, cache.value_codec)  # the codecs' bits, rows in whole words
    assert budget_bits - (cache.key_codec.bits_per_token() + cache.value_codec.bits_per_token()) in (0, 16)
    expected = budget_bits / 8 * T * heads
    assert cache.window == 0 and cache.sinks == 0 and cache.encoded == T
    assert abs(cache.nbytes - expected) <= 0.03 * expected, (cache.nbytes, expected)
    if method != "fp16":
        assert cache.nbytes < 0.6 * (2 * T * heads * 2 * dim)


def _held_bytes(obj) -> int:
    """Bytes of every array an object holds, in attributes, dicts and tuples, down to its store."""
    if isinstance(obj, mx.array):
        return obj.nbytes
    if isinstance(obj, dict):
        return sum(_held_bytes(v) for v in obj.values())
    if isinstance(obj, (tuple, list)):
        return sum(_held_bytes(v) for v in obj)
    return 0


@pytest.mark.parametrize("method", ["turboquant_mse", "kivi", "qjl"])
def test_no_attribute_escapes_nbytes(method):
    """Every array the cache and its store hold is counted in nbytes (after an attention
    call, which drops the chunk's fp16 tokens kept for it)."""
    cache = CompressedKVCache(config_for(method, 3, sink_tokens=4, residual_length=16, group_size=32))
    k, v = random_kv(200)
    fill(cache, k, v, [100, 100])
    cache.attend(mx.zeros((1, 2, 1, 64)), scale=0.1)
    counted = sum(_held_bytes(v) for v in vars(cache).values() if not hasattr(v, "__dict__"))
    counted += sum(_held_bytes(v) for v in vars(cache.store).values())
    assert counted == cache.nbytes
    assert cache.window_keys.dtype == k.dtype and cache.window == 16 + (200 - 4 - 16) % cache.block
    assert cache.sinks == 4 and cache.encoded == 200 - 4 - cache.window


@pytest.mark.parametrize("center", [False, True])
@pytest.mark.parametrize("method", ALL_METHODS)
def test_blockwise_attention_equals_attention_on_decoded_history(method, center):
    """Without a window, prefill (causal) and decode steps with GQA 8:2 over several
    blocks equal plain attention over the decoded history."""
    cache = CompressedKVCache(config_for(method, 4, sink_tokens=3, center=center))
    cache.attention_block = 64
    k, v = random_kv(400, heads=2, dim=64, seed=1)
    k = k + 3.0 * mx.sin(mx.arange(64))  # a shared offset, as real keys have
    mx.random.seed(2)
    q = mx.random.normal((1, 8, 400, 64))
    scale = 64**-0.5
    for start, stop in [(0, 150), (150, 390), (390, 391), (391, 400)]:
        cache.update_and_fetch(k[..., start:stop, :], v[..., start:stop, :])
        L = stop - start
        mask = "causal" if L > 1 else None
        out = cache.attend(q[..., start:stop, :], scale=scale, mask=mask)
        dk, dv = cache.dequantized()
        assert dk.shape[2] == stop
        if cache.block > 1 and L > 1:
            continue  # tokens of a partial group are fp16 for earlier queries (next test)
        ref = reference_attention(q[..., start:stop, :], dk, dv, scale, mask)
        assert mx.allclose(out, ref, atol=2e-4, rtol=1e-3).item(), method


@pytest.mark.parametrize("band_queries", [64, 5])
@pytest.mark.parametrize("center", [False, True])
@pytest.mark.parametrize("method", ALL_METHODS)
def test_chunked_prefill_equals_token_by_token_decoding(method, center, band_queries):
    """With sinks and an fp16 window, under the "decode" prefill rule each query of a prefill
    chunk sees exactly what it would see if the tokens had been decoded one at a time (also
    when the chunk's queries score its fp16 tokens in groups of `band_queries`)."""
    config = config_for(method, 3, sink_tokens=2, residual_length=24, center=center)
    k, v = random_kv(150, heads=2, dim=64, seed=3)
    mx.random.seed(4)
    q = mx.random.normal((1, 4, 150, 64))
    settings = EngineSettings.resolve(prefill_rule="decode")
    stepped = CompressedKVCache(config, settings=settings)
    first = CompressedKVCache(config, settings=settings)
    first.band_queries = band_queries
    # The first update encodes a whole block for every method, so both caches estimate
    # the same centering means (they come from the first chunk that gets encoded).
    first.update_and_fetch(k[..., :70, :], v[..., :70, :])
    stepped.update_and_fetch(k[..., :70, :], v[..., :70, :])
    assert first.encoded > 0
    expected = []
    for t in range(70, 150):
        stepped.update_and_fetch(k[..., t : t + 1, :], v[..., t : t + 1, :])
        expected.append(stepped.attend(q[..., t : t + 1, :], scale=0.125))
    expected = mx.concatenate(expected, axis=2)
    got = []
    for start, stop in [(70, 97), (97, 98), (98, 150)]:
        first.update_and_fetch(k[..., start:stop, :], v[..., start:stop, :])
        got.append(first.attend(q[..., start:stop, :], scale=0.125, mask="causal"))
    got = mx.concatenate(got, axis=2)
    assert (first.encoded, first.window) == (stepped.encoded, stepped.window)
    assert mx.allclose(got, expected, atol=1e-4).item()


@pytest.mark.parametrize("method", ["turboquant_mse", "kivi"])
def test_chunk_prefill_rule_sees_the_chunk_and_the_window_in_fp16(method):
    """Under the default "chunk" rule a prefill chunk's queries see the chunk and the window
    before it in fp16 and older tokens from their codes, which for a first chunk is plain fp16
    attention; under the "decode" rule its earlier queries see flushed tokens from their codes."""
    config = config_for(method, 3, sink_tokens=2, residual_length=16)
    k, v = random_kv(120, heads=2, dim=64, seed=5)
    q = mx.random.normal((1, 4, 120, 64), key=mx.random.key(6))
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
    outs = {}
    for rule in ("chunk", "decode"):
        cache = CompressedKVCache(config, settings=EngineSettings.resolve(prefill_rule=rule))
        cache.update_and_fetch(k, v)
        assert cache.encoded > 0
        outs[rule] = cache.attend(q, scale=0.125, mask="causal")
    assert mx.allclose(outs["chunk"], want, atol=1e-5, rtol=1e-4).item()
    assert not mx.allclose(outs["decode"], want, atol=1e-3, rtol=1e-3).item()
    # A second chunk: codes before the span the update encoded, fp16 from there on.
    cache = CompressedKVCache(config, settings=EngineSettings.resolve(prefill_rule="chunk"))
    cache.update_and_fetch(k[..., :80, :], v[..., :80, :])
    first = 2 + cache.encoded  # sinks, then the codes that existed before this update
    cache.update_and_fetch(k[..., 80:, :], v[..., 80:, :])
    dk, dv = cache.dequantized()
    keys = mx.concatenate([k[..., :2, :], dk[..., 2:first, :], k[..., first:, :]], axis=2)
    values = mx.concatenate([v[..., :2, :], dv[..., 2:first, :], v[..., first:, :]], axis=2)
    got = cache.attend(q[..., 80:, :], scale=0.125, mask="causal")
    ref = mx.fast.scaled_dot_product_attention(q[..., 80:, :], keys, values, scale=0.125, mask="causal")
    assert mx.allclose(got, ref, atol=2e-4, rtol=1e-3).item(), float(mx.abs(got - ref).max())


def test_array_mask_and_batch():
    cache = CompressedKVCache(config_for("turboquant_mse", 4))
    cache.attention_block = 32
    k, v = random_kv(100, heads=2, dim=64, batch=2)
    cache.update_and_fetch(k, v)
    q = mx.random.normal((2, 4, 100, 64))
    mask = mx.random.uniform(shape=(2, 1, 100, 100)) > 0.3
    mask = mask | mx.eye(100, dtype=mx.bool_)
    dk, dv = cache.dequantized()
    out = cache.attend(q, scale=0.125, mask=mask)
    ref = reference_attention(q, dk.astype(mx.float32), dv, 0.125, mask)
    assert mx.allclose(out, ref, atol=2e-4).item()


def test_quality_close_to_exact_attention():
    k, v = random_kv(512, dim=128)
    q = mx.random.normal((1, 2, 1, 128))
    exact = reference_attention(q, k, v, 128**-0.5, None)
    errors = []
    for bits in (2, 3, 4):
        cache = CompressedKVCache(KVCacheConfig(method="turboquant_mse", bits=bits))
        cache.update_and_fetch(k, v)
        out = cache.attend(q, scale=128**-0.5)
        errors.append(mx.linalg.norm(out - exact).item() / mx.linalg.norm(exact).item())
    assert errors[0] > errors[1] > errors[2]
    assert errors[2] < 0.25  # measured 0.20: softmax with score std 2 amplifies key errors


def test_protocol_surface():
    cache = CompressedKVCache(config_for("turboquant_mse", 4, residual_length=8))
    assert cache.empty() and cache.size() == 0 and cache.nbytes == 0 and cache.is_trimmable()
    k, v = random_kv(20)
    keys, values = cache.update_and_fetch(k, v)
    assert keys.shape == (1, 2, 20, 64) and values.shape == (1, 2, 20, 64)
    assert not cache.empty() and cache.size() == 20 and cache.offset == 20
    # mlx-lm calls make_mask(N, return_array=..., window_size=...) before update_and_fetch.
    assert cache.make_mask(5, return_array=False, window_size=None) == "causal"
    assert cache.make_mask(1, return_array=False, window_size=None) is None
    assert cache.make_mask(5, return_array=True, window_size=None).shape == (5, 25)


@pytest.mark.parametrize("method", ALL_METHODS)
def test_save_load_round_trip(tmp_path, method):
    caches = [CompressedKVCache(config_for(method, 3, sink_tokens=2, residual_length=16)) for _ in range(2)]
    k, v = random_kv(150)
    for c in caches:
        fill(c, k, v, [100, 50])
    path = tmp_path / "cache.safetensors"
    save_prompt_cache(str(path), caches, {"note": "x"})
    loaded, meta = load_prompt_cache(str(path), return_metadata=True)
    assert meta == {"note": "x"}
    q = mx.random.normal((1, 4, 1, 64))
    for a, b in zip(caches, loaded):
        assert type(b) is CompressedKVCache and b.offset == a.offset and b.encoded == a.encoded
        assert mx.array_equal(a.attend(q, scale=0.125), b.attend(q, scale=0.125)).item()
        # The loaded cache keeps working.
        a.update_and_fetch(k[..., :5, :], v[..., :5, :])
        b.update_and_fetch(k[..., :5, :], v[..., :5, :])
        assert mx.array_equal(a.attend(q, scale=0.125), b.attend(q, scale=0.125)).item()


def test_trim_restores_the_window_from_its_shadow_and_keeps_older_tokens_encoded():
    config = config_for("turboquant_mse", 3, residual_length=40)
    k, v = random_kv(120)
    fresh, trimmed = CompressedKVCache(config), CompressedKVCache(config)
    fresh.update_and_fetch(k[..., :100, :], v[..., :100, :])
    trimmed.update_and_fetch(k[..., :100, :], v[..., :100, :])
    trimmed.update_and_fetch(k[..., 100:103, :], v[..., 100:103, :])
    # The three tokens the trimmed ones pushed out of the window come back from their fp16 copies.
    assert trimmed.trim(3) == 3 and trimmed.offset == 100
    assert (fresh.encoded, fresh.window) == (trimmed.encoded, trimmed.window) == (60, 40)
    q = mx.random.normal((1, 2, 1, 64))
    assert mx.array_equal(fresh.attend(q, scale=0.1), trimmed.attend(q, scale=0.1)).item()
    # A trim past those copies (three tokens per update, six trimmed) keeps the older ones encoded.
    trimmed.update_and_fetch(k[..., 100:103, :], v[..., 100:103, :])
    trimmed.update_and_fetch(k[..., 103:106, :], v[..., 103:106, :])
    assert trimmed.trim(6) == 6 and trimmed.offset == 100
    assert (trimmed.encoded, trimmed.window) == (66, 34) and trimmed.refill_span() == 40
    # Six tokens at 3 bits: close to the fresh cache, not equal.
    assert mx.allclose(fresh.attend(q, scale=0.1), trimmed.attend(q, scale=0.1), atol=0.05).item()
    fk, fv = fresh.dequantized()
    tk, tv = trimmed.dequantized()
    assert mx.array_equal(fk[..., :60, :], tk[..., :60, :]).item()
    assert mx.array_equal(fk[..., 66:, :], tk[..., 66:, :]).item()


@pytest.mark.parametrize("method", ALL_METHODS)
def test_trim_of_encoded_tokens(method):
    """Without a window, trimming encoded tokens of a per-token codec equals never having
    seen them. A block codec (KIVI key groups) returns the surviving tokens of a cut block
    to the window decoded, so attention equals that over the untrimmed cache's first tokens."""
    config = config_for(method, 4)
    k, v = random_kv(160)
    fresh, trimmed = CompressedKVCache(config), CompressedKVCache(config)
    fresh.update_and_fetch(k[..., :70, :], v[..., :70, :])
    trimmed.update_and_fetch(k[..., :70, :], v[..., :70, :])
    q = mx.random.normal((1, 2, 1, 64))
    trimmed.update_and_fetch(k[..., 70:160, :], v[..., 70:160, :])
    full_k, full_v = trimmed.dequantized()
    assert trimmed.trim(90) == 90 and trimmed.offset == 70
    after = trimmed.attend(q, scale=0.1)
    if trimmed.block == 1:
        assert mx.allclose(fresh.attend(q, scale=0.1), after, atol=1e-5).item()
    else:
        assert trimmed.encoded == 64 and trimmed.window == 6
        ref = reference_attention(q, full_k[..., :70, :], full_v[..., :70, :], 0.1, None)
        assert mx.allclose(ref, after, atol=1e-3).item()


def test_centering_helps_offset_keys_and_is_saved(tmp_path):
    k, v = random_kv(300, dim=64)
    k, v = k + 4.0, v - 2.0
    q = mx.random.normal((1, 2, 1, 64))
    exact = reference_attention(q, k, v, 0.125, None)
    errors = {}
    for center in (False, True):
        cache = CompressedKVCache(config_for("turboquant_mse", 3, center=center))
        cache.update_and_fetch(k, v)
        errors[center] = mx.abs(cache.attend(q, scale=0.125) - exact).max().item()
        restored = CompressedKVCache.from_state(cache.state)
        assert mx.array_equal(restored.attend(q, scale=0.125), cache.attend(q, scale=0.125)).item()
    assert errors[True] < 0.5 * errors[False]


def test_trim_everything_and_sinks():
    cache = CompressedKVCache(config_for("turboquant_mse", 4, sink_tokens=4))
    k, v = random_kv(10)
    cache.update_and_fetch(k, v)
    assert cache.trim(100) == 10 and cache.offset == 0 and cache.sinks == 0
    cache.update_and_fetch(k, v)
    assert cache.sinks == 4 and cache.encoded == 6


def test_corrupted_states_are_refused():
    cache = CompressedKVCache(config_for("turboquant_mse", 4))
    k, v = random_kv(50)
    cache.update_and_fetch(k, v)
    header, arrays = split_state(cache.state)  # with every tensor's checksums, whichever API saves it
    with pytest.raises(CacheFormatError, match="header"):
        CompressedKVCache.from_state(["{not json", arrays])
    broken = {**arrays, "keys": {name: a[..., :10, :] for name, a in arrays["keys"].items()}}
    with pytest.raises(CacheFormatError, match="keys.codes.*the header says"):
        CompressedKVCache.from_state([header, broken])
    missing = {k: v for k, v in arrays.items() if k != "values"}
    with pytest.raises(CacheFormatError, match="values.codes.*missing"):
        CompressedKVCache.from_state([header, missing])
    unsealed = {k: v for k, v in arrays.items() if k != "checksums"}
    with pytest.raises(CacheFormatError, match="checksums are missing"):
        CompressedKVCache.from_state([header, unsealed])
    codes = {**arrays["keys"]}
    name = sorted(codes)[0]
    codes[name] = codes[name] + 1
    with pytest.raises(CacheFormatError, match=f"'keys.{name}' fails its checksum"):
        CompressedKVCache.from_state([header, {**arrays, "keys": codes}])


def test_state_lays_out_arrays_first_and_reads_format_3():
    """`state` is the layer's arrays, then its header naming them (mlx-lm's caches put their arrays first too);
    a layer written as format 3 ([header, arrays]) still loads, to the same tokens."""
    from veloxquant_mlx.checksums import metadata_digest

    cache = CompressedKVCache(config_for("turboquant_mse", 4, sink_tokens=2, residual_length=4))
    cache.update_and_fetch(*random_kv(20))
    state = cache.state
    header = json.loads(state[-1])
    assert all(isinstance(a, mx.array) for a in state[:-1]) and len(header["arrays"]) == len(state) - 1
    restored = CompressedKVCache.from_state(state)
    assert mx.array_equal(restored.keys, cache.keys).item() and restored.state[-1] == state[-1]
    _, arrays = split_state(state)
    old = {k: v for k, v in header.items() if k not in ("arrays", "digest")}
    old["format"] = 3
    old["digest"] = metadata_digest(old)
    written_as_3 = CompressedKVCache.from_state([json.dumps(old), arrays])
    assert mx.array_equal(written_as_3.keys, cache.keys).item() and written_as_3.offset == 20


def test_state_carries_its_checksums():
    """mlx-lm's save_prompt_cache saves `state` as it is: it carries every tensor's description
    (in the header, under its digest) and checksums (an MLX array, computed with the state)."""
    cache = CompressedKVCache(config_for("turboquant_mse", 4))
    cache.update_and_fetch(*random_kv(50))
    header, arrays = split_state(cache.state)
    listed = json.loads(header)["tensors"]
    assert isinstance(arrays["checksums"], mx.array) and arrays["checksums"].shape == (len(listed), 2)
    assert {f"keys.{name}" for name in arrays["keys"]} <= set(listed)


def test_truncated_and_foreign_files(tmp_path):
    from veloxquant_mlx import load_prompt_cache as velox_load
    from veloxquant_mlx import save_prompt_cache as velox_save

    config = config_for("turboquant_mse", 4)
    caches = [CompressedKVCache(config)]
    k, v = random_kv(64)
    caches[0].update_and_fetch(k, v)
    path = tmp_path / "c.safetensors"
    velox_save(path, caches)
    assert velox_load(path, config=config)[0].offset == 64
    with pytest.raises(CacheFormatError, match="written with turboquant_mse K4/V4"):
        velox_load(path, config=config.replace(bits=3, value_bits=3))
    data = path.read_bytes()
    truncated = tmp_path / "t.safetensors"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(CacheFormatError, match="cannot read prompt cache"):
        velox_load(truncated)
    plain = tmp_path / "p.safetensors"
    fp16 = KVCache()
    fp16.update_and_fetch(k, v)
    save_prompt_cache(str(plain), [fp16])
    with pytest.raises(CacheFormatError, match="KVCache"):
        velox_load(plain, config=config)


@pytest.mark.parametrize("method", ["turboquant_mse", "qjl"])  # a RowStore, a FieldStore
def test_buffers_grow_in_steps(method):
    cache = CompressedKVCache(config_for(method, 4))
    k, v = random_kv(300)
    cache.update_and_fetch(k[..., :10, :], v[..., :10, :])
    assert cache.store.capacity == 256 and cache.key_fields[next(iter(cache.key_fields))].shape[2] == 10
    cache.update_and_fetch(k[..., 10:, :], v[..., 10:, :])
    assert cache.store.capacity == 512
    if method != "turboquant_mse":
        return
    assert math.isclose(cache.nbytes, 512 * 2 * 2 * (64 * 4 / 8 + 2))


@pytest.mark.parametrize("residual, sinks", [(0, 0), (8, 2)])
def test_block_format_decode_tokens_fill_a_fixed_capacity_window(residual, sinks):
    """KIVI's decode tokens wait in an fp16 window until a key group is full. The window is a buffer
    of residual_length + group_size tokens that each decode token fills in place (its shape, and so
    the compiled decode step's, stays the same from token to token); every reader sees the filled
    tokens only, the same tokens and codes as a cache that took them all in one update."""
    config = KVCacheConfig(method="kivi", bits=2, group_size=16, residual_length=residual, sink_tokens=sinks)
    k, v = random_kv(120, heads=2, dim=32, seed=3)
    stepped, whole = CompressedKVCache(config), CompressedKVCache(config)
    stepped.update_and_fetch(k[..., :40, :], v[..., :40, :])
    capacities = set()
    for i in range(40, 120):
        stepped.update_and_fetch(k[..., i : i + 1, :], v[..., i : i + 1, :])
        capacities.add(stepped._window_keys.shape[2])
        assert stepped.window == stepped.offset - stepped.sinks - stepped.encoded
    whole.update_and_fetch(k, v)
    assert capacities == {residual + 16}
    assert stepped.window_fill is not None and stepped.window == whole.window < residual + 16
    assert mx.array_equal(stepped.window_keys, whole.window_keys) and mx.array_equal(stepped.window_values,
                                                                                     whole.window_values)
    for role in ("keys", "values"):
        a, b = stepped.store.fields(role), whole.store.fields(role)
        assert all(mx.array_equal(a[name], b[name]) for name in b)
    # nbytes counts the whole buffer, used_nbytes its filled part.
    # Held bytes count the fp16 tokens at 2 bytes a value (footprint.py), the buffers at the inputs' float type.
    per_token = 2 * 32 * 2  # heads x dim x (keys, values)
    spare = per_token * ((sinks + residual + 16) * k.itemsize - (sinks + stepped.window) * 2)
    assert stepped.nbytes - stepped.used_nbytes - (stepped.store.nbytes - stepped.store.used_nbytes) == spare
    q = mx.random.normal((1, 4, 1, 32), key=mx.random.key(9))
    assert mx.allclose(stepped.attend(q, 0.17), whole.attend(q, 0.17), atol=1e-5)
    # A trim and a multi-token update leave the buffer for an exact window, which the next token refills.
    stepped.trim(3)
    assert stepped.window_fill is None and stepped.window == whole.window - 3
    stepped.update_and_fetch(k[..., :1, :], v[..., :1, :])
    assert stepped.window_fill == whole.window - 2 and stepped._window_keys.shape[2] == residual + 16


def test_chunk_rule_prefill_skips_the_codes_its_queries_see_in_fp16():
    """Under the "chunk" prefill rule every query of a chunk sees the chunk's tokens in fp16, so the
    generic path scores none of their codes (they would be masked out whole): only codes of earlier
    updates, and the same output as masking them."""
    from veloxquant_mlx import attention

    config = KVCacheConfig(method="turboquant_mse", bits=3, value_bits=2, sink_tokens=4, residual_length=32)
    cache = CompressedKVCache(config, settings=EngineSettings.resolve(prefill_rule="chunk"))
    k, v = mx.random.normal((1, 2, 600, 64), key=mx.random.key(1)), mx.random.normal((1, 2, 600, 64), key=mx.random.key(2))
    q = mx.random.normal((1, 4, 300, 64), key=mx.random.key(3))
    cache.update_and_fetch(k[:, :, :300], v[:, :, :300])
    cache.attend(q, 0.125, mask="causal")
    cache.update_and_fetch(k[:, :, 300:], v[:, :, 300:])
    first = cache.just_encoded[2]
    segments = list(cache.segments(query_rows=4 * 300, query_len=300))
    coded = [s for s in segments if s.encoded]
    assert coded and max(s.start + s.keys.shape[2] for s in coded) == first
    # the skipped codes: scored with their mask (every query sees them in fp16) they change nothing
    start, stop = first - cache.sinks, cache.encoded
    fields = cache.store.fields("keys", start, stop)
    masked = attention.Segment(cache.key_codec.decode(fields), None, first, encoded=True,
                               extra_mask=mx.zeros((1, stop - start), mx.bool_),
                               value_fields=cache.store.fields("values", start, stop), value_shift=coded[0].value_shift)
    args = dict(scale=0.125, mask="causal", key_codec=cache.key_codec, value_codec=cache.value_codec, kv_heads=2,
                total=cache.offset)
    without = attention.attend(q, segments, **args)
    with_masked = attention.attend(q, coded + [masked] + [s for s in segments if not s.encoded], **args)
    assert mx.allclose(without, with_masked, atol=1e-6).item()
