"""Each llama-family block's halves around its attention as compiled calls at decode shapes
(weights/compiled_block.py)."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import gemma3_text, llama, qwen2
from conftest import decode_logits, random_model, tiny_gemma3, tiny_llama
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.integration import make_prompt_cache as compressed_cache
from veloxquant_mlx.weights import compiled_block, compiled_mlp, graft_reservoir, kernel, quantize_model, save_reservoir


def quantized(make, compile_blocks, monkeypatch):
    monkeypatch.setattr(compiled_block, "COMPILE_BLOCKS", compile_blocks)
    model = make()
    quantize_model(model, 4, skip=("lm_head",), progress=False)
    return model


def tiny_qwen2():
    """Qwen2's block: llama's with biases on q/k/v."""
    return random_model(qwen2, 3, model_type="qwen2", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=96,
                        tie_word_embeddings=False)


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen2, lambda: tiny_llama(hidden=576, heads=9, kv_heads=3),
                                  tiny_gemma3], ids=["llama", "qwen2", "llama-576", "gemma3"])
def test_compiled_blocks_compute_what_the_block_does(make, monkeypatch):
    eager = decode_logits(quantized(make, False, monkeypatch), steps=40)
    model = quantized(make, True, monkeypatch)
    got = decode_logits(model, steps=40)
    assert mx.array_equal(got, eager)
    # decode shapes took the compiled halves in every layer (Gemma's sliding and global ones, the
    # 40 steps past its 32-token window); the 10-token prompt (prefill-sized) did not
    for block in model.model.layers:
        assert list(block._decode_halves) == [((1, 1, block.self_attn.q_proj.in_features), mx.float32)]
        assert type(block).__name__ == "TransformerBlock" and isinstance(
            block, (llama.TransformerBlock, qwen2.TransformerBlock, gemma3_text.TransformerBlock))


def llama_with_rope(scaling):
    return random_model(llama, 4, model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=96,
                        rope_scaling=scaling, max_position_embeddings=64)


@pytest.mark.parametrize("scaling, inside", [
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 16}, True),
    ({"type": "dynamic", "factor": 2.0}, False)], ids=["llama3", "dynamic"])
def test_the_rotary_embedding_inside_or_outside(scaling, inside, monkeypatch):
    """Llama 3's rotary embedding takes an array offset and runs inside the first half; the dynamic
    NTK one does arithmetic on the offset and runs outside. Both as the block's own call."""
    make = lambda: llama_with_rope(scaling)  # noqa: E731
    eager = decode_logits(quantized(make, False, monkeypatch), steps=5)
    model = quantized(make, True, monkeypatch)
    assert mx.array_equal(decode_logits(model, steps=5), eager)
    (halves,) = model.model.layers[0]._decode_halves.values()
    assert halves.rope_inside is inside


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3"])
def test_with_a_compressed_kv_cache(make, monkeypatch):
    """The attention function is the one the cache's hook installed, so the compressed cache attends."""
    config = KVCacheConfig.preset("vq4", residual_length=8)  # fits Gemma's 32-token sliding window
    eager = decode_logits(quantized(make, False, monkeypatch), lambda m: compressed_cache(m, config), steps=40)
    model = quantized(make, True, monkeypatch)
    caches = []
    got = decode_logits(model, lambda m: caches.append(compressed_cache(m, config)) or caches[-1], steps=40)
    assert mx.array_equal(got, eager)
    assert caches[0][-1].offset == 50 and model.model.layers[-1]._decode_halves


def test_other_blocks_keep_their_call(monkeypatch):
    class Block(llama.TransformerBlock):  # a block class of another module
        pass

    model = tiny_llama()
    model.model.layers[0].__class__ = Block
    quantize_model(model, 4, skip=("lm_head",), progress=False)
    decode_logits(model)
    assert type(model.model.layers[0]) is Block and "_decode_halves" not in model.model.layers[0].__dict__
    assert model.model.layers[1]._decode_halves


@pytest.mark.parametrize("method", ["fp16", "turboquant_mse:3:vbits=4,sinks=4,window=8,center=true,renorm=true",
                                    "kivi:4", "turboquant_rvq:2", "polarquant:4", "qjl:4"])
def test_an_affine_weight_model_with_each_kv_method(method):
    """`veloxquant benchmark --compile-blocks` compiles the blocks of its MLX-affine model for every
    method: the decode logits equal the blocks' own calls with each method's cache."""
    from veloxquant_mlx.evaluation.specs import parse_method_spec

    spec = parse_method_spec(method)
    logits = []
    for compiled in (False, True):
        model = tiny_llama()
        nn.quantize(model, group_size=64, bits=4)
        if compiled:
            assert compiled_block.compile_blocks(model) == 2
        logits.append(decode_logits(model, spec.make_caches, steps=12))
    assert mx.array_equal(logits[1], logits[0])
    assert model.model.layers[0]._decode_halves


# (module and flag of the feature, where a block keeps its compiled calls, the class it swaps)
FEATURES = {
    "block": (compiled_block, "COMPILE_BLOCKS", lambda block: block._decode_halves, llama.TransformerBlock,
              lambda block: block),
    "mlp": (compiled_mlp, "COMPILE_MLPS", lambda block: block.mlp._decode_calls, llama.MLP, lambda block: block.mlp),
}


def quantized_with(feature, on, monkeypatch):
    """tiny_llama quantized with `feature` on or off, and the other off."""
    for name, (module, flag, *_) in FEATURES.items():
        monkeypatch.setattr(module, flag, on and name == feature)
    model = tiny_llama()
    quantize_model(model, 4, skip=("lm_head",), progress=False)
    return model


@pytest.mark.parametrize("feature", FEATURES)
def test_compiled_calls_read_updated_parameters(feature, monkeypatch):
    models = [quantized_with(feature, on, monkeypatch) for on in (False, True)]
    before = decode_logits(models[1])
    for model in models:
        for block in model.model.layers:
            for layer in (block.self_attn.o_proj, block.mlp.down_proj):
                layer.update({"scales": layer.scales * 2})
            block.input_layernorm.update({"weight": block.input_layernorm.weight * 0.5})
    after = [decode_logits(model) for model in models]
    assert mx.array_equal(after[1], after[0])
    assert not mx.allclose(after[1], before)


@pytest.mark.parametrize("feature", FEATURES)
def test_off_with_the_compiled_routes(feature, monkeypatch):
    monkeypatch.setattr(kernel, "COMPILE_ROUTES", False)
    model = quantized_with(feature, True, monkeypatch)
    decode_logits(model)
    assert FEATURES[feature][2](model.model.layers[0]) == {}


@pytest.mark.parametrize("feature", FEATURES)
def test_a_grafted_model_compiles_afresh(feature, tmp_path, monkeypatch):
    _, _, kept, base, swapped = FEATURES[feature]
    model = quantized_with(feature, True, monkeypatch)
    expected = decode_logits(model)
    path = tmp_path / "model.reservoir"
    save_reservoir(model, path)
    target = tiny_llama()
    graft_reservoir(target, path)
    block = target.model.layers[1]
    assert type(swapped(block)).uncompiled_class is base and kept(block) == {}
    assert mx.array_equal(decode_logits(target), expected)
    assert kept(block)
