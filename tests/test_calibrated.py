"""Calibrated methods: capture, artifacts, the outliers option, ratequant and plan."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from conftest import (assert_engine_paths_agree, assert_format_kernels_agree, assert_partial_kernel_compiles,
                      compile_encode_kernel, random_sequences, tiny_gemma3, tiny_llama)

from veloxquant_mlx.artifacts import ArtifactError, CodecSet
from veloxquant_mlx.calibration import calibrate, capture
from veloxquant_mlx.config import KVCacheConfig
from veloxquant_mlx.integration import KVCacheBuilder
from veloxquant_mlx.methods.outliers import CalibrationRequiredError, OutlierCodec, top_channels
from veloxquant_mlx.methods.ratequant import RateCodec, allocate, fit_curve, split_width
from veloxquant_mlx.methods.turboquant_mse import MSECodec


def _sequences(n=2, length=64, vocab=512, seed=0):
    return random_sequences(n, length, vocab, seed)


def _forward(model, config, tokens):
    caches = KVCacheBuilder(config).for_model(model).build()
    logits = model(tokens[None], cache=caches)
    return logits, caches


def test_capture_records_every_layer(small):
    layers = capture(small, _sequences(), progress=False)
    assert len(layers) == 2
    for layer in layers:
        assert layer["keys"].shape == (2, 128, 32)
        assert layer["values"].shape == (2, 128, 32)
        assert layer["queries"].shape == (4, 128, 32)
    # the capture is what a plain fp16 cache holds for the last sequence
    from mlx_lm.models.cache import KVCache

    caches = [KVCache() for _ in small.layers]
    small(_sequences()[1][None], cache=caches)
    np.testing.assert_allclose(np.array(layers[0]["keys"][:, 64:]), np.array(caches[0].keys[0, :, :64].astype(mx.float32)),
                               atol=1e-5)


def test_calibrated_method_without_artifact_raises(small):
    with pytest.raises(CalibrationRequiredError, match="needs calibration"):
        _forward(small, KVCacheConfig(method="ratequant", bits=3), mx.array([1, 2, 3]))
    with pytest.raises(CalibrationRequiredError, match="outliers=4"):
        _forward(small, KVCacheConfig(method="turboquant_mse", bits=3, options={"outliers": 4}), mx.array([1, 2]))


def _skewed_keys_and_queries(heads=2, dim=32, tokens=512, seed=11):
    """Keys and queries whose energy sits in a few channels, as SmolLM2's do, with the big key
    channels not the big query channels."""
    kk, kq = mx.random.split(mx.random.key(seed))
    k_scale = mx.where(mx.arange(dim) < 3, 12.0, 1.0)
    q_scale = mx.where((mx.arange(dim) >= 3) & (mx.arange(dim) < 6), 12.0, 1.0)
    keys = mx.random.normal((heads, tokens, dim), key=kk) * k_scale
    queries = mx.random.normal((heads, tokens, dim), key=kq) * q_scale
    return keys, queries


def test_smoothed_keys_score_exactly_and_cut_the_score_error_on_skewed_channels():
    from veloxquant_mlx.methods.smoothing import SmoothedKeyCodec, smoothing_scales

    keys, queries = _skewed_keys_and_queries()
    scale = smoothing_scales(keys, queries, 0.5, center=False)
    assert scale.shape == (2, 32)
    # big key channels are scaled down, big query channels up: s_j^2 = k_rms_j / q_rms_j
    assert float(mx.mean(scale[:, :3]).item()) > 1.0 > float(mx.mean(scale[:, 3:6]).item())
    plain, smoothed = MSECodec(32, 3, 0), SmoothedKeyCodec(MSECodec(32, 3, 0), scale)
    assert not smoothed.format.orthogonal_domain
    assert smoothed.format.bits_per_token == plain.format.bits_per_token  # the scales live in the artifact
    k, q = keys[None], queries[None, :, :64]
    errors = []
    for codec in (plain, smoothed):
        fields = codec.encode(k)
        rec = codec.reconstruct(fields)
        # scores of the codes in the domain are the scores of the reconstructed keys (A^T is A's adjoint)
        np.testing.assert_allclose(np.array(codec.score(codec.to_domain(q), fields)),
                                   np.array(q @ rec.swapaxes(-1, -2)), rtol=1e-3, atol=1e-2)
        errors.append(float(mx.mean((q @ (rec - k).swapaxes(-1, -2)) ** 2).item()))
    assert errors[1] < 0.5 * errors[0]
    with pytest.raises(ValueError, match="calibrated for 2 kv heads"):
        smoothed.encode(mx.zeros((1, 3, 4, 32)))


def test_caches_built_again_from_artifacts_share_their_codecs(small, tmp_path):
    """A cache list built per request (or per benchmark run) gets the same codec objects as the last
    one built from the same artifacts, so the compiled steps and kernel programs keyed by codecs are
    reused, not traced and rendered again for every layer and kept in those caches."""
    from veloxquant_mlx import engine

    config = KVCacheConfig(method="spectralquant", bits=3)
    calibrate(small, config, _sequences(), tmp_path, progress=False)
    loaded = config.replace(artifact_dir=str(tmp_path))
    tokens = _sequences(1, 16, seed=4)[0][None]
    first = KVCacheBuilder(loaded).for_model(small).build()
    small(tokens, cache=first)
    traced = engine._decode_fn.cache_info().misses
    again = KVCacheBuilder(loaded).for_model(small).build()
    small(tokens, cache=again)
    assert all(a.key_codec is b.key_codec and a.value_codec is b.value_codec for a, b in zip(first, again))
    assert first[0].key_codec is not first[1].key_codec  # still one codec per layer
    small(tokens[:, :1], cache=again)  # a decode step: the compiled step of each layer is the first one's
    small(tokens[:, :1], cache=first)
    assert engine._decode_fn.cache_info().misses <= traced + len(first)
    # Artifacts written again (calibrated on other tokens) are other codecs.
    calibrate(small, config, _sequences(seed=5), tmp_path, progress=False)
    other = KVCacheBuilder(loaded).for_model(small).build()
    small(tokens, cache=other)
    assert other[0].key_codec is not first[0].key_codec


def test_smooth_keys_artifact_round_trip(small, tmp_path):
    from veloxquant_mlx.methods.smoothing import SmoothedKeyCodec

    config = KVCacheConfig(method="turboquant_mse", bits=3, center=True, options={"smooth_keys": 0.5})
    with pytest.raises(CalibrationRequiredError, match="smooth_keys=0.5"):
        _forward(small, config, mx.array([1, 2]))
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        KVCacheConfig(method="turboquant_mse", options={"smooth_keys": 1.5})
    calibrate(small, config, _sequences(), tmp_path, progress=False)
    logits, caches = _forward(small, config.replace(artifact_dir=str(tmp_path)), _sequences(1, 96, seed=3)[0])
    assert isinstance(caches[0].key_codec, SmoothedKeyCodec) and not isinstance(caches[0].value_codec, SmoothedKeyCodec)
    stored = mx.load(str(tmp_path / "codecs.safetensors"))
    assert np.array_equal(np.array(caches[1].key_codec.scale), np.array(stored["1.keys.32.smooth.scale"]))
    assert bool(mx.all(mx.isfinite(logits)).item())


def test_outlier_codec_is_exact_on_its_channels_and_an_isometry():
    heads, dim, count = 2, 32, 4
    x = mx.random.normal((1, heads, 16, dim), key=mx.random.key(1))
    x = x + 40.0 * (mx.arange(dim) == 5)  # a large channel
    channels = top_channels(x[0], count)
    assert all(5 in row for row in np.array(channels).tolist())
    codec = OutlierCodec(MSECodec(dim - count, 4, 0), channels, dim)
    assert codec.format.bits_per_token == MSECodec(dim - count, 4, 0).format.bits_per_token + count * 8 + 16
    fields = codec.encode(x)
    rec = codec.reconstruct(fields)
    out = np.array(channels)
    for h in range(heads):
        got, want = np.array(rec[0, h])[:, out[h]], np.array(x[0, h])[:, out[h]]
        scale = np.abs(want).max(axis=-1, keepdims=True) / 127
        assert np.all(np.abs(got - want) <= scale * 0.51 + 1e-3)  # int8: half a step per token
    # scores in the domain equal scores of the reconstruction (adds both streams exactly)
    q = mx.random.normal((1, heads, 3, dim), key=mx.random.key(2))
    s_domain = codec.score(codec.to_domain(q), fields)
    s_plain = q @ rec.swapaxes(-1, -2)
    np.testing.assert_allclose(np.array(s_domain), np.array(s_plain), rtol=1e-4, atol=1e-3)
    # A^T A = I: from_domain(to_domain(v)) = v, for kv heads and for query heads (GQA)
    for v in (x, mx.random.normal((1, 2 * heads, 5, dim))):
        np.testing.assert_allclose(np.array(codec.from_domain(codec.to_domain(v))), np.array(v), atol=1e-4)


@pytest.mark.parametrize("dim, count", [(32, 4), (128, 8)], ids=["hadamard28", "dense120"])
def test_outlier_maps_are_the_selections_then_the_base_map(dim, count):
    """to_domain(x) = [A_base S_rest^T x ; S_out^T x] per head (the module docstring), and from_domain its
    adjoint, for kv heads and query heads (GQA 2), however the codec evaluates them."""
    from veloxquant_mlx.methods.outliers import per_head

    channels = mx.stack([3 * mx.arange(count), 3 * mx.arange(count) + 1])  # two kv heads, their own channels
    codec = OutlierCodec(MSECodec(dim - count, 3, 0), channels, dim)
    for x in (mx.random.normal((1, 2, 5, dim), key=mx.random.key(7)), mx.random.normal((2, 4, 3, dim))):
        rest, out = x @ per_head(codec.rest_select, x), x @ per_head(codec.out_select, x)
        want = mx.concatenate([codec.base.to_domain(rest), out], axis=-1)
        np.testing.assert_allclose(np.array(codec.to_domain(x)), np.array(want), atol=1e-5)
        y = want
        n = codec.base.domain_dim
        back = codec.base.from_domain(y[..., :n])
        want_back = back @ per_head(codec.rest_select.swapaxes(-1, -2), back) + y[..., n:] @ per_head(
            codec.out_select.swapaxes(-1, -2), y[..., n:])
        np.testing.assert_allclose(np.array(codec.from_domain(y)), np.array(want_back), atol=1e-5)


def test_outlier_artifact_round_trip_and_quality(small, tmp_path):
    tokens = _sequences(1, 96, seed=3)[0]
    config = KVCacheConfig(method="turboquant_mse", bits=2, options={"outliers": 4})
    record = calibrate(small, config, _sequences(), tmp_path, progress=False)
    assert record["tokens"] == 128
    loaded = config.replace(artifact_dir=str(tmp_path))
    logits, caches = _forward(small, loaded, tokens)
    assert isinstance(caches[0].key_codec, OutlierCodec)
    # per-layer channels: each layer's codec carries that layer's own channels
    meta = json.loads((tmp_path / "artifacts.json").read_text())
    assert {e["layer"] for e in meta["codecs"]} == {0, 1}
    assert np.array_equal(np.array(caches[1].key_codec.channels),
                          np.array(mx.load(str(tmp_path / "codecs.safetensors"))["1.keys.32.outliers.channels"]))
    fp16_logits = small(tokens[None])
    plain, _ = _forward(small, KVCacheConfig(method="turboquant_mse", bits=2), tokens)
    err = lambda a: float(mx.mean((a - fp16_logits) ** 2).item())
    assert err(logits) < err(plain)  # the int8 channels are nearer fp16 than 2-bit codes


def test_artifact_checked_against_model_and_config(small, tmp_path):
    config = KVCacheConfig(method="ratequant", bits=3)
    calibrate(small, config, _sequences(), tmp_path, progress=False)
    other = tiny_llama(layers=3, hidden=128, heads=4, kv_heads=2)
    with pytest.raises(ArtifactError, match="another model"):
        KVCacheBuilder(config.replace(artifact_dir=str(tmp_path))).for_model(other).build()
    with pytest.raises(ArtifactError, match="made for"):
        KVCacheBuilder(config.replace(bits=4, artifact_dir=str(tmp_path))).for_model(small).build()
    lone = CodecSet.for_config(config.replace(artifact_dir=str(tmp_path)))
    with pytest.raises(ArtifactError, match="per layer"):
        lone.get("keys", 32)


def test_rate_codec_fractional_width_storage_and_error():
    dim = 64
    x = mx.random.normal((1, 1, 256, dim), key=mx.random.key(4))
    errors = []
    for width in (2.0, 2.5, 3.0):
        codec = RateCodec(dim, width, 0)
        assert codec.format.bits_per_token == width * dim + 16
        rec = codec.reconstruct(codec.encode(x))
        errors.append(float(mx.mean(mx.sum((rec - x) ** 2, -1) / mx.sum(x * x, -1)).item()))
    assert errors[0] > errors[1] > errors[2]
    with pytest.raises(ValueError, match="grid"):
        split_width(2.25, dim)


def test_fit_and_water_filling():
    a, beta = fit_curve(np.array([3.0 * 4.0 ** -b for b in range(1, 7)]))
    assert a == pytest.approx(3.0, rel=1e-6) and beta == pytest.approx(4.0, rel=1e-6)
    # a layer whose errors cost 64x more gets 3 more bits (log_4 64 = 3 under a 4^-b curve)
    widths = allocate([64.0, 1.0], [4.0, 4.0], [1, 1], budget=3.5, grid=0.5)
    assert widths == [5.0, 2.0]
    for budget in (2.5, 3.5):
        widths = allocate([5.0, 1.0, 2.0, 0.5], [4.0, 3.6, 5.3, 4.0], [1, 1, 1, 1], budget, 0.5)
        assert np.mean(widths) <= budget + 1e-9 and np.mean(widths) > budget - 0.5 / 4
    with pytest.raises(ValueError, match="outside"):
        allocate([1.0], [4.0], [1], budget=0.5, grid=0.5)


def test_ratequant_end_to_end_separate_budgets(small, tmp_path):
    config = KVCacheConfig(method="ratequant", bits=3, options={"kbudget": 2.5, "vbudget": 3.5})
    record = calibrate(small, config, _sequences(), tmp_path, progress=False)
    assert record["keys_mean_width"] <= 2.5 and record["values_mean_width"] <= 3.5
    assert record["values_mean_width"] > record["keys_mean_width"]
    tokens = _sequences(1, 80, seed=5)[0]
    logits, caches = _forward(small, config.replace(artifact_dir=str(tmp_path)), tokens)
    widths = [c.key_codec.width for c in caches]
    assert widths == record["keys_widths"]
    per_token = sum(c.kv_heads * (c.key_codec.bits_per_token() + c.value_codec.bits_per_token()) / 8 for c in caches)
    assert per_token == pytest.approx(sum(2 * (w * 32 + 16) / 8 for w in record["keys_widths"])
                                      + sum(2 * (w * 32 + 16) / 8 for w in record["values_widths"]))
    assert bool(mx.all(mx.isfinite(logits)).item())


def test_plan_meets_its_budget(small, tmp_path):
    from veloxquant_mlx.planning import measure, plan

    class Tok:
        def encode(self, text):
            return [ord(c) % 512 for c in text]

    text = "".join(chr(97 + i % 26) for i in range(2000))
    context, memory = 512, 2 * 2 * 512 * 2 * 32 * 3.2 / 8  # ~3 bits per coordinate plus norms
    record = plan(small, Tok(), text, memory / 1e9, context, tmp_path, sequences=2, tokens=128, progress=False)
    assert record["predicted_bytes"] <= memory
    used = measure(small, record["config"].replace(artifact_dir=str(tmp_path)), mx.array(Tok().encode(text)[:context]))
    assert used == record["predicted_bytes"] and used <= memory
    with pytest.raises(ValueError, match="needs at least"):
        plan(small, Tok(), text, memory / 8e9, context, tmp_path, sequences=2, tokens=128, progress=False)


def test_sliding_window_layers_are_calibrated_and_planned(tmp_path):
    """Gemma 3's sliding-window layers (mlx-lm's RotatingKVCache) are captured and get their own
    codecs: a per-layer artifact covers every layer, so its caches build and run past the window
    (before, the artifact held the global layers only and building the sliding ones failed). The
    plan counts a sliding layer's bytes at its window plus a chunk, and meets its budget measured."""
    from veloxquant_mlx import CompressedRotatingKVCache
    from veloxquant_mlx.planning import held_tokens, measure, plan

    model = tiny_gemma3(layers=3, sliding_window=32, pattern=3)
    layers = capture(model, _sequences(2, 48), progress=False)
    assert [layer["keys"].shape for layer in layers] == [(1, 96, 256)] * 3  # every key of both sequences
    config = KVCacheConfig(method="ratequant", options={"kbudget": 3.0, "vbudget": 2.0})
    calibrate(model, config, _sequences(2, 48), tmp_path / "rq", progress=False)
    tokens = mx.array(np.random.default_rng(3).integers(0, 512, 80))
    logits, caches = _forward(model, config.replace(artifact_dir=str(tmp_path / "rq")), tokens)
    assert [type(c).__name__ for c in caches] == ["CompressedRotatingKVCache"] * 2 + ["CompressedKVCache"]
    logits = model(tokens[None, :4], cache=caches)  # the sliding layers evict down to their window
    assert all(isinstance(c, CompressedRotatingKVCache) and c.held == 31 + 4 for c in caches[:2])
    assert bool(mx.all(mx.isfinite(logits)).item())

    class Tok:
        def encode(self, text):
            return [ord(c) % 512 for c in text]

    text = "".join(chr(97 + i % 26) for i in range(4000))
    context = 1024
    assert held_tokens(model, context, chunk=512) == [544, 544, 1024]  # 31 + 512 held, in steps of its window
    assert held_tokens(model, 20, chunk=512) == [32, 32, 256]
    memory = 256 * 2 * 3.2 / 8 * (544 * 2 + 1024)  # ~3 bits per coordinate plus norms
    record = plan(model, Tok(), text, memory / 1e9, context, tmp_path / "plan", sequences=2, tokens=64,
                  progress=False)
    assert record["held_tokens"] == [544, 544, 1024] and record["predicted_bytes"] <= memory
    used = measure(model, record["config"].replace(artifact_dir=str(tmp_path / "plan")),
                   mx.array(Tok().encode(text)[:context]))
    assert used == record["predicted_bytes"]


def test_spectralquant_basis_is_orthogonal_and_beats_equal_widths_on_skewed_data(small, tmp_path):
    from veloxquant_mlx.methods.spectralquant import SpectralCodec, choose_split, learn_basis

    # a spectrum where half the energy sits in 4 of 64 directions: two widths must win
    variances = np.array([8.0] * 4 + [0.1] * 60)
    high, hi, lo = choose_split(variances, 3, 64)
    assert high * hi + (64 - high) * lo == 3 * 64 and hi > lo
    x = mx.random.normal((2, 512, 64), key=mx.random.key(6)) * mx.array(np.sqrt(variances).astype(np.float32))
    params = learn_basis(x, 3)
    codec = SpectralCodec(64, 3, params)
    assert codec.format.bits_per_token == MSECodec(64, 3, 0).format.bits_per_token
    v = mx.random.normal((1, 2, 7, 64))
    np.testing.assert_allclose(np.array(codec.from_domain(codec.to_domain(v))), np.array(v), atol=1e-4)
    rel = lambda c: float(mx.mean(mx.sum((c.reconstruct(c.encode(x[None])) - x[None]) ** 2, -1)).item())
    assert rel(codec) < rel(MSECodec(64, 3, 0))
    config = KVCacheConfig(method="spectralquant", bits=3)
    with pytest.raises(CalibrationRequiredError):
        _forward(small, config, mx.array([1, 2]))
    calibrate(small, config, _sequences(), tmp_path, progress=False)
    logits, caches = _forward(small, config.replace(artifact_dir=str(tmp_path)), _sequences(1, 40, seed=7)[0])
    assert isinstance(caches[0].key_codec, SpectralCodec) and bool(mx.all(mx.isfinite(logits)).item())


CALIBRATED_SPECS = {
    "ratequant": KVCacheConfig(method="ratequant", bits=3, options={"kbudget": 2.5, "vbudget": 3.0}),
    "mse+outliers": KVCacheConfig(method="turboquant_mse", bits=3, options={"outliers": 4, "value_outliers": 2}),
    "kivi+outliers": KVCacheConfig(method="kivi", bits=3, group_size=32, residual_length=8, sink_tokens=2,
                                   options={"outliers": 4}),
    "spectral": KVCacheConfig(method="spectralquant", bits=3, center=True, sink_tokens=2),
    "mse+smooth": KVCacheConfig(method="turboquant_mse", bits=3, value_bits=2, center=True, sink_tokens=2,
                                residual_length=8, options={"smooth_keys": 0.5, "renorm": True}),
}


@pytest.mark.parametrize("name", sorted(CALIBRATED_SPECS))
def test_engine_paths_agree_on_calibrated_formats(small, tmp_path, name):
    config = CALIBRATED_SPECS[name]
    calibrate(small, config, _sequences(), tmp_path, progress=False)
    assert_engine_paths_agree(small, config.replace(artifact_dir=str(tmp_path)), _sequences(1, 100, seed=8)[0])


def test_ratequant_on_a_kivi_base_uses_whole_bits_per_layer(small, tmp_path):
    from veloxquant_mlx.methods.kivi import ChannelGroupAffineCodec

    config = KVCacheConfig(method="ratequant", group_size=32, options={"kbudget": 2.5, "vbudget": 2.5, "base": "kivi"})
    record = calibrate(small, config, _sequences(2, 128), tmp_path, progress=False)
    assert all(w == int(w) for w in record["keys_widths"]) and record["keys_mean_width"] <= 2.5
    _, caches = _forward(small, config.replace(artifact_dir=str(tmp_path)), _sequences(1, 64, seed=9)[0])
    assert isinstance(caches[0].key_codec, ChannelGroupAffineCodec)
    assert [c.key_codec.bits for c in caches] == record["keys_widths"]
    with pytest.raises(ValueError, match="base must be one of"):
        KVCacheConfig(method="ratequant", options={"base": "nope"})


def test_rate_codec_at_a_whole_width_is_turboquant_mse():
    # so a ratequant cache with every layer at b bits is turboquant_mse:b: any difference measured
    # between them comes from the allocation alone
    x = mx.random.normal((1, 2, 40, 64), key=mx.random.key(10))
    for bits in (2, 3):
        rate, mse = RateCodec(64, float(bits), 0), MSECodec(64, bits, 0)
        assert mx.array_equal(rate.reconstruct(rate.encode(x)), mse.reconstruct(mse.encode(x))).item()


@pytest.mark.model
def test_calibrate_command_on_smollm2(tmp_path, capsys, cli_shares_smollm2):
    from veloxquant_mlx.cli import main

    text = tmp_path / "text.txt"
    text.write_text("The lighthouse keeper climbed the stairs and lit the lamp before the storm. " * 40)
    out = tmp_path / "art"
    assert main(["calibrate", "--method", "turboquant_mse", "--bits", "3", "--option", "outliers=4", "--text",
                 str(text), "--sequences", "1", "--tokens", "128", "--out", str(out), "--no-progress"]) == 0
    assert "calibrated turboquant_mse K3/V3 outliers=4" in capsys.readouterr().out
    meta = json.loads((out / "artifacts.json").read_text())
    assert meta["calibration"]["tokens"] == 128 and meta["fingerprint"]["num_layers"] == 30
    assert main(["generate", "--bits", "3", "--option", "outliers=4", "--artifact-dir", str(out), "-m", "8",
                 "--prompt", "Hello"]) == 0
    assert "KV cache (turboquant_mse K3/V3 outliers=4)" in capsys.readouterr().out


def test_calibrated_prompt_cache_saves_and_loads(small, tmp_path):
    """A prompt cache of per-layer calibrated codecs reloads with each layer's own codecs, with the
    caller's config or from the artifact dir the file names (both gave CalibrationRequiredError)."""
    from veloxquant_mlx.integration import load_prompt_cache, save_prompt_cache

    config = KVCacheConfig(method="ratequant", bits=3, options={"kbudget": 2.5, "vbudget": 3.0})
    calibrate(small, config, _sequences(), tmp_path / "art", progress=False)
    config = config.replace(artifact_dir=str(tmp_path / "art"))
    tokens = _sequences(1, 80, seed=5)[0]
    _, caches = _forward(small, config, tokens)
    save_prompt_cache(tmp_path / "c.safetensors", caches)
    nxt = mx.array([[7]])
    expected = small(nxt, cache=caches)
    for kwargs in ({"config": config, "model": small}, {}):
        loaded = load_prompt_cache(tmp_path / "c.safetensors", **kwargs)
        assert [c.key_codec.width for c in loaded] == [c.key_codec.width for c in caches]
        assert mx.array_equal(small(nxt, cache=loaded), expected).item()


# ---- first-use calibration (`artifact_dir="auto"`, calibration.ensure_calibrated) ----------------------

class CharTokenizer:
    """Enough of a tokenizer for calibration on a tiny model: one id per character."""

    def encode(self, text, **_):
        return [ord(c) % 512 for c in text]


FIRST_USE = KVCacheConfig(method="commvq", bits=2, value_bits=3, residual_length=32, sink_tokens=4,
                          artifact_dir="auto")


@pytest.fixture
def calibration_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VELOXQUANT_CACHE_DIR", str(tmp_path))
    return tmp_path / "calibrated"


def test_first_use_calibrates_once_per_model_and_keeps_it(calibration_cache, monkeypatch):
    import veloxquant_mlx.calibration as calibration
    model = tiny_llama()
    with pytest.raises(CalibrationRequiredError, match="tokenizer"):
        KVCacheBuilder(FIRST_USE).for_model(model).build()
    calls = []
    real = calibration.calibrate
    monkeypatch.setattr(calibration, "calibrate", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
    caches = KVCacheBuilder(FIRST_USE).for_model(model, CharTokenizer()).build()
    kept = calibration.first_use_dir(FIRST_USE, model)
    assert len(calls) == 1 and kept.is_relative_to(calibration_cache) and (kept / "artifacts.json").exists()
    assert caches[0].config.artifact_dir == str(kept)
    logits = model(mx.arange(48)[None] % 500, cache=caches)
    assert bool(mx.all(mx.isfinite(logits)))
    # later builds, with or without a tokenizer and with another window, load what was kept
    KVCacheBuilder(FIRST_USE).for_model(model).build()
    KVCacheBuilder(FIRST_USE.replace(residual_length=64)).for_model(model, CharTokenizer()).build()
    assert len(calls) == 1
    # another model (other arguments) gets its own calibration
    other = tiny_llama(layers=3)
    assert calibration.first_use_dir(FIRST_USE, other) != kept
    KVCacheBuilder(FIRST_USE).for_model(other, CharTokenizer()).build()
    assert len(calls) == 2


def test_first_use_calibration_is_refused_on_an_unsupported_architecture(calibration_cache):
    from conftest import tiny_gemma3

    with pytest.raises(Exception, match="commvq"):
        KVCacheBuilder(FIRST_USE).for_model(tiny_gemma3(), CharTokenizer()).build()


def test_first_use_calibration_through_an_eval_spec(calibration_cache):
    from veloxquant_mlx.evaluation.specs import calibrated_for, parse_method_list

    model = tiny_llama()
    fp16, spec = parse_method_list("fp16,commvq:2:vbits=3,sinks=4,window=32,artifacts=auto")
    assert spec.config.artifact_dir == "auto"
    resolved = calibrated_for([fp16, spec], model, CharTokenizer())
    assert resolved[0] is fp16 and Path(resolved[1].config.artifact_dir).is_relative_to(calibration_cache)
    assert len(resolved[1].make_caches(model)) == len(model.layers)


@pytest.mark.skipif(__import__("veloxquant_mlx.kernels.emulator").kernels.emulator.compiler() is None,
                    reason="no C++20 compiler for the kernel emulator")
def test_ratequant_takes_the_formats_kernels(small, tmp_path):
    """ratequant's snippets (one file: methods/ratequant.py): on the kernel back end (emulated) a
    calibrated cache encodes with the encode kernel, the dequant kernel equals `decode`, and the
    formats' partial kernel equals the engine's MLX-ops decode of the same codes."""
    from veloxquant_mlx import EngineSettings, engine
    from veloxquant_mlx.kernels import dequant, encode, ops, partial

    config = KVCacheConfig(method="ratequant", bits=3, options={"kbudget": 2.5, "vbudget": 3.0, "renorm": True})
    calibrate(small, config, _sequences(), tmp_path, progress=False)
    settings = EngineSettings.resolve(backend="emulator")
    caches = KVCacheBuilder(config.replace(artifact_dir=str(tmp_path))).for_model(small).build(settings=settings)
    tokens = _sequences(1, 60, seed=9)[0]
    small(tokens[None, :50], cache=caches)
    for i in range(50, 60):
        small(tokens[None, i : i + 1], cache=caches)
    cache = caches[0]
    cache.flush()
    assert cache.encoded == 60
    for c in caches:
        assert encode.supported(c.store.layout, c.key_codec, c.value_codec)
        for role, codec in (("keys", c.key_codec), ("values", c.value_codec)):
            out = dequant.dequantize(ops.runner("emulator"), c.store, role, codec, c.encoded, mx.float32)
            assert mx.array_equal(out, codec.decode(c.store.fields(role))).item()
    ref_cache = KVCacheBuilder(config.replace(artifact_dir=str(tmp_path))).for_model(small).build(
        settings=EngineSettings.resolve(backend="portable"))
    small(tokens[None, :50], cache=ref_cache)
    for i in range(50, 60):
        small(tokens[None, i : i + 1], cache=ref_cache)
    for c, r in zip(caches, ref_cache):
        r.flush()
        got, want = np.array(c.store.rows[..., :60, :]), np.array(r.store.rows[..., :60, :])
        assert np.mean(got == want) >= encode.CHECK_MIN_EQUAL
    q = mx.random.normal((1, 4, 1, 32), key=mx.random.key(5))
    h = cache._history()
    ref = engine.compiled_decode(h, q, 0.2, compiled=False)
    out = partial.decode(h, q, 0.2, chunk=partial.THREADS)
    assert float(mx.max(mx.abs(out - ref))) <= 2e-5 * float(mx.max(mx.abs(ref)))


@pytest.mark.skipif(__import__("veloxquant_mlx.kernels.emulator").kernels.emulator.compiler() is None,
                    reason="no C++20 compiler for the kernel emulator")
@pytest.mark.parametrize("width, renorm", [(2.5, False), (3.25, True)])
def test_ratequant_snippets_at_fractional_widths(width, renorm):
    """Two code widths per token (the first `high` coordinates one bit wider): the encode kernel's
    rows equal `encode`'s, and the dequant kernel equals `decode`, bit for bit (head dim 128)."""
    from veloxquant_mlx.kernels import dequant, encode, ops
    from veloxquant_mlx.storage import row_layout, store_for

    kc, vc = RateCodec(128, width, seed=1, renorm=renorm), RateCodec(128, 2.0, seed=2)
    assert kc.high and kc.low == int(width)
    layout = row_layout(kc, vc)
    run = ops.runner("emulator")
    keys = mx.random.normal((1, 2, 9, 128), key=mx.random.key(1)).astype(mx.float16)
    values = mx.random.normal((1, 2, 9, 128), key=mx.random.key(2)).astype(mx.float16)
    store = store_for(kc, vc, lambda k, v: encode.encode_rows(run, layout, kc, vc, k, v))
    store.append(keys, values)
    store.flush()
    assert mx.array_equal(store.rows[..., :9, :], layout.pack(kc.encode(keys), vc.encode(values))).item()
    for role, codec in (("keys", kc), ("values", vc)):
        out = dequant.dequantize(run, store, role, codec, 9, mx.float32)
        assert mx.array_equal(out, codec.decode(store.fields(role))).item()


@pytest.mark.skipif(__import__("veloxquant_mlx.kernels.emulator").kernels.emulator.compiler() is None,
                    reason="no C++20 compiler for the kernel emulator")
@pytest.mark.parametrize("name", ["spectral", "mse+outliers", "kivi+outliers"])
def test_calibrated_formats_take_the_formats_kernels(small, tmp_path, name):
    """spectralquant's and the outliers option's decode snippets (their own files): the dequant kernel
    (emulated) equals `decode` bit for bit in every layer, and the formats' partial kernel, with the
    fp16 sinks / window where the spec has them, equals the engine's MLX-ops decode of the same codes."""
    config = CALIBRATED_SPECS[name]
    calibrate(small, config, _sequences(), tmp_path, progress=False)
    assert_format_kernels_agree(small, config.replace(artifact_dir=str(tmp_path)), _sequences(1, 100, seed=8)[0])


@pytest.mark.skipif(__import__("veloxquant_mlx.kernels.emulator").kernels.emulator.compiler() is None,
                    reason="no C++20 compiler for the kernel emulator")
def test_spectral_snippets_read_each_kv_heads_basis_at_batch_two():
    """Tokens come to the kernels flattened over batch and heads: spectralquant's decode snippet takes
    head bh % H's sigma and its encode snippet head (n / T) % H's basis and sigma (two widths at head
    dim 128, batch 2, spectra that differ per head): the rows of `encode`, and `decode` bit for bit."""
    from veloxquant_mlx.kernels import dequant, encode, ops
    from veloxquant_mlx.methods.spectralquant import SpectralCodec, learn_basis
    from veloxquant_mlx.storage import row_layout, store_for

    skew = mx.array([[4.0], [0.25]]) * mx.exp(-mx.arange(128) / 24)  # per head, per channel
    calibration = mx.random.normal((2, 400, 128), key=mx.random.key(3)) * skew[:, None, :]
    codec = SpectralCodec(128, 3, learn_basis(calibration, 3))
    assert codec.high and codec.hi_bits != codec.lo_bits
    keys = mx.random.normal((2, 2, 9, 128), key=mx.random.key(4)) * skew[None, :, None, :]
    layout = row_layout(codec, codec)
    assert encode.supported(layout, codec, codec)
    store = store_for(codec, codec, lambda k, v: encode.encode_rows(ops.runner("emulator"), layout, codec, codec, k, v))
    store.append(keys, keys)
    store.flush()
    want = layout.pack(codec.encode(keys), codec.encode(keys))
    assert float(mx.mean(store.rows[..., :9, :] == want)) >= encode.CHECK_MIN_EQUAL
    out = dequant.dequantize(ops.runner("emulator"), store, "keys", codec, 9, mx.float32)
    assert mx.array_equal(out, codec.decode(store.fields("keys"))).item()


def _outlier_base(name: str, dim: int):
    from veloxquant_mlx.methods.rabitq import RaBitQCodec

    return {"mse-renorm": lambda: MSECodec(dim, 3, 1, renorm=True), "mse": lambda: MSECodec(dim, 2, 1),
            "rabitq": lambda: RaBitQCodec(dim, 3, 1)}[name]()


@pytest.mark.skipif(__import__("veloxquant_mlx.kernels.emulator").kernels.emulator.compiler() is None,
                    reason="no C++20 compiler for the kernel emulator")
@pytest.mark.parametrize("base, count", [("mse-renorm", 8), ("rabitq", 8), ("mse", 64)],
                         ids=["mse-renorm-dense120", "rabitq-dense120", "mse-hadamard64"])
def test_outliers_encode_snippet_stores_what_encode_does(base, count):
    """The outliers option's encode snippet (emulated; batch 2, two kv heads whose outlier channels
    differ): the int8 channels and their fp16 scale, and its base's snippet on the other channels, at
    dim D - K (a dense rotation at 120, a Hadamard one at 64): the rows of `encode`."""
    from veloxquant_mlx.kernels import encode, ops
    from veloxquant_mlx.storage import row_layout

    skew = mx.exp(-mx.arange(128) / 40) * mx.where(mx.arange(128) % 17 == 3, 6.0, 1.0)
    calibration = mx.random.normal((2, 300, 128), key=mx.random.key(3)) * mx.stack([skew, skew[::-1]])[:, None, :]
    channels = top_channels(calibration, count)
    assert not mx.array_equal(channels[0], channels[1]).item()
    codec = OutlierCodec(_outlier_base(base, 128 - count), channels, 128)
    values = MSECodec(128, 3, 2)
    layout = row_layout(codec, values)
    assert encode.supported(layout, codec, values)
    keys = (mx.random.normal((2, 2, 13, 128), key=mx.random.key(4)) * mx.stack([skew, skew[::-1]])[None, :, None, :])
    keys = keys.astype(mx.float16)
    rows = encode.encode_rows(ops.runner("emulator"), layout, codec, values, keys, keys)
    want = layout.pack(codec.encode(keys), values.encode(keys))
    assert float(mx.mean(rows == want)) >= encode.CHECK_MIN_EQUAL
    ref = codec.decode(codec.encode(keys))
    got = codec.decode(layout.views(rows)[0])
    assert float(mx.max(mx.abs(got - ref))) <= 1e-2 * float(mx.max(mx.abs(ref)))


@pytest.mark.skipif(__import__("shutil").which("nvcc") is None, reason="nvcc not installed")
# each nvcc run costs seconds: `make test` compiles the outliers option's kernels (vecinfer's encode kernel
# compiles in tests/test_vecinfer.py), `make test-all` all three
@pytest.mark.parametrize("name", [pytest.param("spectral", marks=pytest.mark.slow), "mse+outliers",
                                  pytest.param("vecinfer", marks=pytest.mark.slow)])
def test_calibrated_partial_kernels_compile_with_nvcc(name, tmp_path):
    """spectralquant's, vecinfer's and the outliers option's partial kernel for the 8B shape (head dim
    128, 8 kv heads, GQA 4) compiles for sm_90 without spills, in the shared memory it counts, and so
    does their encode kernel."""
    from veloxquant_mlx.kernels import encode
    from veloxquant_mlx.methods.spectralquant import SpectralCodec, learn_basis
    from veloxquant_mlx.methods.vecinfer import ProductVQCodec, learn_codebooks
    from veloxquant_mlx.storage import row_layout, store_for

    calibration = mx.random.normal((8, 400, 128), key=mx.random.key(3)) * mx.exp(-mx.arange(128) / 24)
    if name == "spectral":
        key_codec = value_codec = SpectralCodec(128, 3, learn_basis(calibration, 3))
    elif name == "vecinfer":  # 2 bits: 256 centroids of 4 coordinates per head and sub-vector
        key_codec = ProductVQCodec(128, 8, learn_codebooks(calibration, 4, 8, 0, mx.ones((8, 128))))
        value_codec = MSECodec(128, 3, 2)
    else:
        key_codec = OutlierCodec(MSECodec(120, 3, 1), top_channels(calibration, 8), 128)
        value_codec = MSECodec(128, 4, 2)
    layout = row_layout(key_codec, value_codec)
    store = store_for(key_codec, value_codec, lambda k, v: layout.pack(key_codec.encode(k), value_codec.encode(v)))
    keys = mx.random.normal((1, 8, 300, 128), key=mx.random.key(4))
    store.append(keys, keys)
    store.flush()
    assert_partial_kernel_compiles(store, key_codec, value_codec, 4, tmp_path)
    assert encode.supported(layout, key_codec, value_codec)
    compile_encode_kernel(encode.plan(layout, key_codec, value_codec, 8, "float16"), tmp_path)


def test_describe_names_ratequants_budgets_not_its_nominal_widths():
    """`bits`/`value_bits` only default ratequant's budgets, so the label names the budgets."""
    config = KVCacheConfig(method="ratequant", bits=4, value_bits=4, options={"kbudget": 2.5, "vbudget": 3.0})
    assert config.describe() == "ratequant budgets K2.5/V3"
    assert KVCacheConfig(method="ratequant", bits=3, value_bits=2).describe() == "ratequant budgets K3/V2"
    assert KVCacheConfig(method="turboquant_mse", bits=3, value_bits=2).describe() == "turboquant_mse K3/V2"
