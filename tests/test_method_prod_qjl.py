"""turboquant_prod (TurboQuant Alg. 2) and qjl (QJL): unbiased scores, their variance,
reconstruction error, exact storage, params round trip, cache end to end, config checks."""

import math
from functools import lru_cache

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.cache import CompressedKVCache
from veloxquant_mlx.codebooks import lloyd_max
from veloxquant_mlx.config import KVCacheConfig
from veloxquant_mlx.methods import get_method
from veloxquant_mlx.methods.qjl import GroupAffineCodec, QJLCodec
from veloxquant_mlx.methods.turboquant_mse import MSECodec
from veloxquant_mlx.methods.turboquant_prod import ProdCodec

D = 128
SEEDS = 2000


def _pair():
    """A fixed (q, x) with a large inner product (cos ~ 0.7), so multiplicative bias shows."""
    rng = np.random.default_rng(20240531)
    x = rng.standard_normal(D)
    q = 0.7 * x + 0.7 * rng.standard_normal(D)
    return q, x


def _d_mse(bits, dim=D):
    """TurboQuant_mse distortion E||x - x_mse||^2 / ||x||^2 = d * (per-coordinate Lloyd-Max MSE)."""
    return dim * lloyd_max("sphere", bits, dim).mse


@lru_cache(maxsize=None)
def _estimates(method, bits, seeds=SEEDS):
    """Score estimates <to_domain(q), decode(encode(x))> for one fixed (q, x) over `seeds`
    independently seeded codecs, and (prod only) each codec's exact conditional variance
    E_S[(est - <q, x>)^2 | R] = (pi/2 ||q||^2 ||r||^2 - <q, r>^2) / m."""
    q_np, x_np = _pair()
    q = mx.array(q_np, dtype=mx.float32)
    x = mx.array(x_np, dtype=mx.float32).reshape(1, 1, 1, D)
    scores, cond_var = [], []
    for seed in range(seeds):
        if method == "prod":
            codec = ProdCodec(D, bits, seed)
        elif method == "qjl":
            codec = QJLCodec(D, bits * D, seed)
        else:
            codec = MSECodec(D, bits, seed)
        fields = codec.encode(x)
        scores.append(mx.sum(codec.to_domain(q) * codec.decode(fields)))
        if method == "prod":
            r = (x - codec.mse.reconstruct(fields)).reshape(D)
            m = codec.sketch_dim
            cond_var.append((math.pi / 2 * mx.sum(q * q) * mx.sum(r * r) - mx.sum(q * r) ** 2) / m)
        if seed % 200 == 199:
            mx.eval(scores, cond_var)
    scores = np.array(mx.stack(scores), dtype=np.float64)
    cond_var = np.array(mx.stack(cond_var), dtype=np.float64) if cond_var else None
    return scores, cond_var, float(q_np @ x_np), float(q_np @ q_np), float(x_np @ x_np)


def _standard_error(scores):
    return scores.std(ddof=1) / math.sqrt(len(scores))


@pytest.mark.parametrize("method,bits", [("prod", 2), ("prod", 3), ("prod", 4), ("qjl", 1), ("qjl", 2)])
def test_scores_are_unbiased(method, bits):
    scores, _, truth, _, _ = _estimates(method, bits)
    se = _standard_error(scores)
    assert abs(scores.mean() - truth) < 3 * se, (scores.mean(), truth, se)


@pytest.mark.parametrize("bits", [1, 2])
def test_turboquant_mse_scores_are_biased(bits):
    """The same test fails for plain TurboQuant_mse: Lloyd-Max centroids give
    E<x_mse, x> = E||x_mse||^2, so E[x_mse] = (1 - D_mse) x (2/pi at 1 bit), a shrinkage."""
    scores, _, truth, _, _ = _estimates("mse", bits, seeds=1000)
    se = _standard_error(scores)
    assert abs(scores.mean() - truth) > 20 * se
    shrink = 1 - _d_mse(bits)
    assert abs(scores.mean() / truth - shrink) < 4 * se / truth, (scores.mean() / truth, shrink)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_prod_variance_matches_qjl_formula_and_thm2_bound(bits):
    scores, cond_var, truth, qq, xx = _estimates("prod", bits)
    var = scores.var(ddof=1)
    # Total variance over R and S = E_R[Var_S | R] (the estimate is unbiased given R).
    assert var == pytest.approx(cond_var.mean(), rel=0.1)
    # Which is at most (pi/2) D_mse(b-1) ||q||^2 ||x||^2 / m ...
    assert cond_var.mean() <= math.pi / 2 * _d_mse(bits - 1) * qq * xx / D * 1.05
    # ... and under TurboQuant Thm 2: D_prod <= sqrt(3) pi^2 / d * ||q||^2 ||x||^2 / 4^b.
    bound = math.sqrt(3) * math.pi**2 / D * qq * xx / 4**bits
    assert var < bound, (var, bound)


@pytest.mark.parametrize("bits", [1, 2])
def test_qjl_variance_matches_lemma(bits):
    scores, _, truth, qq, xx = _estimates("qjl", bits)
    expected = (math.pi / 2 * qq * xx - truth**2) / (bits * D)  # QJL Lemma 3.2, exact
    assert scores.var(ddof=1) == pytest.approx(expected, rel=0.1)


def _gaussian(shape, seed=0, dtype=mx.float32):
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)


@pytest.mark.parametrize("bits,sketch_dim", [(2, None), (3, None), (4, None), (3, 2 * D)])
def test_prod_reconstruction_mse(bits, sketch_dim):
    """x~ = x_mse + r~ with r~ = ||r|| sqrt(pi/2)/m S^T sign(S r). E[r~] = r, and with
    s_i the rows of S: E||S^T z||^2 = m d + m(m-1) 2/pi, so
    E||x~ - x||^2 = E||r~ - r||^2 = D_mse(b-1) ||x||^2 (pi d/2 - 1) / m."""
    codec = ProdCodec(D, bits, 7, sketch_dim)
    x = _gaussian((1, 2, 2048, D), seed=bits)
    fields = codec.encode(x)
    rel = (mx.sum((codec.reconstruct(fields) - x) ** 2) / mx.sum(x * x)).item()
    m = codec.sketch_dim
    theory = _d_mse(bits - 1) * (math.pi * D / 2 - 1) / m
    assert rel == pytest.approx(theory, rel=0.1)
    # The MSE stage alone is better: the sketch only serves inner products.
    mse_rel = (mx.sum((codec.mse.reconstruct(fields) - x) ** 2) / mx.sum(x * x)).item()
    assert mse_rel == pytest.approx(_d_mse(bits - 1), rel=0.1)


@pytest.mark.parametrize("bits", [1, 4])
def test_qjl_inner_product_error(bits):
    """One codec, many Gaussian (q, k): the RMS score error is sqrt(pi/2 / m) ||q|| ||k||
    (Lemma 3.2, minus a negligible <q, k>^2 term); reconstructions are far worse."""
    codec = QJLCodec(D, bits * D, 3)
    k = _gaussian((1, 1, 4096, D), seed=1)
    q = _gaussian((4096, D), seed=2)
    est = mx.sum(codec.to_domain(q) * codec.decode(codec.encode(k))[0, 0], axis=-1)
    truth = mx.sum(q * k[0, 0], axis=-1)
    scale = mx.mean(mx.sum(q * q, -1) * mx.sum(k * k, -1)[0, 0]).item()
    rel_rms = math.sqrt(mx.mean((est - truth) ** 2).item() / scale)
    assert rel_rms == pytest.approx(math.sqrt(math.pi / 2 / (bits * D)), rel=0.1)
    recon = codec.reconstruct(codec.encode(k))
    rel_recon = (mx.sum((recon - k) ** 2) / mx.sum(k * k)).item()
    assert rel_recon == pytest.approx((math.pi * D / 2 - 1) / (bits * D), rel=0.1)


def _codecs(method, bits, dim, **kwargs):
    config = KVCacheConfig(method=method, bits=bits, **kwargs)
    cls = get_method(method)
    return config, cls.key_codec(config, dim), cls.value_codec(config, dim)


STORAGE_CASES = [
    ("turboquant_prod", 2, 128, {}),
    ("turboquant_prod", 4, 64, {"value_bits": 3}),
    ("turboquant_prod", 3, 96, {"options": {"sketch_dim": 100}}),
    ("qjl", 1, 128, {}),
    ("qjl", 4, 64, {"value_bits": 2}),
    ("qjl", 3, 96, {"group_size": 64}),  # value groups of 64 + 32 channels
    ("qjl", 2, 80, {"group_size": 32, "options": {"sketch_dim": 50}}),
]


@pytest.mark.parametrize("method,bits,dim,kwargs", STORAGE_CASES)
def test_bits_per_token_is_exact(method, bits, dim, kwargs):
    _, key_codec, value_codec = _codecs(method, bits, dim, **kwargs)
    T = 37
    for codec in (key_codec, value_codec):
        fields = codec.encode(_gaussian((1, 1, T, dim), seed=dim, dtype=mx.float16))
        assert all(f.shape[:3] == (1, 1, T) for f in fields.values())
        assert sum(f.nbytes for f in fields.values()) / T * 8 == codec.bits_per_token()
        assert codec.decode(fields).shape == (1, 1, T, codec.domain_dim)
        assert codec.decode(fields).dtype == mx.float32
    if method == "turboquant_prod" and not kwargs.get("options"):
        assert key_codec.bits_per_token() == dim * (bits - 1) + 16 + dim + 16


@pytest.mark.parametrize("method,bits,dim,kwargs", STORAGE_CASES)
def test_params_round_trip(method, bits, dim, kwargs):
    config, key_codec, value_codec = _codecs(method, bits, dim, **kwargs)
    other_seed = config.replace(seed=12345)  # params, not the seed, must decide everything
    cls = get_method(method)
    x = _gaussian((2, 3, 5, dim), seed=4, dtype=mx.bfloat16)
    for codec, make in ((key_codec, cls.key_codec), (value_codec, cls.value_codec)):
        rebuilt = make(other_seed, dim, codec.params())
        a, b = codec.encode(x), rebuilt.encode(x)
        assert a.keys() == b.keys()
        for name in a:
            assert a[name].dtype == b[name].dtype
            assert mx.array_equal(a[name], b[name]).item(), name
        q = _gaussian((3, dim), seed=5)
        assert mx.array_equal(codec.to_domain(q), rebuilt.to_domain(q)).item()


@pytest.mark.parametrize("method,bits", [("turboquant_prod", 2), ("qjl", 2)])
def test_input_dtypes_encode_alike(method, bits):
    _, key_codec, value_codec = _codecs(method, bits, 64)
    x = _gaussian((1, 2, 9, 64), seed=8, dtype=mx.float16)
    for codec in (key_codec, value_codec):
        a, b = codec.encode(x), codec.encode(x.astype(mx.float32))
        assert all(mx.array_equal(a[n], b[n]).item() for n in a)


def test_group_affine_error_is_half_a_step():
    codec = GroupAffineCodec(96, 3, 64, ragged=True)  # groups of 64 and 32 channels
    x = _gaussian((1, 2, 50, 96), seed=9)
    fields = codec.encode(x)
    assert fields["scale"].shape == (1, 2, 50, 2)
    err = mx.abs(codec.decode(fields) - x)
    step = mx.repeat(fields["scale"].astype(mx.float32), 64, axis=-1)[..., :96]
    # Half a step, plus the fp16 rounding of the stored minimum and scale.
    assert mx.all(err <= 0.5 * step * 1.01 + 8 * 2e-3 * mx.abs(x).max()).item()
    constant = mx.ones((1, 1, 3, 96)) * 0.3
    assert mx.allclose(codec.reconstruct(codec.encode(constant)), constant, atol=1e-3).item()


def _attention(q, k, v, scale, kv_heads):
    B, n_heads, L, dim = q.shape
    q = q.reshape(B, kv_heads, n_heads // kv_heads, L, dim) * scale
    scores = q @ mx.expand_dims(k, 2).swapaxes(-1, -2)
    out = mx.softmax(scores, axis=-1) @ mx.expand_dims(v, 2)
    return out.reshape(B, n_heads, L, -1)


# Relative output error of 4-bit caches on N(0, 1) keys/values, d = 64, scale 1/8: score
# noise std is sqrt(D_prod / d)*||q||*||k||/8 ~ 0.23 for turboquant_prod and
# sqrt(pi/2 / 256)*8 ~ 0.63 for qjl (m = 256), on logits of std 1 (measured 0.24, 0.57).
@pytest.mark.parametrize("method,bound", [("turboquant_prod", 0.35), ("qjl", 0.8)])
def test_cache_end_to_end(method, bound):
    k = _gaussian((1, 2, 300, 64), seed=10)
    v = _gaussian((1, 2, 300, 64), seed=11)
    q = _gaussian((1, 4, 5, 64), seed=12)
    cache = CompressedKVCache(KVCacheConfig(method=method, bits=4))
    cache.update_and_fetch(k, v)
    assert cache.encoded == 300
    out = cache.attend(q, 64**-0.5)
    exact = _attention(q, k, v, 64**-0.5, 2)
    rel = (mx.linalg.norm(out - exact) / mx.linalg.norm(exact)).item()
    assert rel < bound, rel
    keys, values = cache.dequantized()
    assert mx.allclose(out, _attention(q, keys, values, 64**-0.5, 2), atol=1e-4, rtol=1e-4).item()
    fields = (*cache.key_fields.values(), *cache.value_fields.values())
    per_token = sum(f[..., :300, :].nbytes for f in fields)
    bits = per_token * 8 / (2 * 300)
    assert bits == cache.key_codec.bits_per_token() + cache.value_codec.bits_per_token()


def test_config_validation():
    with pytest.raises(ValueError, match="qjl"):
        KVCacheConfig(method="turboquant_prod", bits=1)
    with pytest.raises(ValueError, match="key bits 2..8"):
        KVCacheConfig(method="turboquant_prod", bits=9)
    for bits in (0, 9):
        with pytest.raises(ValueError, match="key bits 1..8"):
            KVCacheConfig(method="qjl", bits=bits)
    for method in ("turboquant_prod", "qjl"):
        with pytest.raises(ValueError, match="value bits"):
            KVCacheConfig(method=method, bits=4, value_bits=9)
        with pytest.raises(ValueError, match="no option 'rotation'"):
            KVCacheConfig(method=method, options={"rotation": "dense"})
        for bad in (0, -3, True):
            with pytest.raises(ValueError, match="sketch_dim"):
                KVCacheConfig(method=method, options={"sketch_dim": bad})
        with pytest.raises(TypeError, match="sketch_dim"):
            KVCacheConfig(method=method, options={"sketch_dim": 1.5})
    config = KVCacheConfig(method="qjl", bits=3, options={"sketch_dim": 200})
    assert get_method("qjl").key_codec(config, 64).sketch_dim == 200
    assert get_method("qjl").key_codec(config.replace(options={}), 64).sketch_dim == 192
