"""Weight quantization: rotations, QuantizedLinear, quantize_model, the reservoir, the LUT kernel."""

import json
import struct

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import compile_cuda_without_spills, config_for, emulate_gpu_kernels, tiny_llama

from veloxquant_mlx.codebooks import lloyd_max
from veloxquant_mlx.rotations import hadamard_base
from veloxquant_mlx.weights import (QuantizedLinear, ReservoirError, StructuredRotation, fingerprint,
                                    graft_reservoir, load_reservoir, quantize_model, quantized_layers,
                                    save_reservoir)
from veloxquant_mlx.weights import reservoir as reservoir_module
from veloxquant_mlx.weights.rotation import hadamard_blocks
from veloxquant_mlx.weights.shared import rotating_norms

NON_HADAMARD_DIM = 176  # 11 * 16: mx.hadamard_transform does not support it


def _weight(out, dim, seed=0):
    return mx.array(np.random.default_rng(seed).standard_normal((out, dim)).astype(np.float32))


def _dense(layer: QuantizedLinear) -> np.ndarray:
    """The layer's effective float weight, decoded through its own forward on the identity."""
    return np.array(layer(mx.eye(layer.in_features))).T


@pytest.mark.parametrize("dim", [64, 96, 176, 200, 577])
def test_structured_rotation_is_orthogonal(dim):
    assert hadamard_base(NON_HADAMARD_DIM) is None
    rotation = StructuredRotation.seeded(dim, seed=3)
    assert sum(rotation.blocks) == dim
    assert all(hadamard_base(b) is not None for b in rotation.blocks)
    matrix = np.array(rotation.apply(mx.eye(dim)))
    np.testing.assert_allclose(matrix @ matrix.T, np.eye(dim), atol=2e-5)
    # It mixes: no output coordinate is a copy of one input coordinate.
    assert np.abs(matrix).max() < 0.9
    if hadamard_base(dim) is None:
        assert rotation.stages == 2 and rotation.perms is not None
    # State is O(dim) numbers, never a dense matrix.
    assert sum(a.size for a in rotation.state().values()) <= 2 * rotation.stages * dim


def test_hadamard_blocks_cover_dim():
    assert hadamard_blocks(576) == (512, 64)
    assert hadamard_blocks(4864) == (4096, 768)
    assert hadamard_blocks(1536) == (1536,)
    with pytest.raises(ValueError):
        hadamard_blocks(0)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("dim", [128, NON_HADAMARD_DIM])
def test_quantized_linear_packs_and_matches_its_codes(bits, dim):
    weight = _weight(48, dim, seed=bits)
    layer = QuantizedLinear.from_weight(weight, bits, seed=1, column_alpha=0.0)
    # Truly packed: bits * dim bits per row, rounded up to whole 32-bit words.
    assert layer.codes.dtype == mx.uint32
    assert layer.codes.shape == (48, -(-dim * bits // 32))
    assert layer.codes.nbytes * 8 / (48 * dim) <= bits + 32 / dim
    overhead = layer.scales.nbytes + layer.codebook.nbytes + sum(a.nbytes for a in layer.rotation.state().values())
    assert layer.storage_nbytes() == layer.codes.nbytes + overhead
    # Forward = x (W_hat)^T for W_hat decoded from the codes.
    x = mx.array(np.random.default_rng(9).standard_normal((3, 5, dim)).astype(np.float32))
    w_hat = _dense(layer)
    np.testing.assert_allclose(np.array(layer(x)), np.array(x) @ w_hat.T, rtol=1e-4, atol=1e-4)
    # And W_hat is W up to the Lloyd-Max error of a Gaussian (the least-squares scale only lowers it).
    error = np.linalg.norm(w_hat - np.array(weight)) ** 2 / np.linalg.norm(np.array(weight)) ** 2
    assert error < 1.25 * lloyd_max("gaussian", bits).mse


def test_bias_and_input_scales_are_applied():
    weight, bias = _weight(16, 64), mx.arange(16).astype(mx.float32)
    layer = QuantizedLinear.from_weight(weight, 4, bias=bias, column_alpha=0.5)
    assert "input_scales" in layer
    x = _weight(2, 64, seed=5)
    np.testing.assert_allclose(np.array(layer(x)), np.array(x) @ _dense_no_bias(layer).T + np.array(bias),
                               rtol=1e-4, atol=1e-4)


def _dense_no_bias(layer):
    return _dense(layer) - np.array(layer.bias)[:, None]


def test_group_scales_lower_the_error_of_uneven_groups():
    rng = np.random.default_rng(0)
    # Rows whose rotated groups differ in scale cannot be fit by one row scale as well.
    weight = mx.array(rng.standard_normal((64, 256)).astype(np.float32))
    row = QuantizedLinear.from_weight(weight, 3, column_alpha=0.0)
    grouped = QuantizedLinear.from_weight(weight, 3, group_size=64, column_alpha=0.0)
    assert grouped.scales.shape == (64, 4)
    w = np.array(weight)
    assert np.linalg.norm(_dense(grouped) - w) <= np.linalg.norm(_dense(row) - w) * 1.001
    with pytest.raises(ValueError):
        QuantizedLinear.from_weight(weight, 3, group_size=100)
    with pytest.raises(ValueError):
        QuantizedLinear.from_weight(weight, 5)


def _tiny(hidden=NON_HADAMARD_DIM):
    return tiny_llama(hidden=hidden, heads=8, kv_heads=2, vocab=128)


def test_quantize_model_replaces_linear_layers_in_place_and_skips():
    model = _tiny()
    tokens = mx.array([[1, 5, 9, 3, 7, 2]])
    before = model(tokens)
    fp = fingerprint(model)
    out = quantize_model(model, 4, seed=0, skip=["o_proj"], progress=False)
    assert out is model
    names = [name for name, _ in quantized_layers(model)]
    assert len(names) == 2 * 6 and not any("o_proj" in n for n in names)
    assert isinstance(model.model.layers[0].self_attn.o_proj, nn.Linear)
    assert fingerprint(model) == fp  # a quantized model still matches its base
    after = model(tokens)
    agree = (mx.argmax(after, -1) == mx.argmax(before, -1)).mean().item()
    assert agree > 0.5 and mx.isfinite(after).all().item()


def test_quantized_model_runs_with_a_compressed_kv_cache():
    from veloxquant_mlx import KVCacheBuilder

    model = quantize_model(_tiny(hidden=128), 3, progress=False)
    tokens = mx.array([[1, 5, 9, 3, 7, 2, 4, 4]])
    reference = model(tokens)
    for method in ("fp16", "turboquant_mse"):
        caches = KVCacheBuilder(config_for(method, 4)).for_model(model).build()
        logits = model(tokens, cache=caches)
        assert mx.isfinite(logits).all().item()
        assert (mx.argmax(logits, -1) == mx.argmax(reference, -1)).mean().item() > 0.5


@pytest.fixture()
def saved(tmp_path):
    model = quantize_model(_tiny(), 3, seed=2, group_size=16, share_rotations=True, progress=False)
    path = save_reservoir(model, tmp_path / "model.vqw", meta={"bits": 3})
    return model, path


def test_reservoir_round_trip_is_bit_identical(saved):
    model, path = saved
    tokens = mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    expected = model(tokens)
    fresh = _tiny()
    graft_reservoir(fresh, path)
    assert mx.array_equal(fresh(tokens), expected).item()
    layers, header = load_reservoir(path)
    assert header["meta"] == {"bits": 3}
    assert len(layers) == len(quantized_layers(model)) + len(rotating_norms(model)) == 14 + 4
    # Tensors of a page or more are page-aligned; all are aligned to 64 bytes.
    _, start = reservoir_module.read_header(path)
    assert start % reservoir_module.PAGE == 0
    for entry in header["layers"].values():
        for t in entry["tensors"].values():
            assert t["offset"] % (reservoir_module.PAGE if t["nbytes"] >= reservoir_module.PAGE else 64) == 0


def test_reservoir_rejects_truncated_files(saved):
    _, path = saved
    data = path.read_bytes()
    for size in (10, 200, len(data) - 1):
        path.write_bytes(data[:size])
        with pytest.raises(ReservoirError, match="truncated"):
            load_reservoir(path)


def test_reservoir_rejects_corrupted_data_and_header(saved):
    _, path = saved
    data = bytearray(path.read_bytes())
    header, start = reservoir_module.read_header(path)
    codes = header["layers"]["model.layers.0.self_attn.q_proj"]["tensors"]["codes"]
    data[start + codes["offset"] + 3] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(ReservoirError, match="corrupted in .*codes"):
        load_reservoir(path)
    data[start + codes["offset"] + 3] ^= 0x10
    data[60] ^= 0x01  # inside the JSON header
    path.write_bytes(bytes(data))
    with pytest.raises(ReservoirError, match="header corrupted"):
        load_reservoir(path)


def test_reservoir_rejects_other_versions_and_models(saved):
    _, path = saved
    data = bytearray(path.read_bytes())
    struct.pack_into("<I", data, 8, reservoir_module.FORMAT_VERSION + 1)
    other = path.with_name("v2.vqw")
    other.write_bytes(bytes(data))
    with pytest.raises(ReservoirError, match="format version"):
        load_reservoir(other)
    other.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ReservoirError, match="not a VeloxQuant"):
        load_reservoir(other)
    with pytest.raises(ReservoirError, match="another model"):
        graft_reservoir(_tiny(hidden=128), path)
    different_norms = _tiny()
    different_norms.model.norm.weight = different_norms.model.norm.weight * 2
    with pytest.raises(ReservoirError, match="another model"):
        graft_reservoir(different_norms, path)


@pytest.mark.parametrize("layout, rpw", [("word", 1), ("word", 2), ("vec", 1), ("vec", 4)])
def test_lut_kernel_matches_the_tiled_matmul_in_the_emulator(layout, rpw):
    """Both chunk layouts, one or several output rows per warp (37 rows: a ragged last block)."""
    from veloxquant_mlx.kernels import emulator, launch
    from veloxquant_mlx.weights import kernel

    if emulator.compiler() is None:
        pytest.skip("no C++20 compiler for the kernel emulator")
    # 100 at 3 bits ends in a partial chunk of codes (32 per chunk); at 4 bits "vec" loads 32 codes at once
    for bits, dim, group, rows in ((3, NON_HADAMARD_DIM, None, 3), (2, 128, 16, 1), (3, 100, None, 2),
                                   (4, 256, None, 8), (4, 96, None, 2), (2, 64, None, 1)):
        layer = QuantizedLinear.from_weight(_weight(37, dim, seed=bits), bits, group_size=group)
        x = layer.rotation.apply(_weight(rows, dim, seed=7))
        expected = np.array(layer.tiled_matmul(x))
        plan = kernel.plan(rows, dim, 37, bits, layer.scales.shape[1], "float32", "float32", layout=layout, rpw=rpw)
        (got,) = launch.run_emulator(plan, [x, layer.codes, layer.scales, layer.codebook])
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    for d_in, rpw in ((4096, 1), (14336, 1)):  # the defaults (docs/methods.md, "GPU decode speed")
        default = dict(kernel.plan(1, d_in, 4096, 4, 1, "float16", "float16").template)
        assert (default["RPW"], default["CW"]) == (rpw, 1)


def test_quantize_weights_cli_writes_a_loadable_folder(tmp_path, monkeypatch):
    from veloxquant_mlx import models
    from veloxquant_mlx.cli import main
    from veloxquant_mlx.weights import directory

    monkeypatch.setattr(models, "load_model", lambda name, dequantize=None: (_tiny(hidden=128), None))
    monkeypatch.setattr(models, "model_source", lambda name: name)
    assert main(["quantize-weights", "--model", "tiny", "--bits", "2",
                 "--out", str(tmp_path / "q")]) == 0
    config = json.loads((tmp_path / "q" / "weights.json").read_text())
    assert config["bits"] == 2 and config["base_model"] == "tiny" and config["share_rotations"] is False
    assert directory.is_quantized_dir(tmp_path / "q")
    loaded, _ = directory.load_quantized_dir(tmp_path / "q")
    linear = [m for _, m in loaded.named_modules() if isinstance(m, (nn.Linear, QuantizedLinear))]
    assert len(linear) == 14 and all(isinstance(m, QuantizedLinear) for m in linear)
    assert not rotating_norms(loaded)
    assert isinstance(loaded.model.embed_tokens, nn.Embedding)
    from veloxquant_mlx.weights import QuantizedEmbedding

    assert main(["quantize-weights", "--model", "tiny", "--bits", "3", "--embeddings", "--share-rotations",
                 "--out", str(tmp_path / "e")]) == 0
    assert json.loads((tmp_path / "e" / "weights.json").read_text())["embeddings"] is True
    loaded, _ = directory.load_quantized_dir(tmp_path / "e")
    assert isinstance(loaded.model.embed_tokens, QuantizedEmbedding)
    assert len(rotating_norms(loaded)) == 4  # --share-rotations


@pytest.mark.skipif(__import__("shutil").which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("shape", [(1, 4096, 4096, 4, 1, "float16"),
                                   pytest.param((5, 576, 300, 3, 9, "float32"), marks=pytest.mark.slow)],
                         ids=["8b-fp16", "odd-fp32"])
def test_lut_kernel_cuda_source_compiles_with_nvcc(shape, tmp_path):
    """The CUDA translation unit MLX would build compiles for sm_90 without spills (each nvcc run costs
    seconds: `make test` compiles the 8B shape's, `make test-all` both)."""
    from veloxquant_mlx.kernels import templates
    from veloxquant_mlx.weights import kernel

    *dims, x = shape
    plan = kernel.plan(*dims, x, x)
    src = tmp_path / "lut.cu"
    ins = {"x": x, "codes": "uint32", "scales": "float16", "lut": "float32"}
    src.write_text(templates.render_cuda("lut_matmul", plan.template, ins, {"out": x}, mlx_header=False))
    compile_cuda_without_spills(src, tmp_path / "lut.o")


def test_quantize_model_takes_mlx_quantized_layers():
    """A model loaded quantized by MLX (the GPU default) is dequantized layer by layer first."""
    model = _tiny(hidden=128)
    nn.quantize(model, group_size=32, bits=8, class_predicate=lambda _, m: isinstance(m, nn.Linear))
    tokens = mx.array([[1, 2, 3, 4]])
    before = model(tokens)
    fp = fingerprint(model)
    quantize_model(model, 4, progress=False)
    assert not any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())
    assert fingerprint(model) == fp
    assert (mx.argmax(model(tokens), -1) == mx.argmax(before, -1)).mean().item() > 0.5


@pytest.mark.model
def test_smollm2_folder_reloads_bit_identical(tmp_path):
    """quantize-weights on the default model, then load_model(DIR): the same logits, bit for bit."""
    from veloxquant_mlx.models import load_model
    from veloxquant_mlx.weights.directory import quantize_to_dir

    quantize_to_dir("smollm2", tmp_path / "q4", 4, progress=False)
    fresh, _ = load_model("smollm2")
    quantize_model(fresh, 4, progress=False)
    loaded, _ = load_model(tmp_path / "q4")
    tokens = mx.array([[1, 504, 3458, 314, 260, 1345]])
    assert mx.array_equal(loaded(tokens), fresh(tokens)).item()


@pytest.mark.parametrize("dim", [64, 640, NON_HADAMARD_DIM, 112])
def test_rotation_transpose_undoes_the_rotation(dim):
    # 640 = 20 * 32 and 112 = 28 * 4: mx.hadamard_transform's matrix is not symmetric there
    rotation = StructuredRotation.seeded(dim, seed=5)
    x = _weight(3, dim, seed=4)
    np.testing.assert_allclose(np.array(rotation.apply_transpose(rotation.apply(x))), np.array(x), atol=2e-5)
    np.testing.assert_allclose(np.array(rotation.apply(rotation.apply_transpose(x))), np.array(x), atol=2e-5)


@pytest.mark.parametrize("bits", [3, 4])
def test_quantized_embedding_lookups_decode_the_rows_as_linear_does(bits):
    from veloxquant_mlx.weights import QuantizedEmbedding

    table = _weight(300, NON_HADAMARD_DIM, seed=bits)
    emb = QuantizedEmbedding.from_embedding(table, bits, seed=3, column_alpha=0.5)
    ids = mx.array([[0, 17, 299], [5, 5, 120]])
    rows = emb(ids)
    assert rows.shape == (2, 3, NON_HADAMARD_DIM) and rows.dtype == table.dtype
    dense = np.array(emb.as_linear(mx.eye(NON_HADAMARD_DIM))).T  # (vocab, dims) through the tied head, x E^T
    np.testing.assert_allclose(np.array(rows).reshape(-1, NON_HADAMARD_DIM), dense[np.array(ids).reshape(-1)],
                               atol=2e-5)
    picked = np.array(table)[np.array(ids).reshape(-1)]
    error = np.linalg.norm(np.array(rows).reshape(-1, NON_HADAMARD_DIM) - picked) ** 2 / np.linalg.norm(picked) ** 2
    assert error < 1.5 * lloyd_max("gaussian", bits).mse


def test_quantize_model_embeddings_tied_head_and_reservoir_round_trip(tmp_path):
    from veloxquant_mlx.weights import QuantizedEmbedding

    model = _tiny()
    assert model.args.tie_word_embeddings
    tokens = mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    before = model(tokens)
    fp = fingerprint(model)
    quantize_model(model, 4, seed=1, embeddings=True, progress=False)
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding)
    assert fingerprint(model) == fp
    expected = model(tokens)
    assert (mx.argmax(expected, -1) == mx.argmax(before, -1)).mean().item() > 0.5
    path = save_reservoir(model, tmp_path / "emb.vqw")
    header, _ = reservoir_module.read_header(path)
    assert header["layers"]["model.embed_tokens"]["kind"] == "embedding"
    fresh = _tiny()
    graft_reservoir(fresh, path)
    assert isinstance(fresh.model.embed_tokens, QuantizedEmbedding)
    assert mx.array_equal(fresh(tokens), expected).item()
    # Without the option the table stays float.
    plain = quantize_model(_tiny(), 4, progress=False)
    assert isinstance(plain.model.embed_tokens, nn.Embedding)


def test_gptq_codes_lower_the_output_error_on_their_inputs():
    rng = np.random.default_rng(0)
    weight = mx.array(rng.standard_normal((64, NON_HADAMARD_DIM)).astype(np.float32))
    # inputs with uneven channel scales, as activations have
    x = mx.array((rng.standard_normal((512, NON_HADAMARD_DIM)) * np.exp(rng.standard_normal(NON_HADAMARD_DIM)))
                 .astype(np.float32))
    reference = np.array(x @ weight.T)
    errors = {}
    for name, inputs in (("nearest", None), ("gptq", x)):
        layer = QuantizedLinear.from_weight(weight, 3, seed=1, column_alpha=0.5, calibration_inputs=inputs)
        assert layer.codes.shape == (64, -(-NON_HADAMARD_DIM * 3 // 32)) and layer.scales.shape == (64, 1)
        errors[name] = np.linalg.norm(np.array(layer(x)) - reference) / np.linalg.norm(reference)
    assert errors["gptq"] < 0.8 * errors["nearest"]
    with pytest.raises(ValueError, match="one scale per row"):
        QuantizedLinear.from_weight(weight, 3, group_size=16, calibration_inputs=x)


def test_quantize_model_with_calibration_quantizes_every_layer():
    model = _tiny(hidden=128)
    tokens = mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    before = model(tokens)
    calibration = mx.array(np.random.default_rng(1).integers(0, 128, (2, 64)))
    quantize_model(model, 4, calibration=calibration, progress=False)
    assert len(quantized_layers(model)) == 14
    assert not any(type(m).__name__ == "CalibratingLinear" for _, m in model.named_modules())
    assert (mx.argmax(model(tokens), -1) == mx.argmax(before, -1)).mean().item() > 0.5
    with pytest.raises(ValueError, match="batch, tokens"):
        quantize_model(_tiny(hidden=128), 4, calibration=mx.array([1, 2, 3]), progress=False)
    # with the embedding table (coded without data) and a skipped layer
    from veloxquant_mlx.weights import QuantizedEmbedding

    model = quantize_model(_tiny(hidden=128), 4, calibration=calibration, embeddings=True, skip=["o_proj"],
                           progress=False)
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding)
    assert len(quantized_layers(model)) == 1 + 12 and isinstance(model.model.layers[1].self_attn.o_proj, nn.Linear)


@pytest.mark.parametrize("bits,dim,group,rows", [(4, 576, None, 1), (3, NON_HADAMARD_DIM, None, 3),
                                                 (2, 128, 32, 8), (4, 1536, 64, 2), (3, 100, None, 1)])
def test_native_cpu_lut_matmul_matches_the_tiled_path(bits, dim, group, rows):
    from veloxquant_mlx.kernels import native
    from veloxquant_mlx.weights import kernel

    if not native.available() or not hasattr(native.module(), "lut_matmul"):
        pytest.skip("veloxquant_mlx._native (with lut_matmul) not built")
    layer = QuantizedLinear.from_weight(_weight(1100, dim, seed=bits), bits, group_size=group, column_alpha=0.5)
    x = layer.rotation.apply(_weight(rows, dim, seed=7))
    assert kernel.native_cpu_for(x, layer)
    expected = np.array(layer.tiled_matmul(x))
    got = np.array(kernel.native_lut_matmul(x, layer))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    # the forward takes it for decode-sized batches, the tiled path beyond MAX_ROWS
    assert not kernel.native_cpu_for(mx.zeros((kernel.MAX_ROWS + 1, dim)), layer)
    single = _weight(1, dim, seed=2)[None]
    np.testing.assert_allclose(np.array(layer(single))[0],
                               np.array(layer.tiled_matmul(layer.rotation.apply(single * layer.input_scales)))[0],
                               rtol=1e-5, atol=1e-4)


# ---- shared input rotations (weights/shared.py) ---------------------------------------------

def _with_norm_weights(model, seed=3):
    """Non-trivial norm weights (random init leaves them at one), so that folding them matters."""
    rng = np.random.default_rng(seed)
    for path, module in model.named_modules():
        if path.endswith("norm") and "weight" in module and module.weight.ndim == 1:
            module.weight = mx.array(rng.uniform(0.5, 1.5, module.weight.shape).astype(np.float32))
    return model


@pytest.mark.parametrize("hidden", [256, NON_HADAMARD_DIM])
def test_shared_rotation_computes_the_per_layer_math(hidden):
    from veloxquant_mlx.weights import RotatingRMSNorm

    base = _with_norm_weights(_tiny(hidden=hidden))
    tokens = mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    dense = base(tokens)
    model = _with_norm_weights(_tiny(hidden=hidden))
    fp = fingerprint(model)
    quantize_model(model, 4, seed=1, share_rotations=True, progress=False)
    block = model.model.layers[0]
    assert isinstance(block.input_layernorm, RotatingRMSNorm)
    assert isinstance(block.post_attention_layernorm, RotatingRMSNorm)
    assert len(rotating_norms(model)) == 4 and fingerprint(model) == fp
    q, k, v = block.self_attn.q_proj, block.self_attn.k_proj, block.self_attn.v_proj
    assert q.input_rotated and k.rotation is q.rotation and v.column_scales is q.column_scales
    assert not block.self_attn.o_proj.input_rotated and not block.mlp.down_proj.input_rotated
    assert (hadamard_base(hidden) is None) == (q.rotation.perms is not None)
    # The rotating norm + a layer taking its output = the original norm + the same codes rotating
    # their own input (one rotation, one input scale): the fold is exact up to float rounding.
    h = _weight(5, hidden, seed=8)[None]
    original = nn.RMSNorm(hidden, eps=block.input_layernorm.eps)
    original.weight = base.model.layers[0].input_layernorm.weight
    for layer in (q, k, v):
        own = QuantizedLinear(layer.in_features, layer.out_features, layer.bits, codes=layer.codes,
                              scales=layer.scales, codebook=layer.codebook, rotation=layer.rotation,
                              input_scales=layer.column_scales)
        np.testing.assert_allclose(np.array(layer(block.input_layernorm(h))), np.array(own(original(h))),
                                   rtol=1e-4, atol=1e-4 * np.abs(np.array(own(original(h)))).max())
    # The shared scales divide the columns of every layer of the group: storage counts them once.
    assert q.storage_nbytes() == q.codes.nbytes + q.scales.nbytes + q.codebook.nbytes
    assert block.input_layernorm.storage_nbytes() > 0
    # Logits stay as close to the float model as per-layer rotations keep them (quantization error only).
    per_layer = quantize_model(_with_norm_weights(_tiny(hidden=hidden)), 4, seed=1, share_rotations=False,
                               progress=False)
    assert not rotating_norms(per_layer)

    def error(logits):
        return (mx.sqrt(mx.mean(mx.square(logits - dense))) / mx.sqrt(mx.mean(mx.square(dense)))).item()

    assert error(model(tokens)) < 1.5 * error(per_layer(tokens)) and error(model(tokens)) < 0.35
    assert (mx.argmax(model(tokens), -1) == mx.argmax(dense, -1)).mean().item() > 0.5


def test_shared_input_scales_pool_the_layers():
    from veloxquant_mlx.weights.linear import column_scales
    from veloxquant_mlx.weights.shared import shared_input_scales

    a, b = _weight(32, 64, seed=1), _weight(8, 64, seed=2) * 3.0
    assert shared_input_scales([a, b], 0.0) is None
    # one layer: its own scales; several: the column RMS over all their rows
    np.testing.assert_allclose(np.array(shared_input_scales([a], 0.5)), np.array(column_scales(a, 0.5)), rtol=1e-3)
    np.testing.assert_allclose(np.array(shared_input_scales([a, b], 0.5)),
                               np.array(column_scales(mx.concatenate([a, b]), 0.5)), rtol=1e-3)
    # columns small in every layer get small scales
    small = mx.concatenate([mx.full((1,), 0.01), mx.ones((63,))])
    c = np.array(shared_input_scales([a * small, b * small], 0.5))
    assert c[0] < 0.2 and np.all(c[1:] > 0.5)


def test_shared_rotation_on_gemma3_and_reservoir_round_trip(tmp_path):
    from conftest import tiny_gemma3

    from veloxquant_mlx.weights import RotatingRMSNorm

    model = _with_norm_weights(tiny_gemma3(layers=2, pattern=2, vocab=128))
    tokens = mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    dense = model(tokens)
    quantize_model(model, 4, seed=1, share_rotations=True, progress=False)
    block = model.model.layers[0]
    # Gemma's norm multiplies by 1 + weight; its MLP reads pre_feedforward_layernorm
    assert isinstance(block.input_layernorm, RotatingRMSNorm) and block.input_layernorm.offset == 1.0
    assert isinstance(block.pre_feedforward_layernorm, RotatingRMSNorm)
    assert not isinstance(block.post_attention_layernorm, RotatingRMSNorm)
    expected = model(tokens)
    per_layer = quantize_model(_with_norm_weights(tiny_gemma3(layers=2, pattern=2, vocab=128)), 4, seed=1,
                               share_rotations=False, progress=False)

    def error(logits):
        return (mx.sqrt(mx.mean(mx.square(logits - dense))) / mx.sqrt(mx.mean(mx.square(dense)))).item()

    assert error(expected) < 1.5 * error(per_layer(tokens))
    path = save_reservoir(model, tmp_path / "gemma.vqw")
    header, _ = reservoir_module.read_header(path)
    assert header["format_version"] == 2
    assert header["layers"]["model.layers.0.input_layernorm"]["kind"] == "rotating_norm"
    q = header["layers"]["model.layers.0.self_attn.q_proj"]
    assert q["rotated_by"] == "model.layers.0.input_layernorm" and "rotation.signs" not in q["tensors"]
    fresh = _with_norm_weights(tiny_gemma3(layers=2, pattern=2, vocab=128))
    graft_reservoir(fresh, path)
    assert mx.array_equal(fresh(tokens), expected).item()
    assert fresh.model.layers[1].mlp.up_proj.rotation is fresh.model.layers[1].pre_feedforward_layernorm.rotation


def test_reservoir_reads_version_1_files(tmp_path, monkeypatch):
    model = quantize_model(_tiny(hidden=128), 3, seed=2, share_rotations=False, progress=False)
    monkeypatch.setattr(reservoir_module, "FORMAT_VERSION", 1)  # what the first writer wrote
    path = save_reservoir(model, tmp_path / "v1.vqw")
    monkeypatch.undo()
    assert struct.unpack_from("<I", path.read_bytes(), 8)[0] == 1
    tokens = mx.array([[3, 1, 4, 1, 5]])
    fresh = _tiny(hidden=128)
    graft_reservoir(fresh, path)
    assert mx.array_equal(fresh(tokens), model(tokens)).item()
    # a shared-rotation layer whose norm is missing from the file is a clear error
    shared = quantize_model(_tiny(hidden=128), 3, seed=2, share_rotations=True, progress=False)
    path = save_reservoir(shared, tmp_path / "v2.vqw")
    header, start = reservoir_module.read_header(path)
    del header["layers"]["model.layers.0.input_layernorm"]
    text = json.dumps(header, sort_keys=True).encode()
    import hashlib

    data = path.read_bytes()
    rewritten = reservoir_module._PREFIX.pack(reservoir_module.MAGIC, 2, len(text), hashlib.sha256(text).digest())
    body = rewritten + text
    assert reservoir_module._align(len(body)) == start
    path.write_bytes(body + bytes(start - len(body)) + data[start:])
    with pytest.raises(ReservoirError, match="lacks"):
        load_reservoir(path)


class _OtherBlock(nn.Module):
    """A block of a structure quantize_model does not know (it may not read its norms as llama does)."""

    def __init__(self, dim):
        super().__init__()
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(dim, dim)
        self.mlp = nn.Module()
        self.mlp.up_proj = nn.Linear(dim, dim)

    def __call__(self, x):
        return self.mlp.up_proj(self.self_attn.q_proj(x))


def test_quantize_model_warns_where_it_cannot_share_rotations():
    other = nn.Sequential(_OtherBlock(64))
    x = _weight(2, 64, seed=1)
    before = other(x)
    with pytest.warns(RuntimeWarning, match="not recognised"):
        quantize_model(other, 4, share_rotations=True, progress=False)
    assert not rotating_norms(other) and not other.layers[0].self_attn.q_proj.input_rotated
    assert np.abs(np.array(other(x) - before)).max() < 0.5 * np.abs(np.array(before)).max()
    with pytest.warns(RuntimeWarning, match="no transformer block"):
        quantize_model(nn.Sequential(nn.Linear(64, 32)), 4, share_rotations=True, progress=False)
    # a group with a skipped layer keeps per-layer rotations, and says so
    with pytest.warns(RuntimeWarning, match="not all layers after"):
        model = quantize_model(_tiny(hidden=128), 4, skip=["k_proj"], share_rotations=True, progress=False)
    assert not model.model.layers[0].self_attn.q_proj.input_rotated
    assert model.model.layers[0].mlp.gate_proj.input_rotated


def test_calibrated_codes_share_rotations_too():
    model = _tiny(hidden=128)
    tokens = mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    before = model(tokens)
    calibration = mx.array(np.random.default_rng(1).integers(0, 128, (1, 64)))
    quantize_model(model, 4, calibration=calibration, share_rotations=True, progress=False)
    assert len(rotating_norms(model)) == 4 and model.model.layers[1].mlp.up_proj.input_rotated
    assert (mx.argmax(model(tokens), -1) == mx.argmax(before, -1)).mean().item() > 0.5


def test_layer_routes_are_kept_per_decode_shape_and_compile_on_the_cpu(monkeypatch):
    from veloxquant_mlx.weights import kernel

    monkeypatch.setattr(kernel, "COMPILE_ROUTES", False)
    layer = QuantizedLinear.from_weight(_weight(40, NON_HADAMARD_DIM, seed=2), 4, column_alpha=0.5,
                                        bias=mx.arange(40).astype(mx.float32))
    x, big = _weight(1, NON_HADAMARD_DIM, seed=3)[None], _weight(kernel.MAX_ROWS + 3, NON_HADAMARD_DIM, seed=4)
    reference = np.array(layer.tiled_matmul(layer.rotation.apply(x, layer.input_scales))) + np.arange(40)
    np.testing.assert_allclose(np.array(layer(x)), reference, rtol=1e-5, atol=1e-4)
    layer(big)
    assert list(layer._routes) == [((1, 1, NON_HADAMARD_DIM), mx.float32)]  # prefill sizes are not kept
    monkeypatch.setattr(kernel, "COMPILE_ROUTES", True)
    compiled = QuantizedLinear.from_weight(_weight(40, NON_HADAMARD_DIM, seed=2), 4, column_alpha=0.5,
                                           bias=mx.arange(40).astype(mx.float32))
    assert mx.array_equal(compiled(x), layer(x)).item()
    assert mx.array_equal(compiled(x), layer(x)).item()  # a second, replayed call


def test_gpu_route_launch_arguments_run_the_kernel_in_the_emulator(monkeypatch):
    """The GPU route's launch (its kept template, grid and final output shape, no reshape) through
    the kernel's C++ emulation, in place of mx.fast.cuda_kernel: the same result as the tiled matmul."""
    emulate_gpu_kernels(monkeypatch)
    for bits, dim, group, rows in ((4, 256, None, 1), (3, NON_HADAMARD_DIM, None, 3), (2, 128, 32, 2)):
        layer = QuantizedLinear.from_weight(_weight(37, dim, seed=bits), bits, group_size=group, column_alpha=0.5)
        x = _weight(rows, dim, seed=5)[None]
        expected = np.array(layer.tiled_matmul(layer.rotation.apply(x, layer.input_scales)))
        got = layer(x)
        assert got.shape == (1, rows, 37)
        np.testing.assert_allclose(np.array(got), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def test_weights_kernel_first_use_check_stands_aside_with_a_warning(monkeypatch):
    """On Metal the LUT matmul is checked once per process and input dtype against the tiled matmul
    (weights/selftest.py's small cases; here on the C++ emulation standing in for it): a correct kernel
    passes silently, a wrong one warns, naming the kernel, and the layers leave it."""
    import warnings

    from veloxquant_mlx.weights import kernel

    emulate_gpu_kernels(monkeypatch)
    monkeypatch.setattr(kernel, "_VERDICTS", {})
    monkeypatch.setattr(kernel, "CHECKED_DIALECTS", ("cuda",))  # the emulated back end stands in for Metal
    layer = QuantizedLinear.from_weight(_weight(37, 256, seed=3), 3)
    x = layer.rotation.apply(_weight(2, 256, seed=5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernel.usable("cuda", "float32") and kernel.launch_function(layer, x) is not None
        assert kernel.usable("cuda", "float16")  # the reference is float32 on the CPU: no TF32 in it
    monkeypatch.setattr(kernel, "_VERDICTS", {})
    lut_matmul = kernel.lut_matmul
    monkeypatch.setattr(kernel, "lut_matmul", lambda *args: lut_matmul(*args) * 1.01)
    with pytest.warns(RuntimeWarning, match=r"cuda kernel lut_matmul \(weights/kernel.py\) failed its first-use check"):
        assert not kernel.usable("cuda", "float32")
    assert kernel.launch_function(layer, x) is None and ("cuda", "float16") not in kernel._VERDICTS  # per dtype
    expected = np.array(layer.tiled_matmul(x))
    np.testing.assert_allclose(np.array(kernel.route(layer, x)(x)), expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


def test_shared_alpha_sets_the_groups_column_scaling_only():
    model = quantize_model(_tiny(hidden=128), 4, shared_alpha=0.0, share_rotations=True, progress=False)
    block = model.model.layers[0]
    assert "input_scales" not in block.input_layernorm and block.self_attn.q_proj.column_scales is None
    assert "input_scales" in block.self_attn.o_proj and "input_scales" in block.mlp.down_proj
    tokens = mx.array([[3, 1, 4, 1, 5]])
    assert mx.isfinite(model(tokens)).all().item()
