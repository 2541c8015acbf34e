"""mlx-lm integration: builder, patch_model, config validation, artifacts, unsupported models."""

import sys
import types

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache

from conftest import config_for, tiny_llama
from veloxquant_mlx import (
    CompressedKVCache,
    KVCacheBuilder,
    KVCacheConfig,
    UnsupportedModelError,
    patch_model,
    unpatch_model,
)
from veloxquant_mlx.artifacts import ArtifactError, precompute


def greedy(model, prompt, n, cache=None):
    tokens = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=n, prompt_cache=cache):
        tokens.append(int(token))
    return tokens


def test_config_validation_and_aliases():
    with pytest.raises(ValueError, match="unknown KV cache method 'nope'; known methods: .*turboquant_mse"):
        KVCacheConfig(method="nope")
    with pytest.raises(ValueError, match="supports key bits"):
        KVCacheConfig(method="turboquant_mse", bits=9)
    with pytest.raises(ValueError, match="supports value bits"):
        KVCacheConfig(method="turboquant_mse", bits=4, value_bits=0)
    with pytest.raises(ValueError, match="has no option 'foo'"):
        KVCacheConfig(method="turboquant_mse", options={"foo": 1})
    with pytest.raises(TypeError, match="bits must be an int"):
        KVCacheConfig(bits=3.5)
    with pytest.raises(ValueError, match="residual_length must be >= 0"):
        KVCacheConfig(residual_length=-1)
    config = KVCacheConfig(algorithm="turboquant_mse", bit_width_inlier=3)
    assert (config.method, config.bits, config.value_bits) == ("turboquant_mse", 3, 3)
    with pytest.raises(ValueError, match="disagree"):
        KVCacheConfig(method="fp16", algorithm="turboquant_mse")
    assert KVCacheConfig.from_json(config.to_json()) == config


def test_builder_for_model_and_generate(model):
    caches = KVCacheBuilder(config_for("turboquant_mse", 4)).for_model(model).build()
    assert len(caches) == 2 and all(isinstance(c, CompressedKVCache) for c in caches)
    prompt = list(range(1, 40))
    tokens = greedy(model, prompt, 8, caches)
    # generate_step runs one step ahead of the tokens it yields.
    assert len(tokens) == 8 and caches[0].offset == len(prompt) + 8


def test_patch_model_gives_fresh_caches_each_call(model):
    config = config_for("turboquant_mse", 8)
    reference = greedy(model, list(range(1, 30)), 6)
    patch_model(model, config)
    try:
        first = model.make_cache()
        second = model.make_cache()
        assert first[0] is not second[0] and isinstance(first[0], CompressedKVCache)
        a = greedy(model, list(range(1, 30)), 6)
        b = greedy(model, list(range(1, 30)), 6)
        assert a == b  # no state shared between generations
        assert a == reference  # 8-bit codes do not change greedy tokens of this model
    finally:
        unpatch_model(model)
    assert type(model.make_cache()[0]) is KVCache


def test_gqa_and_per_layer_head_dims():
    model = tiny_llama(layers=2, hidden=192, heads=6, kv_heads=3)  # head dim 32
    caches = KVCacheBuilder(config_for("turboquant_mse", 4)).for_model(model).build()
    ref_cache = [KVCache() for _ in range(2)]
    tokens = mx.array([list(range(3, 70))])
    out = model(tokens, cache=caches)
    ref = model(tokens, cache=ref_cache)
    assert caches[0].key_dim == 32 and caches[0].kv_heads == 3
    assert mx.abs(out - ref).max().item() < 0.5 * mx.abs(ref).max().item()


def test_single_head_fluent_builder():
    cache = (
        KVCacheBuilder()
        .with_method("turboquant_prod" if "turboquant_prod" in _methods() else "turboquant_mse")
        .with_head_dim(128)
        .with_bit_width(inlier=4)
        .with_seed(42)
        .build()
    )
    mx.random.seed(0)
    k = mx.random.normal((200, 128))
    v = mx.random.normal((200, 128))
    cache.append(k[:150], v[:150])
    cache.append(k[150:], v[150:])
    assert len(cache) == 200
    q = mx.random.normal((128,))
    out = cache.attend(q)
    exact = mx.softmax((k @ q) / 128**0.5) @ v
    assert out.shape == (128,)
    # Near-uniform attention over random values: the output is small, so value noise dominates.
    assert (mx.linalg.norm(out - exact) / mx.linalg.norm(exact)).item() < 0.5
    assert 0 < cache.memory_bytes() < 0.4 * (200 * 128 * 2 * 2)  # capacity of 256 rows included
    with pytest.raises(ValueError, match="head dim 128"):
        cache.append(mx.zeros((1, 64)), mx.zeros((1, 64)))
    with pytest.raises(ValueError, match="for_model"):
        KVCacheBuilder().build()


def _methods():
    from veloxquant_mlx import available_methods

    return available_methods()


def test_sliding_window_layers_get_compressed_rotating_caches():
    from veloxquant_mlx import CompressedRotatingKVCache

    model = tiny_llama()
    model.model.layers[0].use_sliding = True
    model.model.swa_idx, model.model.sliding_window = 0, 16
    caches = KVCacheBuilder(config_for("fp16")).for_model(model).build()
    assert type(caches[0]) is CompressedRotatingKVCache and caches[0].max_size == 16
    assert isinstance(caches[1], CompressedKVCache)
    tokens = mx.array([list(range(40))])
    expected = model(tokens, cache=model.make_cache())
    assert mx.allclose(model(tokens, cache=caches), expected, atol=1e-2)
    assert caches[1].offset == caches[0].offset == 40 and caches[0].held == 40  # one chunk: all held


def test_model_bypassing_shared_attention_is_refused():
    module = types.ModuleType("fake_mlx_model")

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = [nn.Linear(4, 4)]

        def __call__(self, x, cache=None):
            return mx.fast.scaled_dot_product_attention(x, x, x, scale=1.0)

    Model.__module__ = module.__name__
    module.Model = Model
    sys.modules[module.__name__] = module
    try:
        with pytest.raises(UnsupportedModelError, match="without mlx-lm's shared scaled_dot_product_attention"):
            KVCacheBuilder(config_for("turboquant_mse", 4)).for_model(Model()).build()
    finally:
        del sys.modules[module.__name__]


def test_precomputed_artifacts_match_fresh_caches(tmp_path, model):
    config = config_for("turboquant_mse", 3, seed=7)
    precompute(model, config, tmp_path / "art")
    loaded = KVCacheBuilder(config.replace(artifact_dir=str(tmp_path / "art"))).for_model(model).build()
    fresh = KVCacheBuilder(config).for_model(model).build()
    tokens = mx.array([list(range(5, 60))])
    a = model(tokens, cache=loaded)
    b = model(tokens, cache=fresh)
    assert mx.array_equal(a, b).item()
    for x, y in zip(loaded, fresh):
        for name in x.key_fields:
            assert mx.array_equal(x.key_fields[name], y.key_fields[name]).item()

    with pytest.raises(ArtifactError, match="made for turboquant_mse K3/V3 .* not turboquant_mse K4/V4"):
        KVCacheBuilder(config.replace(bits=4, value_bits=4, artifact_dir=str(tmp_path / "art"))).for_model(model).build()
    other = tiny_llama(layers=3)
    with pytest.raises(ArtifactError, match="made for another model"):
        KVCacheBuilder(config.replace(artifact_dir=str(tmp_path / "art"))).for_model(other).build()
    with pytest.raises(ArtifactError, match="is incomplete"):
        KVCacheBuilder(config.replace(artifact_dir=str(tmp_path / "missing"))).for_model(model).build()


def test_artifact_dir_serves_sinks_window_centering_and_renorm(tmp_path, model):
    # an artifact dir holds codebooks and rotations only; it was refused for the same method with
    # sinks or a window, which change neither
    plain = config_for("turboquant_mse", 4, seed=3)
    precompute(model, plain, tmp_path / "art")
    protected = plain.replace(sink_tokens=4, residual_length=8, center=True, options={"renorm": True})
    loaded = KVCacheBuilder(protected.replace(artifact_dir=str(tmp_path / "art"))).for_model(model).build()
    fresh = KVCacheBuilder(protected).for_model(model).build()
    tokens = mx.array([list(range(5, 40))])
    assert mx.array_equal(model(tokens, cache=loaded), model(tokens, cache=fresh)).item()
    with pytest.raises(ArtifactError, match="differ in seed"):
        KVCacheBuilder(protected.replace(seed=4, artifact_dir=str(tmp_path / "art"))).for_model(model).build()


def test_published_keyword_spellings():
    # kivi_group_size= gave a bare TypeError
    assert KVCacheConfig(method="kivi", kivi_group_size=32).group_size == 32
    config = KVCacheConfig(method="kivi", k_bits=2, v_bits=4, kv_group_size=16)
    assert (config.bits, config.value_bits, config.group_size) == (2, 4, 16)
    assert KVCacheConfig(kv_bits=3).value_bits == 3
    with pytest.raises(ValueError, match="group_size=16 and kivi_group_size=32 disagree"):
        KVCacheConfig(method="kivi", group_size=16, kivi_group_size=32)
    with pytest.raises(TypeError, match="no keyword 'group_sise'; did you mean group_size="):
        KVCacheConfig(group_sise=32)
    with pytest.raises(ValueError, match="group_size is a KVCacheConfig field"):
        KVCacheConfig(method="kivi", options={"kivi_group_size": 32})


def test_artifact_head_dim_mismatch(tmp_path, model):
    from veloxquant_mlx.artifacts import load_artifacts

    config = config_for("turboquant_mse", 3)
    precompute(model, config, tmp_path / "art")
    codecs = load_artifacts(config.replace(artifact_dir=str(tmp_path / "art")))
    cache = CompressedKVCache(config, codecs)
    with pytest.raises(ArtifactError, match="no keys codec for head dim 128"):
        cache.update_and_fetch(mx.zeros((1, 1, 4, 128)), mx.zeros((1, 1, 4, 128)))


# Each length costs two prefills of a 4-layer model: `make test` prefills 2048 tokens, `make test-all` 4096 too.
@pytest.mark.parametrize("length", [2048, pytest.param(4096, marks=pytest.mark.slow)])
def test_prefill_peak_memory_not_above_fp16(length):
    """A long chunked prefill (1024-token chunks) through the compressed cache peaks no higher than
    mlx-lm's fp16 cache."""
    model = tiny_llama(layers=4, hidden=512, heads=8, kv_heads=2, vocab=256)
    tokens = mx.random.randint(0, 256, (1, length))

    def peak(caches):
        mx.clear_cache()
        mx.reset_peak_memory()
        for start in range(0, tokens.shape[1], 1024):
            logits = model(tokens[:, start : start + 1024], cache=caches)
            mx.eval(logits, [c.state for c in caches])
        return mx.get_peak_memory()

    fp16 = peak([KVCache() for _ in model.layers])
    ours = peak(KVCacheBuilder(config_for("turboquant_mse", 3)).for_model(model).build())
    assert ours <= fp16, (ours, fp16)
