"""Each MLP of a quantized model as one compiled call at decode shapes (weights/compiled_mlp.py)."""

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import gemma3_text, llama
from mlx_lm.models.cache import make_prompt_cache

from conftest import tiny_gemma3, tiny_llama
from veloxquant_mlx.weights import compiled_mlp, graft_reservoir, kernel, quantize_model, save_reservoir


def decode_logits(model, steps=3):
    """The prompt's last logits and those of `steps` decode steps, evaluated step by step
    as mlx-lm's generate does."""
    cache = make_prompt_cache(model)
    out = [model(mx.array([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]), cache=cache)[:, -1]]
    mx.eval(out)
    for token in range(steps):
        out.append(model(mx.array([[11 + token]]), cache=cache)[:, -1])
        mx.eval(out[-1])
    return mx.concatenate(out)


def quantized(make, compile_mlps, monkeypatch):
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


def test_compiled_mlps_read_updated_parameters(monkeypatch):
    models = [quantized(tiny_llama, flag, monkeypatch) for flag in (False, True)]
    before = decode_logits(models[1])
    for model in models:
        for block in model.model.layers:
            block.mlp.down_proj.update({"scales": block.mlp.down_proj.scales * 2})
    after = [decode_logits(model) for model in models]
    assert mx.array_equal(after[1], after[0])
    assert not mx.allclose(after[1], before)


def test_off_with_the_compiled_routes(monkeypatch):
    monkeypatch.setattr(kernel, "COMPILE_ROUTES", False)
    model = quantized(tiny_llama, True, monkeypatch)
    decode_logits(model)
    assert model.model.layers[0].mlp._decode_calls == {}


def test_a_grafted_model_compiles_its_mlps_afresh(tmp_path, monkeypatch):
    model = quantized(tiny_llama, True, monkeypatch)
    expected = decode_logits(model)
    path = tmp_path / "model.reservoir"
    save_reservoir(model, path)
    target = tiny_llama()
    graft_reservoir(target, path)
    mlp = target.model.layers[1].mlp
    assert type(mlp).uncompiled_class is llama.MLP and mlp._decode_calls == {}
    assert mx.array_equal(decode_logits(target), expected)
    assert mlp._decode_calls
