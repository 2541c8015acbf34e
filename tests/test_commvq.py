"""commvq: keys coded before RoPE with RoPE-commuting codebooks, RoPE applied at attention time."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama

from conftest import random_model, random_sequences, tiny_gemma3, tiny_llama

from veloxquant_mlx import EngineSettings
from veloxquant_mlx.calibration import calibrate
from veloxquant_mlx.config import KVCacheConfig
from veloxquant_mlx.integration import (KVCacheBuilder, UnsupportedModelError, load_prompt_cache, patch_model,
                                        save_prompt_cache)
from veloxquant_mlx.methods.base import POSITIONS, at_positions
from veloxquant_mlx.methods.commvq import (SAFE_EXPONENT, CommVQKeyCodec, _stage_codewords, hard_weights,
                                           learn_stage, pair_distances, pair_terms, quarter_turn, rope_angles,
                                           rope_of, rotate, soft_weights)
from veloxquant_mlx.methods.outliers import CalibrationRequiredError


def _sequences(n=2, length=96, vocab=512, seed=0):
    return random_sequences(n, length, vocab, seed)


def _plain_llama(traditional: bool):
    """tiny_llama with the chosen RoPE pairing (conftest's uses traditional pairs)."""
    return random_model(llama, 1, model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=512,
                        rope_traditional=traditional)


@pytest.fixture(scope="module", params=[True, False], ids=["traditional", "halves"])
def calibrated(request, tmp_path_factory):
    model = _plain_llama(request.param)
    out = tmp_path_factory.mktemp("commvq") / "art"
    config = KVCacheConfig(method="commvq", bits=2, value_bits=4)
    record = calibrate(model, config, _sequences(), out, progress=False)
    return model, config.replace(artifact_dir=str(out)), record


def _random_codec(dim=32, heads=2, bits=2, traditional=False, seed=0):
    """A codec of random codebooks, to test the algebra (caches never get one: they need an artifact)."""
    rng = np.random.default_rng(seed)
    stages = bits * dim // 8
    params = {"heads.codebook": mx.array(rng.normal(size=(heads, stages, 2, 16, dim)).astype(np.float32) * 0.2),
              "rope.inv_freq": mx.array((10000.0 ** (-np.arange(0, dim, 2) / dim)).astype(np.float32)),
              "rope.traditional": mx.array([int(traditional)], mx.int32)}
    return CommVQKeyCodec(dim, bits, params)


@pytest.mark.parametrize("traditional", [True, False])
def test_codewords_commute_with_rope(traditional):
    """The identity the codec relies on: RoPE commutes with every codeword block [[a, -b], [b, a]]:
    R(t w) (a + J b) = a' + J b' with a' = R(t w) a, b' = R(t w) b; so decoding a code at position t
    equals applying RoPE to the code's pre-RoPE decoding, and q . R_t k^ = (R_t^T q) . k^."""
    rng = np.random.default_rng(3)
    a, b = (mx.array(rng.normal(size=(5, 32)).astype(np.float32)) for _ in range(2))
    angles = rope_angles(mx.arange(100, 105), mx.array((10000.0 ** (-np.arange(0, 32, 2) / 32)).astype(np.float32)))
    turned = rotate(a + quarter_turn(b, traditional), angles, traditional)
    assert mx.allclose(turned, rotate(a, angles, traditional) + quarter_turn(rotate(b, angles, traditional), traditional),
                       atol=1e-5).item()
    assert mx.allclose(rotate(quarter_turn(b, traditional), angles, traditional),
                       quarter_turn(rotate(b, angles, traditional), traditional), atol=1e-5).item()
    # J is the 2x2 block [[0, -1], [1, 0]] on each pair: J J = -I
    assert mx.allclose(quarter_turn(quarter_turn(a, traditional), traditional), -a).item()

    codec = _random_codec(traditional=traditional)
    keys = mx.array(rng.normal(size=(1, 2, 5, 32)).astype(np.float32))
    fields = codec.encode(keys)
    at = codec.decode(at_positions(codec, fields, 100))
    pre = codec.decode_position_free(fields)
    assert mx.allclose(at, rotate(pre, angles, traditional), atol=1e-5).item()
    q = mx.array(rng.normal(size=(1, 2, 1, 32)).astype(np.float32))
    scores = (q @ at.swapaxes(-1, -2))[..., 0, :]
    unrotated = rotate(mx.broadcast_to(q, (1, 2, 5, 32)), -angles, traditional)
    assert mx.allclose(scores, mx.sum(unrotated * pre, axis=-1), atol=1e-4).item()


def test_decode_needs_positions():
    codec = _random_codec()
    fields = codec.encode(mx.ones((1, 2, 3, 32)))
    with pytest.raises(ValueError, match="positions"):
        codec.decode(fields)
    assert at_positions(codec, fields, 7)[POSITIONS].tolist() == [7, 8, 9]


def test_rope_matches_the_models_module(calibrated):
    """The frequencies read from the model reproduce its RoPE module, and taking them off is exact."""
    model, config, _ = calibrated
    rope = model.layers[0].self_attn.rope
    params = rope_of(model, 0)
    codec = KVCacheBuilder(config).for_model(model).build()[0].codecs.get("keys", 32)
    x = mx.random.normal((1, 2, 6, 32), key=mx.random.key(4))
    for offset in (0, 31, 2000):
        assert mx.allclose(codec.position_free(rope(x, offset=offset), offset), x, atol=1e-4).item()
    assert mx.array_equal(params["rope.inv_freq"], codec.inv_freq).item()


def _reference_attention(model, cache, queries, scale, sinks_and_window=None):
    """Attention over the cache's codes decoded before RoPE, then RoPE applied by the model's own
    module at each token's position, values dequantized; plain fp32 softmax (causal for a chunk)."""
    rope = model.layers[0].self_attn.rope
    codec, vcodec = cache.key_codec, cache.value_codec
    key_fields, value_fields = cache.store.fields("keys"), cache.store.fields("values")
    pre = codec.decode_position_free(key_fields)
    keys = mx.concatenate([rope(pre[:, :, t : t + 1], offset=cache.sinks + t) for t in range(pre.shape[2])], axis=2)
    values = vcodec.reconstruct(value_fields)
    positions = list(range(cache.sinks, cache.sinks + pre.shape[2]))
    if sinks_and_window is not None:
        (sk, sv), (wk, wv) = sinks_and_window
        keys = mx.concatenate([sk.astype(mx.float32), keys, wk.astype(mx.float32)], axis=2)
        values = mx.concatenate([sv.astype(mx.float32), values, wv.astype(mx.float32)], axis=2)
        positions = list(range(keys.shape[2]))
    B, n_heads, L, D = queries.shape
    rep = n_heads // keys.shape[1]
    keys, values = mx.repeat(keys, rep, axis=1), mx.repeat(values, rep, axis=1)
    scores = (queries.astype(mx.float32) * scale) @ keys.swapaxes(-1, -2)
    query_pos = mx.arange(cache.offset - L, cache.offset)[:, None]
    scores = mx.where(mx.array(positions)[None] <= query_pos, scores, -mx.inf)
    return mx.softmax(scores, axis=-1) @ values


@pytest.mark.parametrize("window", [False, True])
def test_attention_equals_rope_applied_to_dequantized_keys(calibrated, window):
    """Prefill (generic path) and decode (compiled decode) of the cache equal attention over the
    dequantized pre-RoPE keys with RoPE applied normally (and the fp16 sinks and window as they are)."""
    model, config, _ = calibrated
    if window:
        config = config.replace(sink_tokens=4, residual_length=8)
    # The "decode" prefill rule: each query sees the tokens the chunk encoded as decoding would.
    cache = KVCacheBuilder(config).for_model(model).build(settings=EngineSettings.resolve(prefill_rule="decode"))[0]
    rope = model.layers[0].self_attn.rope
    rng = np.random.default_rng(9)
    keys = mx.array(rng.normal(size=(1, 2, 60, 32)).astype(np.float32))
    values = mx.array(rng.normal(size=(1, 2, 60, 32)).astype(np.float32))
    cache.update_and_fetch(rope(keys, offset=0), values)
    queries = rope(mx.array(rng.normal(size=(1, 4, 60, 32)).astype(np.float32)), offset=0)
    spans = None
    if window:
        spans = ((cache.sink_keys, cache.sink_values), (cache.window_keys, cache.window_values))
        assert cache.sinks == 4 and cache.encoded > 0
    got = cache.attend(queries, scale=32**-0.5, mask="causal")
    want = _reference_attention(model, cache, queries, 32**-0.5, spans)
    if window:  # a chunk's earlier queries still see the tokens it encoded in fp16 (cache.py's band)
        got, want = got[..., -1:, :], want[..., -1:, :]
    assert mx.allclose(got.astype(mx.float32), want, atol=2e-3, rtol=1e-3).item()

    cache.update_and_fetch(rope(mx.array(rng.normal(size=(1, 2, 1, 32)).astype(np.float32)), offset=60),
                           mx.array(rng.normal(size=(1, 2, 1, 32)).astype(np.float32)))
    if window:
        spans = ((cache.sink_keys, cache.sink_values), (cache.window_keys, cache.window_values))
    query = rope(mx.array(rng.normal(size=(1, 4, 1, 32)).astype(np.float32)), offset=60)
    got = cache.attend(query, scale=32**-0.5, mask=None)
    assert cache.last_path == "compiled_decode"
    want = _reference_attention(model, cache, query, 32**-0.5, spans)
    assert mx.allclose(got.astype(mx.float32), want, atol=2e-3, rtol=1e-3).item()


def test_codes_track_the_true_keys(calibrated):
    """Decoded keys (RoPE applied at their positions) approximate the post-RoPE keys the model
    gave the cache, better than a key of zeros: the codebook learned something real."""
    model, config, record = calibrated
    caches = KVCacheBuilder(config).for_model(model).build()
    tokens = _sequences(1, 80, seed=5)[0]
    captured = []
    first = caches[0]
    original = first.update_and_fetch

    def spy(keys, values):
        captured.append(keys)
        return original(keys, values)

    first.update_and_fetch = spy
    model(tokens[None], cache=caches)
    keys, _ = first.dequantized()
    true = captured[0].astype(mx.float32)
    relative = (mx.sum((keys - true) ** 2) / mx.sum(true**2)).item()
    assert relative < 0.25
    assert 0 < record["key_unit_mse_mean"] < 0.25


def _distances(r, words):
    """Squared distances (H, N, 256) of r (H, N, D) to every codeword (H, 256, D), directly."""
    return mx.sum((r[:, :, None, :] - words[:, None, :, :]) ** 2, axis=-1)


def _unit_rows(heads=2, count=512, dim=32, seed=0):
    """Unit vectors with structure (a few directions plus noise), as residuals of keys are."""
    rng = np.random.default_rng(seed)
    basis = rng.normal(size=(heads, 6, dim))
    x = rng.normal(size=(heads, count, 6)) @ basis + 0.3 * rng.normal(size=(heads, count, dim))
    return mx.array((x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32))


def _weights_from_softmax(p):
    """(H, N, 16, 16) assignments -> their marginals over B and A and their sum over tokens."""
    return mx.sum(p, axis=3), mx.sum(p, axis=2), mx.sum(p, axis=1)


@pytest.mark.parametrize("traditional", [True, False])
@pytest.mark.parametrize("relative", [3.0, 0.3, 0.03])
@pytest.mark.parametrize("factored", [True, False], ids=["factored", "full"])
def test_factored_e_step_equals_the_softmax_over_all_codewords(traditional, relative, factored, monkeypatch):
    """soft_weights equals the softmax over the 256 codewords' distances, both factored and by
    the full softmax it takes where the factors could underflow (forced here)."""
    from veloxquant_mlx.methods import commvq

    if not factored:
        monkeypatch.setattr(commvq, "SAFE_EXPONENT", 0.0)
    r = _unit_rows()
    rng = np.random.default_rng(1)
    a = mx.array(rng.normal(size=(2, 16, 32)).astype(np.float32) * 0.15)
    b = mx.array(rng.normal(size=(2, 16, 32)).astype(np.float32) * 0.1)
    distances = _distances(r, _stage_codewords(a, b, traditional))  # (H, N, 256)
    u, v, x = pair_terms(r, a, b, traditional)
    squares = mx.sum(r * r, axis=-1)[..., None, None]
    assert mx.allclose(pair_distances(u, v, x) + squares, distances.reshape(2, 512, 16, 16), atol=1e-5).item()
    nearest = mx.min(pair_distances(u, v, x), axis=(-2, -1))
    temperature = relative * mx.mean(mx.min(distances, axis=-1), axis=1, keepdims=True)
    want = _weights_from_softmax(mx.softmax(-distances / temperature[..., None], axis=-1).reshape(2, 512, 16, 16))
    got = soft_weights(u, v, x, nearest, temperature)
    for g, w in zip(got, want):
        assert mx.allclose(g, w, atol=1e-4, rtol=1e-3).item()


def test_e_step_falls_back_to_the_full_softmax_where_factors_would_underflow():
    """At a temperature where exp(-gap / T) would underflow, the weights are still a distribution."""
    r = _unit_rows()
    rng = np.random.default_rng(1)
    a, b = (mx.array(rng.normal(size=(2, 16, 32)).astype(np.float32) * 0.15) for _ in range(2))
    u, v, x = pair_terms(r, a, b, False)
    nearest = mx.min(pair_distances(u, v, x), axis=(-2, -1))
    gap = nearest - mx.min(u, axis=-1) - mx.min(v, axis=-1) - mx.min(x, axis=(-2, -1))[:, None]
    temperature = mx.max(gap, axis=1, keepdims=True) / (4 * SAFE_EXPONENT)
    weight_a, weight_b, joint = soft_weights(u, v, x, nearest, temperature)
    for w in (weight_a, weight_b):
        assert mx.allclose(mx.sum(w, axis=-1), mx.ones((2, 512)), atol=1e-5).item()
    assert mx.allclose(mx.sum(joint, axis=(-2, -1)), mx.full((2,), 512.0), rtol=1e-5).item()


def test_hard_e_step_assigns_the_nearest_codeword():
    r = _unit_rows(seed=2)
    rng = np.random.default_rng(3)
    a, b = (mx.array(rng.normal(size=(2, 16, 32)).astype(np.float32) * 0.2) for _ in range(2))
    nearest = mx.argmin(_distances(r, _stage_codewords(a, b, False)), axis=-1)
    want = _weights_from_softmax((mx.arange(256) == nearest[..., None]).astype(mx.float32).reshape(2, 512, 16, 16))
    for g, w in zip(hard_weights(pair_distances(*pair_terms(r, a, b, False))), want):
        assert mx.array_equal(g, w).item()


def _em_with_b_at_zero(r, traditional, key, soft=8, hard=4):
    """The EM this module had before (kept here as the reference): b starts at zeros, full softmax
    over the 256 codewords, 8 soft and 4 hard steps, tied codewords share a token's weight."""
    from veloxquant_mlx.methods.commvq import _m_step

    heads, count, _ = r.shape
    a = mx.take_along_axis(r, mx.random.randint(0, count, (heads, 16), key=key)[..., None], axis=1)
    b = mx.zeros_like(a)
    distances = _distances(r, _stage_codewords(a, b, traditional))
    scale = mx.mean(mx.min(distances, axis=-1), axis=1)[:, None, None]
    best, best_error = None, None
    for step in range(soft + hard):
        if step < soft:
            p = mx.softmax(-distances / (scale * 10 ** (-0.5 * step)), axis=-1)
        else:
            p = (distances == mx.min(distances, axis=-1, keepdims=True)).astype(mx.float32)
            p = p / mx.sum(p, axis=-1, keepdims=True)
        a, b = _m_step(r, *_weights_from_softmax(p.reshape(heads, count, 16, 16)), a, b, traditional)
        distances = _distances(r, _stage_codewords(a, b, traditional))
        error = mx.mean(mx.min(distances, axis=-1)).item()
        if best_error is None or error < best_error:
            best, best_error = (a, b), error
    return best, best_error


@pytest.mark.parametrize("traditional", [True, False])
def test_em_stage_is_no_worse_than_before_and_uses_all_its_codewords(traditional):
    """One stage on structured unit vectors: the error after the stage is at most that of the
    earlier EM (b at zeros) from the same first codebook draw, and well below the input's
    energy; and all 16 a's and all 16 b's differ (b at zeros kept equal b's equal, so the
    stage had fewer than 256 distinct codewords)."""
    r = _unit_rows(seed=4)
    errors, before = [], []
    for seed in range(3):
        a, b, residual = learn_stage(r, traditional, mx.random.key(seed))
        errors.append(mx.mean(mx.sum(residual * residual, axis=-1)).item())
        before.append(_em_with_b_at_zero(r, traditional, mx.random.split(mx.random.key(seed))[0])[1])
        for books in (a, b):
            gaps = mx.sum((books[:, :, None] - books[:, None]) ** 2, axis=-1) + 1e9 * mx.eye(16)
            assert mx.min(gaps).item() > 1e-6
        assert len(np.unique(np.array(mx.argmin(_distances(r, _stage_codewords(a, b, traditional)), axis=-1)))) > 128
    assert np.mean(errors) <= np.mean(before)
    assert np.mean(errors) < 0.5 * mx.mean(mx.sum(r * r, axis=-1)).item()


def test_calibrated_codebooks_have_distinct_vectors(calibrated):
    """Every stage of the artifact's codebooks has 16 distinct a's and 16 distinct b's."""
    model, config, _ = calibrated
    from safetensors.numpy import load_file

    tensors = load_file(str(Path(config.artifact_dir) / "codecs.safetensors"))
    books = [v for k, v in tensors.items() if k.endswith("heads.codebook")]
    assert books
    for book in books:  # (H, S, 2, 16, D)
        gaps = np.sum((book[:, :, :, :, None] - book[:, :, :, None]) ** 2, axis=-1) + 1e9 * np.eye(16)
        assert gaps.min() > 1e-8


def test_unsupported_architecture_is_named(tmp_path):
    gemma = tiny_gemma3()
    config = KVCacheConfig(method="commvq", bits=2, value_bits=4)
    with pytest.raises(UnsupportedModelError, match="gemma3"):
        calibrate(gemma, config, _sequences(1, 64), tmp_path / "art", progress=False)
    assert not (tmp_path / "art").exists()
    with pytest.raises(UnsupportedModelError, match="gemma3"):
        KVCacheBuilder(config).for_model(gemma).build()
    with pytest.raises(UnsupportedModelError, match="gemma3"):
        patch_model(gemma, config)


def test_missing_calibration_raises():
    model = tiny_llama(layers=2, hidden=128, heads=4, kv_heads=2)
    with pytest.raises(CalibrationRequiredError, match="commvq"):
        KVCacheBuilder(KVCacheConfig(method="commvq", bits=1, value_bits=4)).for_model(model).build()[0] \
            .update_and_fetch(mx.ones((1, 2, 1, 32)), mx.ones((1, 2, 1, 32)))


def test_refused_options(calibrated):
    model, config, _ = calibrated
    with pytest.raises(ValueError, match="centering"):
        config.replace(center=True)
    with pytest.raises(ValueError, match="no option 'outliers'"):
        config.replace(options={"outliers": 4})
    with pytest.raises(ValueError, match="rotating cache"):
        KVCacheBuilder(config).for_model(model).build(max_kv_size=64)


@pytest.mark.parametrize("bits", [1, 2])
def test_bytes_per_token_match_the_format(calibrated, tmp_path, bits):
    """Stored bytes per token and head within 3% of what the format states: bits*D code bits + a
    16-bit norm for keys, TurboQuant-MSE's for values."""
    model, config, _ = calibrated
    if bits != config.bits:
        out = tmp_path / "art"
        calibrate(model, config.replace(bits=bits, artifact_dir=None), _sequences(), out, progress=False)
        config = config.replace(bits=bits, artifact_dir=str(out))
    caches = KVCacheBuilder(config).for_model(model).build()
    tokens = _sequences(1, 200, seed=2)[0]
    model(tokens[None], cache=caches)
    key_bits, value_bits = caches[0].key_codec.bits_per_token(), caches[0].value_codec.bits_per_token()
    assert key_bits == bits * 32 + 16
    stated = len(caches) * 2 * 200 * (key_bits + value_bits) / 8
    measured = sum(c.used_nbytes for c in caches)
    assert abs(measured - stated) / stated < 0.03


def test_artifacts_and_prompt_cache_round_trip(calibrated, tmp_path):
    model, config, record = calibrated
    meta = json.loads((Path(config.artifact_dir) / "artifacts.json").read_text())
    assert meta["calibration"]["method"] == "commvq" and meta["calibration"]["seconds"] > 0
    caches = KVCacheBuilder(config).for_model(model).build()
    tokens = _sequences(1, 80, seed=5)[0]
    model(tokens[None], cache=caches)
    save_prompt_cache(tmp_path / "c.safetensors", caches)
    nxt = mx.array([[7]])
    expected = model(nxt, cache=caches)
    for kwargs in ({"config": config, "model": model}, {}):
        loaded = load_prompt_cache(tmp_path / "c.safetensors", **kwargs)
        assert loaded[0].key_codec.positional
        assert mx.array_equal(model(nxt, cache=loaded), expected).item()


@pytest.mark.model
def test_generates_coherent_text_on_smollm2(smollm2, tmp_path):
    """Calibrated on a short text, 1-bit keys / 4-bit values: the greedy continuation is text the
    fp16 model finds likely (its mean negative log-likelihood under fp16 stays low)."""
    from mlx_lm import generate

    from veloxquant_mlx.calibration import calibration_tokens

    model, tokenizer = smollm2
    text = (Path(__file__).parents[1] / "veloxquant_mlx" / "data" / "python-reference.txt").read_text()
    config = KVCacheConfig(method="commvq", bits=1, value_bits=4)
    calibrate(model, config, calibration_tokens(tokenizer, text, 1, 256), tmp_path / "art", progress=False)
    config = config.replace(artifact_dir=str(tmp_path / "art"))
    prompt = "The history of the city of London begins"
    caches = KVCacheBuilder(config).for_model(model).build()
    out = generate(model, tokenizer, prompt=prompt, max_tokens=24, prompt_cache=caches)
    assert caches[0].offset > 24
    ids = mx.array(tokenizer.encode(prompt + out))[None]
    logits = model(ids).astype(mx.float32)
    start = len(tokenizer.encode(prompt))
    nll = -mx.take_along_axis(logits[0, start - 1 : -1] - mx.logsumexp(logits[0, start - 1 : -1], axis=-1,
                                                                        keepdims=True),
                              ids[0, start:, None], axis=-1)
    assert len(out.split()) >= 10
    assert mx.mean(nll).item() < 3.0, out
