"""VecInfer: smoothing + Hadamard + product VQ of keys, LUT scores, calibrated codebooks."""

import json

import mlx.core as mx
import numpy as np
import pytest

from conftest import assert_engine_paths_agree, assert_format_kernels_agree, compile_encode_kernel, random_sequences

from veloxquant_mlx.calibration import calibrate
from veloxquant_mlx.config import KVCacheConfig
from veloxquant_mlx.integration import KVCacheBuilder
from veloxquant_mlx.storage import stored_bits_per_token
from veloxquant_mlx.methods.outliers import CalibrationRequiredError
from veloxquant_mlx.methods.vecinfer import (ProductVQCodec, kmeans, kmeans_plus_plus, learn_codebooks, nearest_centroid,
                                             smoothing_factors)


def _sequences(n=2, length=256, vocab=512, seed=0):
    return random_sequences(n, length, vocab, seed)


def _forward(model, config, tokens):
    caches = KVCacheBuilder(config).for_model(model).build()
    return model(tokens[None], cache=caches), caches


def _skewed_keys(heads=2, n=1024, dim=32, seed=0):
    """Keys with a few large channels (as real keys have) and queries of another spread."""
    scale = np.linspace(0.2, 1.0, dim).astype(np.float32)
    scale[[3, 17]] = 12.0
    keys = mx.random.normal((heads, n, dim), key=mx.random.key(seed)) * mx.array(scale)
    queries = mx.random.normal((2 * heads, n, dim), key=mx.random.key(seed + 1)) * 2.0
    return keys, queries


@pytest.fixture(scope="module")
def key_codec():
    keys, queries = _skewed_keys()
    return ProductVQCodec(32, 8, learn_codebooks(keys, 4, 8, 0, smoothing_factors(keys, queries, 0.5))), keys


def test_lut_score_equals_dequantize_then_dot(key_codec):
    codec, keys = key_codec
    fields = codec.encode(keys[None, :, :300])
    q = codec.to_domain(mx.random.normal((1, 2, 5, 32), key=mx.random.key(3)))
    lut = codec.score(q, fields)
    dense = q @ codec.decode(fields).swapaxes(-1, -2)
    assert lut.shape == (1, 2, 5, 300)
    np.testing.assert_allclose(np.array(lut), np.array(dense), rtol=1e-5, atol=1e-4)
    # the table itself: entry (m, c) is the query's sub-vector m dotted with centroid c of head h
    tables = np.array(codec.lookup_tables(q)).reshape(1, 2, 5, 8, 256)
    books = np.array(codec.codebooks)
    qs = np.array(q).reshape(1, 2, 5, 8, 4)
    np.testing.assert_allclose(tables[0, 1, 2, 6], books[1, 6] @ qs[0, 1, 2, 6], rtol=1e-5, atol=1e-5)


def test_smooth_scaling_preserves_q_dot_k_and_inverts(key_codec):
    codec, keys = key_codec
    assert not codec.format.orthogonal_domain and float(mx.max(mx.abs(codec.smooth - 1)).item()) > 0.5
    k = keys[None, :, :40]
    q = mx.random.normal((1, 2, 3, 32), key=mx.random.key(4)) * 3.0
    exact = q @ k.swapaxes(-1, -2)
    mapped = codec.to_domain(q) @ codec.encode_map(k).swapaxes(-1, -2)
    np.testing.assert_allclose(np.array(mapped), np.array(exact), rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(np.array(codec.from_domain(codec.encode_map(k))), np.array(k), rtol=1e-4, atol=1e-4)
    # query heads (GQA: head h // rep) take their kv head's factors
    q_heads = mx.random.normal((1, 4, 3, 32), key=mx.random.key(5))
    mapped = codec.to_domain(q_heads).reshape(1, 2, 6, 32) @ codec.encode_map(k).swapaxes(-1, -2)
    np.testing.assert_allclose(np.array(mapped), np.array(q_heads.reshape(1, 2, 6, 32) @ k.swapaxes(-1, -2)),
                               rtol=1e-4, atol=1e-3)
    # and the smoothing spreads the large channels: the smoothed keys' channel maxima are flatter
    spread = lambda x: float((mx.max(mx.abs(x), axis=(0, 1)).max() / mx.max(mx.abs(x), axis=(0, 1)).min()).item())
    assert spread(keys / codec.smooth[:, None, :]) < spread(keys) / 3


def test_nearest_centroid_never_builds_the_difference_tensor():
    """65536 tokens x 256 centroids x 8 coordinates is 512 MiB of float32 differences: the search
    must stay far below that (and agree with the brute-force answer)."""
    x = mx.random.normal((1, 65536, 8), key=mx.random.key(6))
    c = mx.random.normal((1, 256, 8), key=mx.random.key(7))
    mx.eval(x, c)
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    codes = nearest_centroid(x, c)
    mx.eval(codes)
    peak = mx.get_peak_memory() - before
    assert peak < (65536 * 256 * 8 * 4) / 4, peak
    sub = x[:, :2048]
    brute = mx.argmin(mx.sum((sub[:, :, None] - c[:, None]) ** 2, axis=-1), axis=-1)
    assert mx.array_equal(codes[:, :2048], brute.astype(mx.uint32)).item()


def test_kmeans_finds_separated_clusters():
    centers = mx.random.normal((3, 16, 4), key=mx.random.key(8)) * 10
    points = mx.repeat(centers, 64, axis=1) + 0.1 * mx.random.normal((3, 1024, 4), key=mx.random.key(9))
    error = lambda books: float(mx.mean(mx.min(mx.sum((points[:, :, None] - books[:, None]) ** 2, -1), -1)).item())
    books = kmeans(points, 16, iterations=10, seed=1)
    assert error(books) < 0.1  # every true cluster found (noise: 4 coordinates of variance 0.01)
    assert error(books) <= error(kmeans(points, 16, iterations=0, seed=1))  # Lloyd steps never hurt


def test_nearest_centroid_is_the_same_at_any_block_size():
    x = mx.random.normal((6, 3000, 4), key=mx.random.key(1))
    c = mx.random.normal((6, 256, 4), key=mx.random.key(2))
    want = nearest_centroid(x, c)
    for block in (1 << 12, 1 << 18, 1 << 30):
        assert mx.array_equal(nearest_centroid(x, c, block), want).item()


def test_kmeans_plus_plus_draws_each_group_from_its_own_distances():
    """Every point of a group sits on one spot but one: once a seed is on the spot, only that
    point is at a positive distance, so the next seed must be it, in every group (the draws of
    all groups share one sorted search)."""
    rng = np.random.default_rng(0)
    x = np.repeat(rng.normal(size=(4, 1, 3)).astype(np.float32), 500, axis=1)
    far = [3, 499, 0, 250]
    for g, i in enumerate(far):
        x[g, i] += 5.0 * (g + 1)
    seeds = kmeans_plus_plus(x, 3, seed=1)
    for g, i in enumerate(far):
        assert {tuple(row) for row in seeds[g]} >= {tuple(x[g, i]), tuple(x[g, (i + 1) % 500])}


def test_kmeans_plus_plus_seeds_beat_random_points():
    """On clustered points the greedy seeds' distortion is below that of random data points."""
    rng = np.random.default_rng(3)
    centers = rng.normal(size=(4, 32, 4)) * 5
    x = (np.repeat(centers, 40, axis=1) + 0.3 * rng.normal(size=(4, 1280, 4))).astype(np.float32)

    def distortion(books):
        return float(np.mean(np.min(np.sum((x[:, :, None] - books[:, None]) ** 2, -1), -1)))

    random_points = x[:, rng.choice(1280, 32, replace=False)]
    assert distortion(kmeans_plus_plus(x, 32, seed=0)) < 0.5 * distortion(random_points)


def test_missing_calibration_raises(small):
    for config in (KVCacheConfig(method="vecinfer", bits=2),
                   KVCacheConfig(method="vecinfer", bits=1, options={"values": "vq"})):
        with pytest.raises(CalibrationRequiredError, match="vecinfer"):
            _forward(small, config, mx.array([1, 2, 3]))
    with pytest.raises(ValueError, match="set bits to 2"):
        KVCacheConfig(method="vecinfer", bits=1, options={"sub_dim": 4, "centroid_bits": 6})
    with pytest.raises(ValueError, match="values must be"):
        KVCacheConfig(method="vecinfer", bits=2, options={"values": "fp16"})


@pytest.mark.parametrize("bits,options,key_bits,value_bits", [
    (2, {}, 2 * 32, 2 * 32 + 16),  # K: 8 codes of 8 bits; V: turboquant_mse:2 (codes + fp16 norm)
    (2, {"values": "vq"}, 2 * 32, 2 * 32),
    (1, {"values": "vq"}, 1 * 32, 1 * 32),  # 4 codes of 8 bits (256 centroids of 8 coordinates)
    # 8 codes of 6 bits at head dim 32 fill 2 whole words (at head dim 64, 16 codes fill 3: 1.5 bits)
    (2, {"sub_dim": 4, "centroid_bits": 6}, 64, 2 * 32 + 16),
])
def test_bytes_per_token_match_the_stated_width(small, tmp_path, bits, options, key_bits, value_bits):
    config = KVCacheConfig(method="vecinfer", bits=bits, options=options)
    calibrate(small, config, _sequences(), tmp_path, progress=False)
    _, caches = _forward(small, config.replace(artifact_dir=str(tmp_path)), _sequences(1, 512, seed=2)[0])
    assert caches[0].key_codec.format.bits_per_token == key_bits
    assert caches[0].value_codec.format.bits_per_token == value_bits
    row_bits = -(-(key_bits + value_bits) // 32) * 32  # stored in rows of whole words
    assert stored_bits_per_token(caches[0].key_codec, caches[0].value_codec) == row_bits
    stated = sum(c.kv_heads * 512 * row_bits / 8 for c in caches)
    measured = sum(c.nbytes for c in caches)
    assert abs(measured - stated) / stated < 0.03, (measured, stated)


def test_vq_beats_scalar_codes_at_equal_bits(key_codec):
    """On keys with outlier channels, smoothing + Hadamard + product VQ at 2 bits scores closer to
    the exact q.k than TurboQuant-MSE at 2 bits (which also spends 16 bits on a norm)."""
    from veloxquant_mlx.methods.turboquant_mse import MSECodec

    codec, keys = key_codec
    held_out, queries = _skewed_keys(seed=11)
    k, q = held_out[None, :, :512], queries[None, :2, :64]
    exact = q @ k.swapaxes(-1, -2)
    vq = codec.score(codec.to_domain(q), codec.encode(k))
    mse = MSECodec(32, 2, 0)
    scalar = mse.score(mse.to_domain(q), mse.encode(k))
    err = lambda s: float(mx.mean((s - exact) ** 2).item())
    assert err(vq) < err(scalar)


SPECS = {
    "keys-vq": KVCacheConfig(method="vecinfer", bits=2, sink_tokens=2),
    "kv-vq-centered": KVCacheConfig(method="vecinfer", bits=2, center=True, options={"values": "vq"}),
    "window": KVCacheConfig(method="vecinfer", bits=2, residual_length=8, sink_tokens=2, options={"values": "vq"}),
    "no-smooth": KVCacheConfig(method="vecinfer", bits=1, options={"smooth": False, "values": "vq"}),
}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_engine_paths_agree(small, tmp_path, name):
    """The compiled decode step (LUT scores), the generic blockwise path and attention over the
    dequantized cache agree; the fused SDPA prefill too where the key domain is orthogonal."""
    config = SPECS[name]
    calibrate(small, config, _sequences(), tmp_path, progress=False)
    assert_engine_paths_agree(small, config.replace(artifact_dir=str(tmp_path)), _sequences(1, 100, seed=8)[0])


@pytest.mark.skipif(__import__("veloxquant_mlx.kernels.emulator").kernels.emulator.compiler() is None,
                    reason="no C++20 compiler for the kernel emulator")
@pytest.mark.parametrize("name", ["keys-vq", "window"])
def test_format_kernels_decode_the_codebooks_in_place(small, tmp_path, name):
    """The decode snippet (per-head, per-sub-vector codebooks as one table): the dequant kernel equals
    `decode` and the formats' partial kernel the engine's ops decode (emulated; vq values in "window")."""
    config = SPECS[name]
    calibrate(small, config, _sequences(), tmp_path, progress=False)
    assert_format_kernels_agree(small, config.replace(artifact_dir=str(tmp_path)), _sequences(1, 100, seed=8)[0])


def _head_dim_128_codecs(smooth: bool):
    """A 2-bit key codec of two kv heads with codebooks (and smoothing) that differ per head, and
    turboquant_mse values."""
    from veloxquant_mlx.methods.turboquant_mse import MSECodec

    calibration = mx.random.normal((2, 600, 128), key=mx.random.key(3)) * mx.exp(-mx.arange(128) / 48)
    scales = mx.exp(0.3 * mx.random.normal((2, 128), key=mx.random.key(5))) if smooth else None
    return ProductVQCodec(128, 8, learn_codebooks(calibration, 4, 8, 0, scales)), MSECodec(128, 3, 2)


@pytest.mark.skipif(__import__("veloxquant_mlx.kernels.emulator").kernels.emulator.compiler() is None,
                    reason="no C++20 compiler for the kernel emulator")
@pytest.mark.parametrize("smooth", [True, False], ids=["smooth", "plain"])
def test_encode_kernel_stores_what_encode_does(smooth):
    """The encode snippet (emulated; batch 2, two kv heads with their own codebooks and scales): the
    rows of `encode`, whose nearest-centroid search it runs in the kernel."""
    from veloxquant_mlx.kernels import encode, ops
    from veloxquant_mlx.storage import row_layout

    kc, vc = _head_dim_128_codecs(smooth)
    layout = row_layout(kc, vc)
    assert encode.supported(layout, kc, vc)
    keys = (mx.random.normal((2, 2, 50, 128), key=mx.random.key(1)) * mx.exp(-mx.arange(128) / 48)).astype(mx.float16)
    values = mx.random.normal((2, 2, 50, 128), key=mx.random.key(2)).astype(mx.float16)
    rows = encode.encode_rows(ops.runner("emulator"), layout, kc, vc, keys, values)
    want = layout.pack(kc.encode(keys), vc.encode(values))
    assert float(mx.mean(rows == want)) >= encode.CHECK_MIN_EQUAL


@pytest.mark.skipif(__import__("shutil").which("nvcc") is None, reason="nvcc not installed")
def test_encode_kernel_compiles_with_nvcc(tmp_path):
    from veloxquant_mlx.kernels import encode
    from veloxquant_mlx.storage import row_layout

    kc, vc = _head_dim_128_codecs(True)
    compile_encode_kernel(encode.plan(row_layout(kc, vc), kc, vc, 8, "float16"), tmp_path)


def test_artifacts_and_prompt_cache_round_trip(small, tmp_path):
    from veloxquant_mlx.integration import load_prompt_cache, save_prompt_cache

    config = KVCacheConfig(method="vecinfer", bits=2, options={"values": "vq"})
    record = calibrate(small, config, _sequences(), tmp_path / "art", progress=False)
    assert record["tokens"] == 512
    meta = json.loads((tmp_path / "art" / "artifacts.json").read_text())
    assert {e["layer"] for e in meta["codecs"]} == {0, 1}
    stored = mx.load(str(tmp_path / "art" / "codecs.safetensors"))
    assert stored["1.keys.32.heads.codebooks"].shape == (2, 8, 256, 4)  # per head and sub-vector
    config = config.replace(artifact_dir=str(tmp_path / "art"))
    _, caches = _forward(small, config, _sequences(1, 80, seed=5)[0])
    assert mx.array_equal(caches[1].key_codec.codebooks, stored["1.keys.32.heads.codebooks"]).item()
    assert not mx.array_equal(caches[0].key_codec.codebooks, caches[1].key_codec.codebooks).item()
    save_prompt_cache(tmp_path / "c.safetensors", caches)
    nxt = mx.array([[7]])
    expected = small(nxt, cache=caches)
    for kwargs in ({"config": config, "model": small}, {}):
        loaded = load_prompt_cache(tmp_path / "c.safetensors", **kwargs)
        assert mx.array_equal(small(nxt, cache=loaded), expected).item()


def test_quality_on_a_random_model_beats_scalar_codes(small, tmp_path):
    """End to end: logits with vecinfer K2/V2 (values=vq) are nearer fp16 than turboquant_mse:2."""
    config = KVCacheConfig(method="vecinfer", bits=2, options={"values": "vq"})
    calibrate(small, config, _sequences(), tmp_path, progress=False)
    tokens = _sequences(1, 120, seed=12)[0]
    fp16 = small(tokens[None])
    vq, _ = _forward(small, config.replace(artifact_dir=str(tmp_path)), tokens)
    scalar, _ = _forward(small, KVCacheConfig(method="turboquant_mse", bits=2), tokens)
    err = lambda a: float(mx.mean((a - fp16) ** 2).item())
    assert err(vq) < err(scalar)


@pytest.mark.model
def test_coherent_generation_on_smollm2(smollm2, tmp_path):
    """2-bit vecinfer calibrated on the packaged text, with the presets' 4 fp16 sinks, teacher-forced over
    the fp16 model's 12 greedy tokens after three examples of capitals: it predicts the first two (the
    answer) and at least 9 of the 12."""
    from conftest import agreement_with_reference, forced_logprobs, greedy_reference
    from veloxquant_mlx.calibration import calibration_tokens
    from veloxquant_mlx.texts import SAMPLE_TEXT

    model, tokenizer = smollm2
    config = KVCacheConfig(method="vecinfer", bits=2)
    calibrate(model, config, calibration_tokens(tokenizer, SAMPLE_TEXT.read_text(), 1, 512), tmp_path, progress=False)
    # three examples before the question, so that most of the prompt goes to codes past the 4 sinks
    prompt = tokenizer.encode("The capital of France is Paris. The capital of Spain is Madrid. The capital of Italy "
                              "is Rome. The capital of Germany is")
    tokens, reference = greedy_reference(model, prompt, 12)
    caches = KVCacheBuilder(config.replace(artifact_dir=str(tmp_path), sink_tokens=4)).for_model(model).build()
    logprobs = forced_logprobs(model, prompt, tokens, caches)
    agree, kl = agreement_with_reference(reference, tokens, logprobs)
    print(f"vecinfer K2: {agree}/12, KL {kl:.3f}")
    assert mx.argmax(logprobs[:2], axis=-1).tolist() == tokens[:2], (tokenizer.decode(tokens), agree, kl)
    assert agree >= 9, (agree, kl)


def test_kernels_read_one_copy_of_a_codecs_tables():
    """The dequant, partial and encode kernels of a codec take one device array of its constant
    tables, which holds the 1 MB-per-layer codebooks once (each kernel held its own copy before)."""
    from veloxquant_mlx.kernels import dequant, encode, partial
    from veloxquant_mlx.storage import row_layout

    kc, vc = _head_dim_128_codecs(True)
    layout = row_layout(kc, vc)
    tables = dequant.codec_tables(kc)
    assert encode.program(layout, kc, vc).tables[0] is tables
    assert dequant._program(layout, "keys", kc).tables is tables
    for prog in (partial._fitting_program(layout, kc, vc, 4, "cuda"), partial._program(layout, kc, vc, 0, False)):
        assert prog.tables[0] is tables
    codebooks = kc.table.size
    assert codebooks <= tables.size < 2 * codebooks
    assert tables.array() is tables.array()
