"""Each MLP of a quantized model as one compiled call at decode shapes (weights/compiled_mlp.py); with
the compiled blocks, reading updated parameters, switching off and grafting are tested in
test_weights_compiled_block.py."""

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import gemma3_text, llama

from conftest import decode_logits, tiny_gemma3, tiny_llama
from veloxquant_mlx.weights import compiled_block, compiled_mlp, quantize_model


def quantized(make, compile_mlps, monkeypatch):
    """Blocks with compiled halves call the MLP's own call inside them: here they are off."""
    monkeypatch.setattr(compiled_block, "COMPILE_BLOCKS", False)
    monkeypatch.setattr(compiled_mlp, "COMPILE_MLPS", compile_mlps)
    model = make()
    quantize_model(model, 4, skip=("lm_head",), progress=False)
    return model


def llama_of_structured_rotations():
    """Hidden 576 (SmolLM2's) and MLP 1152: dimensions that take the multi-stage rotation with
    permutations, not one Hadamard transform."""
    return tiny_llama(hidden=576, heads=9, kv_heads=3)


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3, llama_of_structured_rotations],
                         ids=["llama", "gemma3", "llama-576"])
def test_compiled_mlps_compute_what_the_layer_calls_do(make, monkeypatch):
    eager = decode_logits(quantized(make, False, monkeypatch))
    model = quantized(make, True, monkeypatch)
    got = decode_logits(model)
    assert mx.array_equal(got, eager)
    mlp = model.model.layers[0].mlp
    # decode shapes took the compiled form; the 10-token prompt (prefill-sized) did not
    assert list(mlp._decode_calls) == [((1, 1, mlp.gate_proj.in_features), mx.float32)]


def test_the_mlp_keeps_its_class_and_parameters(monkeypatch):
    plain = tiny_llama()
    quantize_model(plain, 4, skip=("lm_head",), progress=False)
    mlp = plain.model.layers[0].mlp
    assert isinstance(mlp, llama.MLP) and type(mlp).__name__ == "MLP"
    assert type(mlp).uncompiled_class is llama.MLP
    assert sorted(k for k, _ in tree_flatten(mlp.parameters())) == sorted(
        f"{layer}.{name}" for layer in ("down_proj", "gate_proj", "up_proj")
        for name in ("codebook", "codes", "input_scales", "rotation_signs", "scales"))
    gemma = tiny_gemma3()
    quantize_model(gemma, 4, skip=("lm_head",), progress=False)
    assert isinstance(gemma.model.layers[0].mlp, gemma3_text.MLP)
