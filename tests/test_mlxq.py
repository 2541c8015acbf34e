"""mlxq: rotated keys/values in MLX's own quantized format, and the presets' fallback to it."""

import warnings

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import QuantizedKVCache

from conftest import assert_engine_paths_agree, forced_logprobs
from veloxquant_mlx import EngineSettings, KVCacheBuilder, KVCacheConfig, presets
from veloxquant_mlx.methods.mlxq import MLXQuantCodec
from veloxquant_mlx.texts import sample_text_path


@pytest.mark.parametrize("bits,group", [(4, 32), (8, 64), (3, 64)])
def test_round_trip_errs_at_most_a_step_in_the_rotated_space(bits, group):
    codec = MLXQuantCodec(64, bits, group, seed=0)
    x = mx.random.normal((1, 2, 40, 64), key=mx.random.key(1)) * 3.0
    fields = codec.encode(x)
    assert fields["codes"].shape[-1] == codec.format.field("codes").words
    rotated = codec.to_domain(x).astype(mx.float16).astype(mx.float32)
    step = mx.abs(mx.repeat(fields["scales"].astype(mx.float32), group, axis=-1))  # MLX signs the scale
    err = mx.abs(codec.decode(fields) - rotated)
    # MLX's affine codes hold 0 exactly (its bias is an edge moved onto the grid), so an element errs by up to
    # one step, not half of one; plus fp16 rounding of the dequantized value
    assert mx.all(err <= 1.05 * step + 2e-3 * mx.abs(rotated)).item(), float(mx.max(err / step))
    assert float(mx.mean(err / step)) < 0.3
    # the rotation is orthogonal: the original vectors come back to within the same error
    back = codec.reconstruct(fields)
    assert float(mx.max(mx.abs(back - x))) < float(mx.max(step)) * 64 ** 0.5
    # attention's products straight from the codes equal those of the decoded vectors
    q = mx.random.normal((1, 2, 3, 64), key=mx.random.key(2))
    assert mx.allclose(codec.score(q, fields), q @ codec.decode(fields).swapaxes(-1, -2), rtol=1e-4, atol=1e-3).item()
    p = mx.softmax(mx.random.normal((1, 2, 2, 1, 40), key=mx.random.key(3)), axis=-1)
    assert mx.allclose(codec.weighted_sum(p, fields), p @ mx.expand_dims(codec.decode(fields), 2),
                       rtol=1e-4, atol=1e-4).item()


def test_invalid_widths_and_groups_are_refused():
    with pytest.raises(ValueError, match="bits"):
        KVCacheConfig(method="mlxq", bits=7, value_bits=4)
    with pytest.raises(ValueError, match="group size"):
        MLXQuantCodec(64, 4, 48, seed=0)


def test_engine_paths_agree(small):
    config = KVCacheConfig(method="mlxq", bits=4, group_size=32, sink_tokens=4, residual_length=16, center=True)
    assert_engine_paths_agree(small, config, mx.array(np.random.default_rng(8).integers(0, 512, 100)))


def _kl(reference, logprobs):
    return float(mx.mean(mx.sum(mx.exp(reference) * (reference - logprobs), axis=-1)))


def test_kl_is_a_fraction_of_mlx_quantized_cache_at_the_same_bits(smollm2):
    """SmolLM2 teacher-forced on 8 tokens after a 160-token prompt of the packaged text: mlxq4's KL to the
    fp16 cache's predictions in the same run is well under that of mlx-lm's QuantizedKVCache at 4 bits."""
    model, tokenizer = smollm2
    ids = tokenizer.encode(sample_text_path().read_text()[:6000])[:168]
    prompt, forced = ids[:160], ids[160:]
    reference = forced_logprobs(model, prompt, forced)
    ours = forced_logprobs(model, prompt, forced, KVCacheBuilder(presets.preset_config("mlxq4")).for_model(model).build())
    theirs = forced_logprobs(model, prompt, forced, [QuantizedKVCache(group_size=64, bits=4) for _ in model.layers])
    kl_ours, kl_theirs = _kl(reference, ours), _kl(reference, theirs)
    assert kl_ours < kl_theirs / 2, (kl_ours, kl_theirs)


def test_presets_fall_back_to_mlxq_where_kernels_are_unusable_and_say_so_once(monkeypatch):
    monkeypatch.setattr(presets, "_ANNOUNCED", set())
    portable = EngineSettings.resolve(backend="portable")
    with pytest.warns(RuntimeWarning, match="preset vq3 resolves to mlxq4"):
        assert presets.resolved_preset("vq3", portable) == "mlxq4"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert presets.resolved_preset("vq3", portable) == "mlxq4"  # said once
        assert presets.resolved_preset("mlxq8", portable) == "mlxq8"  # not a kernel preset
        assert presets.resolved_preset("vq3", EngineSettings.resolve(backend="emulator")) == "vq3"
    # where the kernels pass their check, `KVCacheConfig.preset` keeps the kernel preset
    monkeypatch.setattr(presets, "kernels_usable", lambda settings=None: True)
    assert KVCacheConfig.preset("vq4") == presets.preset_config("vq4")
    monkeypatch.setattr(presets, "kernels_usable", lambda settings=None: False)
    with pytest.warns(RuntimeWarning, match="preset vq4 resolves to mlxq4"):
        assert KVCacheConfig.preset("vq4").method == "mlxq"
