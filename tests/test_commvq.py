"""commvq: keys coded before RoPE with RoPE-commuting codebooks, RoPE applied at attention time."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama

from conftest import random_sequences, tiny_gemma3, tiny_llama

from veloxquant_mlx import EngineSettings
from veloxquant_mlx.calibration import calibrate
from veloxquant_mlx.config import KVCacheConfig
from veloxquant_mlx.integration import (KVCacheBuilder, UnsupportedModelError, load_prompt_cache, patch_model,
                                        save_prompt_cache)
from veloxquant_mlx.methods.base import POSITIONS, at_positions
from veloxquant_mlx.methods.commvq import (CommVQKeyCodec, quarter_turn, rope_angles, rope_of, rotate)
from veloxquant_mlx.methods.outliers import CalibrationRequiredError


def _sequences(n=2, length=96, vocab=512, seed=0):
    return random_sequences(n, length, vocab, seed)


def _plain_llama(traditional: bool):
    """tiny_llama with the chosen RoPE pairing (conftest's uses traditional pairs)."""
    args = llama.ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=512,
                           rope_traditional=traditional)
    mx.random.seed(1)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


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
