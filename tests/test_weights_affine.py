"""GroupAffineLinear: per-group affine codes with quantized group scales and centres."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import tiny_llama

from veloxquant_mlx.weights import GroupAffineLinear, graft_reservoir, quantize_model, save_reservoir
from veloxquant_mlx.weights.affine import decode_group_params


def _grid_weight(rows=48, cols=128, group=32, seed=0):
    """Weights on a Q4_1-style grid: d * q + m per group of 32, q in 0..15 using both ends."""
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, (rows, cols // group, group))
    q[..., 0], q[..., 1] = 0, 15
    d = rng.uniform(0.01, 0.03, (rows, cols // group, 1))
    m = -7.5 * d + rng.uniform(-0.01, 0.01, (rows, cols // group, 1))
    return mx.array((q * d + m).reshape(rows, cols).astype(np.float32))


def _relative_error(a, b):
    return float(mx.sqrt(((a - b) ** 2).sum() / (b ** 2).sum()))


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_forward_is_the_matmul_with_the_decoded_weight(bits):
    weight = mx.random.normal((40, 128), key=mx.random.key(1)) * 0.05
    layer = GroupAffineLinear.from_weight(weight, bits, bias=mx.arange(40).astype(mx.float32))
    x = mx.random.normal((3, 128), key=mx.random.key(2))
    expected = x @ layer.dequantized_weight().T + mx.arange(40).astype(mx.float32)
    assert mx.allclose(layer(x), expected, atol=1e-4).item()
    # coarser codes, larger error; and every width beats a much coarser one
    error = _relative_error(layer.dequantized_weight(), weight)
    assert error < {2: 0.45, 3: 0.2, 4: 0.1}[bits]


def test_bits_per_weight_counts_codes_group_parameters_and_row_maxima():
    layer = GroupAffineLinear.from_weight(mx.random.normal((64, 576)), 4, scale_bits=4, center_bits=6)
    # 4 bits per weight, 10 bits per group of 32, two fp16 per row of 576
    assert layer.bits_per_weight() == pytest.approx(4 + 10 / 32 + 32 / 576, abs=1e-3)
    assert layer.storage_nbytes() == sum(a.nbytes for a in (layer.codes, layer.scale_codes, layer.center_codes,
                                                           layer.row_ranges))


def test_a_source_on_an_affine_grid_is_found_again():
    weight = _grid_weight()
    fine = GroupAffineLinear.from_weight(weight, 4, scale_bits=8, center_bits=8)
    coarse = GroupAffineLinear.from_weight(weight, 4, scale_bits=3, center_bits=3)
    rotated_free = GroupAffineLinear.from_weight(mx.random.normal(weight.shape, key=mx.random.key(3)), 4)
    fine_error = _relative_error(fine.dequantized_weight(), weight)
    assert fine_error < 0.01
    assert fine_error < _relative_error(coarse.dequantized_weight(), weight)
    # a generic Gaussian matrix, not on a grid, is far from exact at 4 bits
    assert _relative_error(rotated_free.dequantized_weight(), mx.random.normal(weight.shape, key=mx.random.key(3))) > 0.05


def test_group_parameters_decode_within_their_row_ranges():
    layer = GroupAffineLinear.from_weight(mx.random.normal((16, 64), key=mx.random.key(4)), 3, scale_bits=4,
                                          center_bits=5)
    scales, biases = layer.group_params()
    ranges = layer.row_ranges.astype(mx.float32)
    assert (scales > 0).all().item() and (scales <= ranges[:, :1] + 1e-7).all().item()
    centres = biases + scales * 3.5
    assert (mx.abs(centres) <= ranges[:, 1:] * (1 + 1e-6)).all().item()
    d, c = decode_group_params(mx.zeros((1, 2), dtype=mx.uint8), mx.full((1, 2), 15, dtype=mx.uint8),
                               mx.array([[2.0, 3.0]]), 4, 5)
    assert np.allclose(np.array(d), 2.0 / 16) and np.allclose(np.array(c), 0.0)


def test_invalid_settings_raise():
    weight = mx.zeros((4, 64))
    with pytest.raises(ValueError, match="bits"):
        GroupAffineLinear.from_weight(weight, 5)
    with pytest.raises(ValueError, match="group_size"):
        GroupAffineLinear.from_weight(weight, 4, group_size=48)
    with pytest.raises(ValueError, match="scale_bits"):
        GroupAffineLinear.from_weight(weight, 4, scale_bits=9)


def test_quantize_model_group_affine_and_its_reservoir_round_trip(tmp_path):
    model = tiny_llama()
    tokens = mx.array([[1, 2, 3, 4, 5, 6]])
    reference = model(tokens)
    assert quantize_model(model, 4, format="group_affine", skip=["o_proj"], progress=False) is model
    layers = [m for _, m in model.named_modules() if isinstance(m, GroupAffineLinear)]
    assert len(layers) == 2 * 6 and isinstance(model.model.layers[0].self_attn.o_proj, nn.Linear)
    out = model(tokens)
    assert (mx.argmax(out, -1) == mx.argmax(reference, -1)).mean().item() > 0.5
    assert mx.isfinite(out).all().item()
    save_reservoir(model, tmp_path / "r.vqw")
    fresh = tiny_llama()
    graft_reservoir(fresh, tmp_path / "r.vqw")
    grafted = [m for _, m in fresh.named_modules() if isinstance(m, GroupAffineLinear)]
    assert len(grafted) == 2 * 6
    assert mx.array_equal(fresh(tokens), out).item()  # bit-identical logits
    with pytest.raises(ValueError, match="data-free"):
        quantize_model(tiny_llama(), 4, format="group_affine", calibration=tokens, progress=False)
    with pytest.raises(ValueError, match="format"):
        quantize_model(tiny_llama(), 4, format="nf4", progress=False)


def test_quantize_weights_cli_group_affine_folder(tmp_path, monkeypatch):
    import json

    from veloxquant_mlx import models
    from veloxquant_mlx.cli import main
    from veloxquant_mlx.weights import directory

    monkeypatch.setattr(models, "load_model", lambda name, dequantize=None: (tiny_llama(hidden=128), None))
    monkeypatch.setattr(models, "model_source", lambda name: name)
    assert main(["quantize-weights", "--model", "tiny", "--bits", "3", "--format", "group_affine",
                 "--scale-bits", "5", "--out", str(tmp_path / "g")]) == 0
    config = json.loads((tmp_path / "g" / "weights.json").read_text())
    assert config["weight_format"] == "group_affine" and config["scale_bits"] == 5
    loaded, _ = directory.load_quantized_dir(tmp_path / "g")
    layers = [m for _, m in loaded.named_modules() if isinstance(m, (nn.Linear, GroupAffineLinear))]
    assert len(layers) == 14 and all(isinstance(m, GroupAffineLinear) and m.scale_bits == 5 and m.bits == 3
                                     for m in layers)
