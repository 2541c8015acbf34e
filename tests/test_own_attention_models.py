"""Models whose attention does not go through mlx-lm's shared attention: DeepSeek-V4.1's layer cache in MLX's
microscaling formats holds exactly what mlx-lm's `LayerCache` holds, and a model that computes on its fetched keys
gets them decoded."""

import mlx.core as mx
import pytest
from mlx_lm.models import deepseek_v41

from veloxquant_mlx.cache.microscaled_layer import MicroscaledLayerCache, PackedRows
from veloxquant_mlx.config import KVCacheConfig
from veloxquant_mlx.evaluation import models_matrix
from veloxquant_mlx.footprint import footprint
from veloxquant_mlx.integration import compressed_caches

ROUNDINGS = {
    "mxfp8": lambda x: deepseek_v41._fake_quant_fp8(x, 32),
    "fp4_e4m3": lambda x: deepseek_v41._fake_quant_fp4(x, block_size=16, e4m3_scale=True),
    "mxfp4": lambda x: deepseek_v41._fake_quant_fp4(x, block_size=32),
}

BITS = {"mxfp8": 8 + 8 / 32, "fp4_e4m3": 4 + 8 / 32 + 8 / 16, "mxfp4": 4 + 8 / 32}


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("mode", sorted(ROUNDINGS))
def test_the_models_rounded_values_pack_and_unpack_bit_for_bit(mode, dtype):
    # Scales from 1e-5 (every e4m3-scaled FP4 block under the model's floor, which MLX's nvfp4 zeroes) to 1e3.
    mx.random.seed(3)
    for scale in (1e-5, 1e-3, 0.1, 1.0, 30.0, 1e3):
        x = mx.random.normal((2, 40, 128)) * scale * mx.exp(mx.random.normal((2, 40, 1)))
        x = ROUNDINGS[mode]((x * (mx.random.uniform(shape=x.shape) > 0.1)).astype(dtype))
        rows = PackedRows(mode)
        rows.set(x[:, :25])
        rows.extend(x)
        assert rows.get().dtype == dtype
        assert mx.array_equal(rows.get(), x).item(), (mode, scale)
        assert rows.nbytes == x.size * BITS[mode] / 8


def test_a_last_dim_that_is_not_a_multiple_of_32_is_kept_as_it_is():
    x = mx.random.normal((1, 5, 48))
    rows = PackedRows("mxfp4")
    rows.set(x)
    assert mx.array_equal(rows.get(), x).item() and rows.nbytes == x.nbytes


def test_deepseek_v41_runs_on_microscaled_caches_with_mlx_lm_logits_bit_for_bit():
    model, _ = models_matrix.build_model("deepseek_v41")
    tokens = mx.random.randint(0, 512, (72,), key=mx.random.key(1))
    theirs = model.make_cache()
    with pytest.warns(UserWarning, match="mxfp8/mxfp4.*does not apply"):
        ours = compressed_caches(model, KVCacheConfig(method="turboquant_mse", bits=4))
    assert all(type(c) is MicroscaledLayerCache for c in ours)
    reference = models_matrix.run_caches(model, theirs, tokens, 64)
    logits = models_matrix.run_caches(model, ours, tokens, 64)
    assert mx.array_equal(logits, reference).item()
    for mine, mlx_lms in zip(ours, theirs):
        for field in ("window", "compress_kv", "index_k", "pending_kv"):
            a, b = getattr(mine, field), getattr(mlx_lms, field)
            assert (a is None) == (b is None) and (a is None or mx.array_equal(a, b).item()), field
        assert mine.offset == mlx_lms.offset
    assert sum(c.nbytes for c in ours) < 0.3 * sum(c.nbytes for c in theirs)
    held = footprint(ours)
    assert held.held == sum(c.nbytes for c in ours)
    assert held.coordinates == sum(a.size for c in theirs for a in c.state[:-1] if a is not None)


@pytest.mark.parametrize("name", ["gemma2", "plamo"])
def test_a_model_that_computes_on_its_fetched_keys_gets_them_decoded_and_holds_codes(name):
    model, _ = models_matrix.build_model(name)
    caches = compressed_caches(model, KVCacheConfig(method="turboquant_mse", bits=4))
    tokens = mx.random.randint(0, 512, (1, 48), key=mx.random.key(2))
    mx.eval(model(tokens, cache=caches))
    layer = caches[0]
    assert layer.fetch_decoded and layer.used_nbytes < 0.3 * 2 * layer.decoded()[0].nbytes
    step = mx.random.normal((1, layer.kv_heads, 1, layer.key_dim))
    fetched = layer.update_and_fetch(step, step)
    assert all(isinstance(a, mx.array) for a in fetched)
    assert all(mx.array_equal(a, b).item() for a, b in zip(fetched, layer.decoded()))


def test_a_batch_of_decoded_fetch_rows_decodes_as_its_rows_do_alone():
    # PLaMo; Gemma 2's batched mask is broadcast against its grouped scores wrongly in mlx-lm itself (its own
    # BatchKVCache gives another next token than its KVCache), so it is no reference.
    from veloxquant_mlx.batch import BatchCompressedKVCache

    model, _ = models_matrix.build_model("plamo")
    rows = []
    for n, seed in ((50, 1), (70, 2)):
        caches = compressed_caches(model, KVCacheConfig.preset("vq4"))
        mx.eval(model(mx.random.randint(0, 512, (1, n), key=mx.random.key(seed)), cache=caches))
        rows.append(caches)
    batch = [BatchCompressedKVCache.merge(layer) for layer in zip(*rows)]
    step = mx.array([[3], [4]])
    together = model(step, cache=batch)[:, -1]
    for i, caches in enumerate(rows):
        alone = model(step[i:i + 1], cache=caches)[0, -1]
        assert mx.allclose(together[i], alone, atol=1e-4).item()


def test_a_loaded_cache_of_a_decoded_fetch_model_still_fetches_decoded(tmp_path):
    from veloxquant_mlx.integration import load_prompt_cache, save_prompt_cache

    model, _ = models_matrix.build_model("gemma2")
    caches = compressed_caches(model, KVCacheConfig.preset("vq4"))
    mx.eval(model(mx.random.randint(0, 512, (1, 40), key=mx.random.key(5)), cache=caches))
    path = str(tmp_path / "gemma2.safetensors")
    save_prompt_cache(path, caches)
    loaded = load_prompt_cache(path, KVCacheConfig.preset("vq4"), model=model)
    step = mx.array([[9]])
    assert mx.array_equal(model(step, cache=loaded), model(step, cache=caches)).item()
