"""rabitq: RaBitQ keys (1-bit and extended B-bit codes, unbiased estimator) + TurboQuant-MSE values."""

import math

import mlx.core as mx
import numpy as np
import pytest

from conftest import assert_engine_paths_agree

from veloxquant_mlx import CompressedKVCache, KVCacheConfig
from veloxquant_mlx.integration import KVCacheBuilder, load_prompt_cache, save_prompt_cache
from veloxquant_mlx.methods.rabitq import RaBitQCodec
from veloxquant_mlx.methods.turboquant_mse import MSECodec
from veloxquant_mlx.storage import stored_bits_per_token


def _estimates(bits, seeds, k, q):
    """RaBitQ's estimate of <q_i, k_i> under `seeds` random rotations (seeds, n), and the same
    estimate without the 1/<o_bar, o> correction."""
    corrected, uncorrected = [], []
    for seed in range(seeds):
        codec = RaBitQCodec(k.shape[-1], bits, seed)
        fields = codec.encode(k)
        est = mx.diagonal(codec.score(codec.to_domain(q), fields)[0, 0])
        corrected.append(est)
        uncorrected.append(est * fields["alignment"][0, 0, :, 0].astype(mx.float32))
    return mx.stack(corrected), mx.stack(uncorrected)


@pytest.mark.parametrize("bits", [1, 2])
def test_estimator_is_unbiased_over_random_rotations(bits):
    # Thm 3.2 of arXiv 2405.12497: E[<o_bar, q> / <o_bar, o>] = <o, q> over the rotation. Keys and
    # queries are correlated, so the scores are large and a shrunk estimator is far off.
    n, seeds = 8, 300
    k = mx.random.normal((1, 1, n, 64), key=mx.random.key(11))
    q = k + 0.5 * mx.random.normal((1, 1, n, 64), key=mx.random.key(12))
    true = mx.sum(q * k, axis=-1)[0, 0]
    corrected, uncorrected = _estimates(bits, seeds, k, q)

    def mean_and_bound(est):
        rel = np.array((est - true) / true).ravel()  # seeds x pairs relative errors
        return abs(rel.mean()), 4 * rel.std() / math.sqrt(rel.size)

    mean, bound = mean_and_bound(corrected)
    assert mean < bound and mean < 0.01, (mean, bound)
    # the same test fails for the estimator without RaBitQ's second scalar (biased towards 0)
    biased_mean, biased_bound = mean_and_bound(uncorrected)
    assert biased_mean > 10 * biased_bound, (biased_mean, biased_bound)


def test_codes_and_scalars_are_the_papers():
    codec = RaBitQCodec(64, 1, 3)
    k = mx.random.normal((1, 2, 5, 64), key=mx.random.key(1))
    fields = codec.encode(k)
    rotated = codec.rotation.apply(k)
    unit = rotated / mx.sqrt(mx.sum(k * k, axis=-1, keepdims=True))
    # 1 bit: the sign of the rotated key, and <o_bar, o> = ||o'||_1 / sqrt(D)
    assert mx.array_equal(codec._codes(fields), (rotated >= 0).astype(mx.float32)).item()
    alignment = mx.sum(mx.abs(unit), axis=-1, keepdims=True) / 8
    assert mx.allclose(fields["alignment"].astype(mx.float32), alignment, atol=1e-3).item()
    # B bits: a code's cosine with the key is at least the 1-bit code's, and grows with B
    cosines = [mx.mean(RaBitQCodec(64, b, 3).encode(k)["alignment"].astype(mx.float32)).item() for b in (1, 2, 3, 4)]
    assert all(a < b for a, b in zip(cosines, cosines[1:])) and cosines[0] > 0.75, cosines
    for bits in (1, 2, 3):
        codec = RaBitQCodec(64, bits, 3)
        fields = codec.encode(k)
        q = codec.to_domain(mx.random.normal((1, 2, 3, 64), key=mx.random.key(2)))
        # `score` from the packed words = the decoded vectors' dot products
        assert mx.allclose(codec.score(q, fields), q @ codec.decode(fields).swapaxes(-1, -2), rtol=1e-4, atol=1e-3).item()
    zero = codec.decode(codec.encode(mx.zeros((1, 1, 2, 64))))
    assert mx.array_equal(zero, mx.zeros_like(zero)).item()


def test_score_error_shrinks_with_bits_and_beats_turboquant_mse_bias():
    k = mx.random.normal((1, 4, 256, 64), key=mx.random.key(5))
    q = mx.random.normal((1, 4, 16, 64), key=mx.random.key(6))
    true = q @ k.swapaxes(-1, -2)
    errors = []
    for bits in (1, 2, 3, 4):
        codec = RaBitQCodec(64, bits, 0)
        est = codec.score(codec.to_domain(q), codec.encode(k))
        errors.append(mx.sqrt(mx.mean((est - true) ** 2)).item())
    assert all(a > 1.6 * b for a, b in zip(errors, errors[1:])), errors
    # turboquant_mse's Lloyd-Max reconstruction shrinks every score; RaBitQ's does not
    mse = MSECodec(64, 1, 0)
    shrink = mx.sum(true * (q @ mse.reconstruct(mse.encode(k)).swapaxes(-1, -2))) / mx.sum(true * true)
    codec = RaBitQCodec(64, 1, 0)
    ratio = mx.sum(true * codec.score(codec.to_domain(q), codec.encode(k))) / mx.sum(true * true)
    assert shrink.item() < 0.85 and abs(ratio.item() - 1) < 0.05, (shrink.item(), ratio.item())


@pytest.mark.parametrize("bits,value_bits", [(1, 4), (2, 4), (3, 2)])
def test_bytes_per_token_match_the_format(bits, value_bits):
    config = KVCacheConfig(method="rabitq", bits=bits, value_bits=value_bits)
    cache = CompressedKVCache(config)
    T, heads, dim = 1024, 3, 64
    k = mx.random.normal((1, heads, T, dim), key=mx.random.key(0)) * 2
    v = mx.random.normal((1, heads, T, dim), key=mx.random.key(1))
    for start, size in ((0, 300), (300, 1), (301, 211), (512, 512)):
        cache.update_and_fetch(k[..., start : start + size, :], v[..., start : start + size, :])
    mx.eval(cache.state)
    # keys: D*B code bits + two fp16 scalars; values: TurboQuant-MSE's D*b + fp16 norm
    assert cache.key_codec.bits_per_token() == dim * bits + 32
    assert cache.value_codec.bits_per_token() == dim * value_bits + 16
    # Stored in rows: the three fp16 scalars take two words, a half word of padding per token.
    assert stored_bits_per_token(cache.key_codec, cache.value_codec) == dim * (bits + value_bits) + 64
    expected = (dim * (bits + value_bits) + 64) / 8 * T * heads
    assert abs(cache.nbytes - expected) <= 0.03 * expected, (cache.nbytes, expected)


def test_unsupported_widths_are_refused():
    with pytest.raises(ValueError, match="rabitq supports key bits 1..4"):
        KVCacheConfig(method="rabitq", bits=5, value_bits=4)


SPECS = {
    "1bit-centered-sinks": KVCacheConfig(method="rabitq", bits=1, value_bits=4, center=True, sink_tokens=2),
    "2bit-window": KVCacheConfig(method="rabitq", bits=2, value_bits=3, residual_length=8),
    "3bit": KVCacheConfig(method="rabitq", bits=3, value_bits=4),
}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_engine_paths_agree(small, name):
    assert_engine_paths_agree(small, SPECS[name], mx.array(np.random.default_rng(8).integers(0, 512, 100)))


def test_prompt_cache_saves_and_loads(small, tmp_path):
    config = KVCacheConfig(method="rabitq", bits=1, value_bits=4, sink_tokens=2, residual_length=4)
    caches = KVCacheBuilder(config).for_model(small).build()
    tokens = mx.array(np.random.default_rng(5).integers(0, 512, 80))
    mx.eval(small(tokens[None], cache=caches))
    save_prompt_cache(tmp_path / "c.safetensors", caches)
    nxt = mx.array([[7]])
    expected = small(nxt, cache=caches)
    for kwargs in ({"config": config}, {}):
        loaded = load_prompt_cache(tmp_path / "c.safetensors", **kwargs)
        assert isinstance(loaded[0].key_codec, RaBitQCodec)
        assert mx.array_equal(small(nxt, cache=loaded), expected).item()
    with pytest.raises(Exception, match="rabitq|bits|config"):
        load_prompt_cache(tmp_path / "c.safetensors", config=config.replace(bits=2, value_bits=4))


@pytest.mark.model
def test_generates_coherent_text_on_smollm2(smollm2, chat_reference):
    """Centred 2-bit keys / 4-bit values, teacher-forced over the fp16 model's first 16 greedy tokens of
    a chat answer: the compressed cache predicts at least 10 of them (measured 12) with a mean KL below
    1.0 (measured 0.48)."""
    from conftest import agreement_with_reference, forced_logprobs

    model, _ = smollm2
    prompt, tokens, reference = chat_reference
    caches = KVCacheBuilder(KVCacheConfig(method="rabitq", bits=2, value_bits=4, center=True)).for_model(model).build()
    agree, kl = agreement_with_reference(reference, tokens, forced_logprobs(model, prompt, tokens, caches))
    assert agree >= 10 and kl < 1.0, (agree, kl)


@pytest.mark.skipif(__import__("veloxquant_mlx.kernels.emulator").kernels.emulator.compiler() is None,
                    reason="no C++20 compiler for the kernel emulator")
@pytest.mark.parametrize("bits", [1, 3])
def test_encode_kernel_stores_what_encode_does(bits):
    """The encode snippet (emulated, head dim 128, fp16 inputs): the rows of `encode`. A B-bit code is
    the best of 24 rescalings by two block sums each, summed in another order than MLX's, so a token
    whose two best cosines lie within float rounding may take the other code: at most 1% of tokens,
    each with a cosine within 1e-3 of `encode`'s; every other token's codes and scalars are `encode`'s."""
    from veloxquant_mlx.kernels import encode, ops
    from veloxquant_mlx.storage import row_layout

    kc, vc = RaBitQCodec(128, bits, 1), MSECodec(128, 3, 2)
    layout = row_layout(kc, vc)
    assert encode.supported(layout, kc, vc)
    keys = mx.random.normal((1, 2, 300, 128), key=mx.random.key(bits)).astype(mx.float16)
    values = mx.random.normal((1, 2, 300, 128), key=mx.random.key(9)).astype(mx.float16)
    got, _ = layout.views(encode.encode_rows(ops.runner("emulator"), layout, kc, vc, keys, values))
    ref = kc.encode(keys)
    same = mx.all(got["codes"] == ref["codes"], axis=-1)  # (1, 2, 300) tokens with equal codes
    assert float(mx.mean(same)) >= 0.99
    for name in ("scale", "alignment"):
        a, b = got[name].astype(mx.float32)[..., 0], ref[name].astype(mx.float32)[..., 0]
        assert float(mx.max(mx.where(same, mx.abs(a - b) / mx.abs(b), 0.0))) <= 2 ** -10, name
    cosines = got["alignment"].astype(mx.float32)[..., 0], ref["alignment"].astype(mx.float32)[..., 0]
    assert float(mx.max(mx.where(same, 0.0, mx.abs(cosines[0] - cosines[1])))) <= 1e-3
    if bits == 1:  # one code, no search: the same rows
        assert bool(mx.all(same).item())
