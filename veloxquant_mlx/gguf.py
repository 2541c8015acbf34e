"""Convert a GGUF file (llama or gemma3 architecture) into an mlx-lm model folder.

Files whose tensors are all of the types MLX's own GGUF loader reads (floats,
Q4_0/Q4_1/Q8_0) go through it, and the legacy quants stay packed. Others (Q4_K_M and
the other K-quant mixes) are read with the `gguf` library, whose `quants.dequantize`
turns every ggml type into float32: MLX's loader raises on K-quants in some files
and, in others (`tests/test_gguf.py` has one), returns float16 values that differ
from the `gguf` library's decoding without an error.
"""

import json
import warnings
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models
from tokenizers import pre_tokenizers, processors

TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}

# Tensors that llama.cpp stores but mlx-lm's llama has no slot for.
IGNORED_TENSORS = {"rope_freqs"}

# llama.cpp's names for Gemma 3 (its converter's tensor map), as mlx-lm's gemma3_text spells them.
GEMMA3_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
LAYER_NAMES_BY_ARCHITECTURE = {"llama": LAYER_NAMES, "gemma3": GEMMA3_LAYER_NAMES}

# Gemma's RMSNorm scales by (1 + w); llama.cpp's converter stores w + 1 so that ggml's plain
# rms_norm applies; mlx-lm's gemma3_text adds the 1 itself, so it is taken off again.
GEMMA_NORM_SHIFT = 1.0
# Gemma 3 values llama.cpp fixes in code rather than in the file (llama-model.cpp, LLM_ARCH_GEMMA3):
# the local layers' RoPE base, and one global layer in every 6 when the file names no pattern.
GEMMA3_LOCAL_ROPE_BASE = 10000.0
GEMMA3_SLIDING_PATTERN = 6

# GGUF token types (llama.cpp's llama_token_type).
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4

GPT2_SPLIT = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer(pre: str):
    """The Hugging Face pre-tokenizer matching llama.cpp's `tokenizer.ggml.pre`."""
    if pre in ("smollm", "starcoder", "refact", "codeshell"):
        # llama.cpp splits these into single digits before the GPT-2 regex.
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), GPT2_SPLIT]
        )
    if pre in ("llama-bpe", "llama3"):
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_REGEX), "isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre not in ("default", "gpt2", "gpt-2"):
        warnings.warn(
            f"Unknown GGUF pre-tokenizer {pre!r}: using the GPT-2 split, "
            "tokenization may differ from the original model."
        )
    return GPT2_SPLIT


def _value(metadata: dict, key: str, default=None):
    value = metadata.get(key, default)
    if not isinstance(value, mx.array) or value.ndim != 0:
        return value
    if value.dtype == mx.float32:
        # Shortest decimal that round-trips in float32: 1e-05, not 9.9999997e-06.
        return float(str(np.float32(value.item())))
    return value.item()


def _check_file(path: Path):
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic bytes).")


def read_gguf(gguf_path) -> tuple[dict, dict]:
    """Tensors and metadata of a GGUF file through MLX's loader, with clear errors for bad files."""
    path = Path(gguf_path)
    _check_file(path)
    try:
        return mx.load(str(path), format="gguf", return_metadata=True)
    except RuntimeError as error:  # MLX's reader: truncated or corrupted files
        raise ValueError(f"cannot read GGUF file {path}: {error}") from None


# ggml types MLX's loader reads as llama.cpp does: floats, and the legacy quants it keeps packed.
# Other types (K-quants) it returns as float16 in some files, with values that differ from gguf's.
MLX_GGUF_TYPES = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0"}


def _gguf_reader(path: Path):
    try:
        import gguf
    except ImportError:
        raise ImportError(
            f"reading {path} needs the gguf package (it checks the tensor types and decodes K-quants, "
            "which MLX's loader misreads): pip install gguf"
        ) from None
    try:
        return gguf, gguf.GGUFReader(str(path))
    except (ValueError, IndexError, KeyError, OSError) as error:  # truncated or corrupted files
        raise ValueError(f"cannot read GGUF file {path}: {error!r}") from None


def gguf_tensor_types(gguf_path) -> set[str]:
    """The ggml type names of a GGUF file's tensors (from its header)."""
    path = Path(gguf_path)
    _check_file(path)
    _, reader = _gguf_reader(path)
    return {tensor.tensor_type.name for tensor in reader.tensors}


def read_gguf_dequantized(gguf_path) -> tuple[dict, dict]:
    """Tensors (float32) and metadata (plain Python values) of any GGUF file, read with the
    `gguf` library: `gguf.quants.dequantize` decodes every ggml type, K-quants included."""
    path = Path(gguf_path)
    _check_file(path)
    gguf, reader = _gguf_reader(path)
    metadata = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        value = field.contents()
        if field.types == [gguf.GGUFValueType.FLOAT32]:
            value = float(str(np.float32(value)))  # 1e-06, not 9.999999974752427e-07
        metadata[name] = value
    weights = {}
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        # ggml lists dimensions fastest first; numpy and MLX want them slowest first.
        weights[tensor.name] = mx.array(values.reshape(tuple(reversed(tensor.shape.tolist()))), dtype=mx.float32)
    return weights, metadata


def load_gguf(gguf_path, dequantize: bool = False) -> tuple[dict, dict]:
    """Tensors and metadata: through MLX's loader (legacy quants stay packed) when it reads
    every tensor type of the file, else decoded to float32 by the `gguf` library."""
    unsupported = gguf_tensor_types(gguf_path) - MLX_GGUF_TYPES
    if not unsupported:
        return read_gguf(gguf_path)
    weights, metadata = read_gguf_dequantized(gguf_path)
    if not dequantize and _value(metadata, "general.architecture") == "llama":
        warnings.warn(
            f"MLX cannot keep {sorted(unsupported)} packed: the model folder gets float32 weights."
        )
    return weights, metadata


def sentencepiece_tokenizer(metadata: dict) -> Tokenizer:
    """The SentencePiece tokenizer (`tokenizer.ggml.model` "llama", as Gemma's) of a GGUF's
    metadata, built by transformers' GGUF tokenizer mapping: Gemma files list no merges, and
    transformers rebuilds them from the vocabulary's order (and respells the whitespace tokens)."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    except ImportError as error:
        raise ImportError(
            f"SentencePiece GGUF tokenizers are rebuilt by transformers' GGUF mapping, which this "
            f"transformers lacks ({error}); 5.24 has it: pip install -U transformers"
        ) from None

    keys = {
        "tokenizer_type": "model", "tokens": "tokens", "scores": "scores", "token_type": "token_type",
        "merges": "merges", "bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id",
        "unk_token_id": "unknown_token_id", "pad_token_id": "padding_token_id",
        "add_prefix_space": "add_space_prefix",
    }
    tokenizer_dict = {}
    for name, key in keys.items():
        value = _value(metadata, f"tokenizer.ggml.{key}")
        if value is not None:
            tokenizer_dict[name] = value.tolist() if isinstance(value, mx.array) else value
    tokenizer, _ = convert_gguf_tokenizer(_value(metadata, "general.architecture"), tokenizer_dict)
    return tokenizer


def build_tokenizer(metadata: dict) -> Tokenizer:
    """Rebuild the tokenizer stored in a GGUF's metadata: byte-level BPE ("gpt2") here,
    SentencePiece ("llama") through transformers' mapping."""
    kind = _value(metadata, "tokenizer.ggml.model")
    if kind == "llama":
        return sentencepiece_tokenizer(metadata)
    if kind != "gpt2":
        raise ValueError(
            f"Unsupported GGUF tokenizer model {kind!r}: only byte-level BPE "
            "('gpt2') and SentencePiece ('llama') tokenizers can be converted."
        )
    tokens = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(_value(metadata, "tokenizer.ggml.pre", "default"))
    tokenizer.decoder = decoders.ByteLevel()

    token_types = metadata.get("tokenizer.ggml.token_type")
    token_types = token_types.tolist() if token_types is not None else []
    tokenizer.add_special_tokens(
        [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, kind in enumerate(token_types)
            if kind == TOKEN_CONTROL
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(tokens[i], special=False, normalized=False)
            for i, kind in enumerate(token_types)
            if kind == TOKEN_USER_DEFINED
        ]
    )

    bos_id = _value(metadata, "tokenizer.ggml.bos_token_id")
    if _value(metadata, "tokenizer.ggml.add_bos_token", False) and bos_id is not None:
        bos = tokens[bos_id]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def tokenizer_config(metadata: dict) -> dict:
    """`tokenizer_config.json` contents: special tokens and chat template."""
    tokens = metadata["tokenizer.ggml.tokens"]
    config = {
        # Keeps transformers from swapping in a model-specific tokenizer class
        # that would rebuild the pre-tokenizer its own way.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(_value(metadata, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_value(metadata, "tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": _value(
            metadata, f"{_value(metadata, 'general.architecture', 'llama')}.context_length", 2048
        ),
    }
    for name in ("bos", "eos", "unknown", "padding"):
        token_id = _value(metadata, f"tokenizer.ggml.{name}_token_id")
        if token_id is not None:
            key = {"unknown": "unk", "padding": "pad"}.get(name, name)
            config[f"{key}_token"] = tokens[token_id]
    if (template := _value(metadata, "tokenizer.chat_template")) is not None:
        config["chat_template"] = template
    return config


def model_config(metadata: dict, weights: dict) -> dict:
    """mlx-lm `config.json` for the model described by the metadata (llama or gemma3)."""
    architecture = _value(metadata, "general.architecture")
    if architecture == "gemma3":
        return gemma3_config(metadata, weights)
    if architecture != "llama":
        raise ValueError(
            f"Unsupported GGUF architecture {architecture!r}: only 'llama' and 'gemma3' are supported."
        )

    def llama(key, default=None):
        return _value(metadata, f"llama.{key}", default)

    hidden_size = llama("embedding_length")
    num_heads = llama("attention.head_count")
    config = {
        "model_type": "llama",
        "hidden_size": hidden_size,
        "num_hidden_layers": llama("block_count"),
        "intermediate_size": llama("feed_forward_length"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": llama("attention.head_count_kv", num_heads),
        "head_dim": llama("attention.key_length", hidden_size // num_heads),
        "rms_norm_eps": llama("attention.layer_norm_rms_epsilon", 1e-5),
        "vocab_size": llama("vocab_size", len(metadata["tokenizer.ggml.tokens"])),
        "rope_theta": llama("rope.freq_base", 10000.0),
        "max_position_embeddings": llama("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in weights,
        # llama.cpp permutes Q/K rows to the interleaved (GPT-J) rotary layout.
        "rope_traditional": True,
        "attention_bias": "blk.0.attn_q.bias" in weights,
        "mlp_bias": "blk.0.ffn_up.bias" in weights,
    }
    scaling = llama("rope.scaling.type", "none")
    if scaling == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": llama("rope.scaling.factor")}
    elif scaling != "none":
        warnings.warn(f"GGUF rope scaling {scaling!r} is not converted.")
    for name in ("bos", "eos"):
        token_id = _value(metadata, f"tokenizer.ggml.{name}_token_id")
        if token_id is not None:
            config[f"{name}_token_id"] = token_id
    return config


def gemma3_config(metadata: dict, weights: dict) -> dict:
    """mlx-lm `config.json` (model_type gemma3_text) for a Gemma 3 GGUF."""

    def gemma3(key, default=None):
        return _value(metadata, f"gemma3.{key}", default)

    hidden_size = gemma3("embedding_length")
    num_heads = gemma3("attention.head_count")
    head_dim = gemma3("attention.key_length", hidden_size // num_heads)
    pattern = gemma3("attention.sliding_window_pattern", GEMMA3_SLIDING_PATTERN)
    if not isinstance(pattern, int):
        raise ValueError(
            f"GGUF sliding-window pattern {pattern!r} is per layer; mlx-lm's gemma3_text takes one period"
        )
    config = {
        "model_type": "gemma3_text",
        "hidden_size": hidden_size,
        "num_hidden_layers": gemma3("block_count"),
        "intermediate_size": gemma3("feed_forward_length"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": gemma3("attention.head_count_kv", num_heads),
        "head_dim": head_dim,
        "rms_norm_eps": gemma3("attention.layer_norm_rms_epsilon", 1e-6),
        "vocab_size": gemma3("vocab_size", len(metadata["tokenizer.ggml.tokens"])),
        "rope_theta": gemma3("rope.freq_base", 1_000_000.0),
        "rope_local_base_freq": GEMMA3_LOCAL_ROPE_BASE,
        # llama.cpp scales queries by 1/sqrt(head_dim) for every Gemma 3 size but 27B.
        "query_pre_attn_scalar": head_dim,
        "sliding_window": gemma3("attention.sliding_window"),
        "sliding_window_pattern": pattern,
        "max_position_embeddings": gemma3("context_length", 32768),
        "tie_word_embeddings": "output.weight" not in weights,
    }
    scaling = gemma3("rope.scaling.type", "none")
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": gemma3("rope.scaling.factor")}
    elif scaling != "none":
        raise ValueError(f"GGUF rope scaling {scaling!r} is not converted for gemma3.")
    for name in ("bos", "eos"):
        token_id = _value(metadata, f"tokenizer.ggml.{name}_token_id")
        if token_id is not None:
            config[f"{name}_token_id"] = token_id
    return config


def _mlx_name(gguf_name: str, architecture: str = "llama") -> str | None:
    """mlx-lm parameter name of a GGUF tensor, or None for tensors to skip."""
    layer_names = LAYER_NAMES_BY_ARCHITECTURE[architecture]
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in TOP_LEVEL_NAMES:
        return f"{TOP_LEVEL_NAMES[parts[0]]}.{parts[1]}"
    if parts[0] in IGNORED_TENSORS:
        warnings.warn(f"Skipping GGUF tensor {gguf_name}: mlx-lm's llama has no use for it.")
        return None
    raise ValueError(f"Unexpected GGUF tensor {gguf_name!r} for a {architecture} model.")


def _input_dims(name: str, config: dict) -> int:
    """Unpacked row length of the weight `name` in the model `config` describes."""
    if name.endswith("o_proj.weight"):
        return config["num_attention_heads"] * config["head_dim"]
    if name.endswith("down_proj.weight"):
        return config["intermediate_size"]
    return config["hidden_size"]


def convert_weights(
    weights: dict, config: dict, dequantize: bool = False
) -> tuple[dict, dict | None]:
    """Rename GGUF tensors for mlx-lm and return them with a quantization config.

    mx.load keeps some GGUF quant types packed as (weight, scales, biases)
    triples and turns the others into float16. With `dequantize` every tensor
    is written as float32; otherwise packed tensors stay packed and float
    tensors take the scales' dtype.
    """
    quantized = {}  # mlx module path -> (group_size, bits)
    converted = {}
    architecture = "gemma3" if config["model_type"] == "gemma3_text" else "llama"
    for gguf_name, tensor in weights.items():
        if gguf_name.endswith((".scales", ".biases")):
            continue
        name = _mlx_name(gguf_name, architecture)
        if name is None:
            continue
        if architecture == "gemma3" and gguf_name.endswith("norm.weight"):
            tensor = tensor - GEMMA_NORM_SHIFT
        base = gguf_name.removesuffix(".weight")
        scales = weights.get(f"{base}.scales")
        if scales is None:
            converted[name] = tensor
            continue
        biases = weights[f"{base}.biases"]
        in_dims = _input_dims(name, config)
        group_size = in_dims // scales.shape[-1]
        bits = tensor.shape[-1] * 32 // in_dims
        if dequantize:
            converted[name] = mx.dequantize(
                tensor,
                scales.astype(mx.float32),
                biases.astype(mx.float32),
                group_size=group_size,
                bits=bits,
            )
            continue
        module = name.removesuffix(".weight")
        converted[name] = tensor
        converted[f"{module}.scales"] = scales
        converted[f"{module}.biases"] = biases
        quantized[module] = (group_size, bits)

    packed_names = {f"{m}.weight" for m in quantized}
    float_dtype = None
    if dequantize:
        float_dtype = mx.float32
    elif quantized:
        float_dtype = next(converted[f"{m}.scales"].dtype for m in quantized)
    if float_dtype is not None:
        for name, tensor in converted.items():
            if name not in packed_names and mx.issubdtype(tensor.dtype, mx.floating):
                converted[name] = tensor.astype(float_dtype)

    if not quantized:
        return converted, None
    (group_size, bits), _ = Counter(quantized.values()).most_common(1)[0]
    quantization = {"group_size": group_size, "bits": bits}
    # mlx-lm reads per-layer overrides for layers packed differently.
    for module, params in quantized.items():
        if params != (group_size, bits):
            quantization[module] = {"group_size": params[0], "bits": params[1]}
    return converted, quantization


def convert_gguf(gguf_path, out_dir, dequantize: bool = False) -> Path:
    """Write an mlx-lm model folder (config, weights, tokenizer) for a llama or gemma3 GGUF.

    The folder loads with `mlx_lm.load(out_dir)`. With `dequantize=True` the
    weights are written as float32 instead of staying 4/8-bit packed.
    """
    weights, metadata = load_gguf(gguf_path, dequantize)
    config = model_config(metadata, weights)
    tokenizer = build_tokenizer(metadata)
    tok_config = tokenizer_config(metadata)
    weights, quantization = convert_weights(weights, config, dequantize)
    if quantization is not None:
        config["quantization"] = quantization

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    tokenizer.save(str(out / "tokenizer.json"))
    special_tokens = {k: v for k, v in tok_config.items() if k.endswith("_token")}
    for filename, content in (
        ("config.json", config),
        ("tokenizer_config.json", tok_config),
        ("special_tokens_map.json", special_tokens),
    ):
        with open(out / filename, "w", encoding="utf-8") as f:
            json.dump(content, f, indent=2, ensure_ascii=False)
    return out


def run_convert(args) -> int:
    """Entry point of `veloxquant convert-gguf`."""
    from .outputs import check_out_dir, replacing_dir

    if not Path(args.gguf_file).is_file():
        raise FileNotFoundError(f"no GGUF file {args.gguf_file}")
    out = check_out_dir(args.out_dir, args.force, what="OUT_DIR")
    with replacing_dir(out, args.force) as temp:
        convert_gguf(args.gguf_file, temp, dequantize=args.dequantize)
    print(f"Wrote mlx-lm model folder {out}")
    return 0


def register_cli(subparsers):
    """Add the `convert-gguf FILE OUT_DIR [--dequantize]` command."""
    parser = subparsers.add_parser(
        "convert-gguf",
        help="convert a llama or gemma3 GGUF file into an mlx-lm model folder",
        description="Convert a llama- or gemma3-architecture GGUF file into a folder "
        "that mlx_lm.load (and veloxquant) can load.",
    )
    parser.add_argument("gguf_file", metavar="FILE", help="the .gguf file")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="folder to write")
    parser.add_argument("--force", action="store_true", help="replace a non-empty OUT_DIR (default: refuse)")
    parser.add_argument(
        "--dequantize",
        action="store_true",
        help="write float32 weights instead of keeping the GGUF's quantized ones",
    )
    parser.set_defaults(func=run_convert)
    return parser
