"""The MLA latent cache (`cache/latent.py`): layout, error bounds, trim and files, and a tiny DeepSeek-V3 against
mlx-lm's own caches. The architecture matrix (tests/test_models_matrix.py) checks every MLA file's KL."""

import mlx.core as mx
import pytest
from mlx_lm.models import cache as mlx_cache

from veloxquant_mlx.cache.latent import CompressedLatentCache
from veloxquant_mlx.config import KVCacheConfig
from veloxquant_mlx.errors import UnsupportedModelError
from veloxquant_mlx.integration import compressed_caches

RANK, ROPE = 64, 32


def tokens(n, seed=0):
    key = mx.random.key(seed)
    latent = mx.random.normal((1, 1, n, RANK), key=key) * 0.5 + mx.linspace(-2, 2, RANK)
    rope = mx.random.normal((1, 1, n, ROPE), key=mx.random.split(key)[0])
    return latent, rope


def relative_error(a, b):
    return (mx.linalg.norm(a - b) / mx.linalg.norm(b)).item()


def config(bits=4, sinks=4, window=8, center=True):
    return KVCacheConfig(method="turboquant_mse", bits=bits, residual_length=window, sink_tokens=sinks, center=center)


def test_sinks_and_window_are_fp16_codes_hold_the_rest_within_the_codebook_error():
    latent, rope = tokens(100)
    cache = CompressedLatentCache(config())
    returned = cache.update_and_fetch(latent, rope)
    assert returned[0] is latent and returned[1] is rope  # the call's own tokens come back as given
    assert (cache.offset, cache.encoded) == (100, 88)
    got_latent, got_rope = cache.fetch()
    assert got_latent.shape == latent.shape and got_rope.shape == rope.shape
    exact = mx.concatenate([latent[..., :4, :], latent[..., -8:, :]], axis=-2)
    kept = mx.concatenate([got_latent[..., :4, :], got_latent[..., -8:, :]], axis=-2)
    assert mx.allclose(kept, exact.astype(mx.float16).astype(mx.float32), atol=0).item()
    coded = relative_error(got_latent[..., 4:92, :], latent[..., 4:92, :])
    # 4-bit Lloyd-Max codes of a rotated unit vector: relative MSE ~0.009 per coordinate, less after centring.
    assert 0 < coded < 0.12
    assert relative_error(got_rope[..., 4:92, :], rope[..., 4:92, :]) < 0.01  # 8-bit RoPE codes


def test_more_bits_less_error_and_centring_helps_an_offset_latent():
    latent, rope = tokens(64)
    errors = {}
    for bits, center in ((2, True), (4, True), (4, False)):
        cache = CompressedLatentCache(config(bits, sinks=0, window=0, center=center))
        cache.update_and_fetch(latent, rope)
        errors[bits, center] = relative_error(cache.fetch()[0], latent)
    assert errors[4, True] < errors[2, True] / 2
    assert errors[4, True] < errors[4, False]


def test_decode_steps_follow_the_window_and_bytes_are_below_fp16():
    latent, rope = tokens(60)
    cache = CompressedLatentCache(config())
    cache.update_and_fetch(latent[..., :50, :], rope[..., :50, :])
    before = cache.fetch()
    for t in range(50, 60):
        out_latent, out_rope = cache.update_and_fetch(latent[..., t:t + 1, :], rope[..., t:t + 1, :])
        assert out_latent.shape[-2] == t + 1 and out_rope.shape[-2] == t + 1
    after = cache.fetch()
    assert mx.array_equal(after[0][..., :42, :], before[0][..., :42, :]).item()  # codes are written once
    assert cache.encoded == 60 - 4 - 8
    used = sum(v[..., :cache.encoded, :].nbytes for v in cache.coded.values())
    assert used < 0.4 * cache.encoded * (RANK + ROPE) * 2  # against fp16
    from veloxquant_mlx.footprint import footprint

    seen = footprint([cache])
    assert seen.held == cache.used_nbytes == used + 12 * (RANK + ROPE) * 2 + cache.mean.nbytes
    assert seen.tokens == 60 and 4 < seen.bits < 16
    assert cache.nbytes >= used + 12 * (RANK + ROPE) * 2  # allocated: the codes' spare capacity, sinks, window


def test_trim_and_mlx_lm_prompt_cache_files_round_trip(tmp_path):
    latent, rope = tokens(40)
    cache = CompressedLatentCache(config())
    cache.update_and_fetch(latent, rope)
    path = str(tmp_path / "latent.safetensors")
    mlx_cache.save_prompt_cache(path, [cache])
    loaded = mlx_cache.load_prompt_cache(path)[0]
    assert type(loaded) is CompressedLatentCache and loaded.offset == 40
    for a, b in zip(loaded.fetch(), cache.fetch()):
        assert mx.array_equal(a, b).item()
    full = cache.fetch()
    assert cache.trim(15) == 15 and cache.offset == 25
    for a, b in zip(cache.fetch(), full):
        assert mx.array_equal(a, b[..., :25, :]).item()
    cache.update_and_fetch(latent[..., 25:26, :], rope[..., 25:26, :])
    assert cache.fetch()[0].shape[-2] == 26


@pytest.fixture(scope="module")
def tiny_deepseek_v3():
    from veloxquant_mlx.evaluation.models_matrix import build_model

    return build_model("deepseek_v3")[0]


def test_tiny_deepseek_v3_decodes_close_to_mlx_lm_caches(tiny_deepseek_v3):
    from veloxquant_mlx.evaluation.models_matrix import kl_and_max, run_caches
    model = tiny_deepseek_v3
    ids = mx.random.randint(0, 512, (72,), key=mx.random.key(3))
    reference = run_caches(model, mlx_cache.make_prompt_cache(model), ids, 64)
    caches = compressed_caches(model, KVCacheConfig.preset("vq4"))
    assert all(type(c) is CompressedLatentCache for c in caches)
    logits = run_caches(model, caches, ids, 64)
    kl, _ = kl_and_max(reference, logits)
    assert 0 < kl < 2e-3
    with pytest.raises(UnsupportedModelError, match="rotating cache"):
        compressed_caches(model, KVCacheConfig.preset("vq4"), max_kv_size=32)


def test_a_latent_without_rope_part_is_cached():
    latent, _ = tokens(20)
    cache = CompressedLatentCache(config(window=4))
    cache.update_and_fetch(latent, mx.zeros((1, 1, 20, 0)))
    got_latent, got_rope = cache.fetch()
    assert got_rope.shape == (1, 1, 20, 0) and relative_error(got_latent, latent) < 0.12


def test_the_librarys_checked_files_round_trip_a_latent_and_refuse_another_config_or_an_edit(
        tiny_deepseek_v3, tmp_path):
    from veloxquant_mlx.cache.errors import CacheFormatError
    from veloxquant_mlx.integration import load_prompt_cache, save_prompt_cache

    model = tiny_deepseek_v3
    caches = compressed_caches(model, KVCacheConfig.preset("vq4"))
    mx.eval(model(mx.random.randint(0, 512, (1, 60), key=mx.random.key(4)), cache=caches))
    path = str(tmp_path / "latent.safetensors")
    save_prompt_cache(path, caches, {"note": "x"})
    loaded = load_prompt_cache(path, KVCacheConfig.preset("vq4"), model=model)
    step = mx.array([[7]])
    assert mx.array_equal(model(step, cache=loaded), model(step, cache=caches)).item()
    with pytest.raises(CacheFormatError, match="latent cache made with"):
        load_prompt_cache(path, KVCacheConfig.preset("vq3"), model=model)
    arrays, metadata = mx.load(path, return_metadata=True)
    name = next(k for k in arrays if "coded" in k)
    arrays[name] = arrays[name] + 1
    edited = str(tmp_path / "edited.safetensors")
    mx.save_safetensors(edited, arrays, metadata)
    with pytest.raises(CacheFormatError, match="is not the layer saved in that position"):
        load_prompt_cache(edited, KVCacheConfig.preset("vq4"), model=model)


# ---- batches of latent caches (batch_latent.py), as mlx-lm's BatchGenerator and server make them ------------

def _histories(model, lengths, seed):
    rows = []
    for i, n in enumerate(lengths):
        caches = compressed_caches(model, KVCacheConfig.preset("vq4"))
        mx.eval(model(mx.random.randint(0, 512, (1, n), key=mx.random.key(seed + i)), cache=caches))
        rows.append(caches)
    return rows


@pytest.mark.parametrize("name", ["deepseek_v3", "kimi_linear", "plamo"])
def test_a_batch_with_histories_and_right_padded_prompts_decodes_as_its_rows_alone(name):
    """Rows with different histories merged, then new prompts of different lengths right-padded into one chunk
    (`prepare` / `finalize`, as `BatchGenerator` feeds them), then two decode steps: each row's logits are its
    own alone. Kimi-Linear mixes the latent batch with mlx-lm's batched `ArraysCache`; PLaMo, whose batch of
    compressed rows returns decoded arrays too (`fetch_decoded`), gets the same padded columns."""
    import copy

    from mlx_lm.generate import _merge_caches

    from veloxquant_mlx.batch_latent import BatchLatentCache
    from veloxquant_mlx.evaluation.models_matrix import build_model

    model, _ = build_model(name)
    rows = _histories(model, [20, 35, 50], seed=10)
    alone = copy.deepcopy(rows)
    batch = _merge_caches(rows)
    assert any(isinstance(layer, BatchLatentCache) for layer in batch) == (name != "plamo")
    lengths = [30, 12, 21]
    prompts = [mx.random.randint(0, 512, (1, n), key=mx.random.key(20 + i)) for i, n in enumerate(lengths)]
    padding = [max(lengths) - n for n in lengths]
    chunk = mx.concatenate([mx.pad(p, [(0, 0), (0, pad)]) for p, pad in zip(prompts, padding)])
    for layer in batch:
        layer.prepare(lengths=lengths, right_padding=padding)
    mx.eval(model(chunk, cache=batch))
    for layer in batch:
        layer.finalize()
    steps = [mx.array([[3], [4], [5]]), mx.array([[7], [8], [9]])]
    together = [model(step, cache=batch)[:, -1] for step in steps]
    for i, caches in enumerate(alone):
        mx.eval(model(prompts[i], cache=caches))
        for step, logits in zip(steps, together):
            assert mx.allclose(logits[i], model(step[i : i + 1], cache=caches)[0, -1], atol=1e-4).item()
    extracted = [layer.extract(1) for layer in batch]  # a row's own cache back, as a prompt cache
    step = mx.array([[11]])
    assert mx.allclose(model(step, cache=extracted), model(step, cache=alone[1]), atol=1e-4).item()


def test_batch_generate_on_latent_caches_matches_each_sequence_alone(tiny_deepseek_v3):
    """mlx-lm's `batch_generate` (merge, right padding, `filter` as sequences stop, `extract` into prompt
    caches): each sequence's tokens are those it generates alone."""
    from mlx_lm.generate import batch_generate, generate_step
    from mlx_lm.sample_utils import make_sampler

    from veloxquant_mlx.integration import patch_model, unpatch_model

    class Tok:
        eos_token_ids = {511}
        eos_token_id = 511

        def decode(self, ids):
            return " ".join(map(str, ids))

    model = tiny_deepseek_v3
    prompts = [mx.random.randint(0, 500, (n,), key=mx.random.key(30 + n)).tolist() for n in (40, 13, 27)]
    limits = [6, 3, 5]
    theirs = batch_generate(model, Tok(), prompts, max_tokens=limits, return_prompt_caches=True).caches
    patch_model(model, KVCacheConfig.preset("vq4"))
    try:
        response = batch_generate(model, Tok(), prompts, max_tokens=limits, return_token_ids=True,
                                  return_prompt_caches=True)
        for prompt, ids, limit, cache, own in zip(prompts, response.token_ids, limits, response.caches, theirs):
            steps = generate_step(mx.array(prompt), model, prompt_cache=model.make_cache(), sampler=make_sampler(0.0))
            assert ids == [int(token) for (token, _), _ in zip(steps, range(limit))]
            assert all(type(layer) is CompressedLatentCache for layer in cache)
            assert [layer.offset for layer in cache] == [layer.offset for layer in own]
    finally:
        unpatch_model(model)


def test_a_latent_batch_file_state_round_trips_and_a_corrupt_header_is_refused(tiny_deepseek_v3):
    from veloxquant_mlx.batch_latent import BatchLatentCache
    from veloxquant_mlx.cache.errors import CacheFormatError

    model = tiny_deepseek_v3
    rows = _histories(model, [25, 40], seed=40)
    batch = [CompressedLatentCache.merge(layer) for layer in zip(*rows)]
    loaded = [BatchLatentCache.from_state(layer.state) for layer in batch]
    step = mx.array([[3], [4]])
    assert mx.array_equal(model(step, cache=loaded), model(step, cache=batch)).item()
    header, states = batch[0].state
    with pytest.raises(CacheFormatError, match="corrupted latent batch"):
        BatchLatentCache.from_state([header, states[:1]])
    with pytest.raises(CacheFormatError, match="unreadable header"):
        BatchLatentCache.from_state(["{", states])
