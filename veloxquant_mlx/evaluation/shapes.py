"""Random-weight models of real architectures, built from their published config.json
values with mlx-lm's own model classes (nothing is downloaded). Speed and memory
depend on shapes, not on weight values, so these stand in for the real models in
benchmarks."""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

SHAPES: Dict[str, Dict[str, Any]] = {
    # meta-llama/Llama-3.1-8B
    "llama-3.1-8b": {
        "model_type": "llama",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
    },
    # mistralai/Mistral-7B-v0.3 (mlx-lm runs "mistral" with its llama module)
    "mistral-7b": {
        "model_type": "mistral",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 32768,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    },
    # Qwen/Qwen3-4B
    "qwen3-4b": {
        "model_type": "qwen3",
        "hidden_size": 2560,
        "num_hidden_layers": 36,
        "intermediate_size": 9728,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": True,
    },
    # Qwen/Qwen2.5-7B (head_dim 3584 / 28 = 128; q/k/v projections have biases)
    "qwen2.5-7b": {
        "model_type": "qwen2",
        "hidden_size": 3584,
        "num_hidden_layers": 28,
        "intermediate_size": 18944,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
    },
    # for CI: the same code paths in milliseconds
    "tiny": {
        "model_type": "llama",
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 1024,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
    },
}

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


def default_dtype_name() -> str:
    """fp16 activations on a GPU; float32 on the CPU, where half precision is slow."""
    return "float32" if mx.default_device() == mx.cpu else "float16"


def resolve_dtype(name: Optional[str]):
    name = default_dtype_name() if name in (None, "auto") else name
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of auto, {', '.join(DTYPES)}")
    return name, DTYPES[name]


def shape_config(name: str) -> Dict[str, Any]:
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known shapes: {', '.join(SHAPES)}")
    return dict(SHAPES[name])


def shape_parameters(name: str) -> int:
    """The named architecture's parameter count, from its shapes (the random weights are never computed)."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(shape_config(name))
    return sum(p.size for _, p in tree_flatten(model_class(args_class.from_dict(shape_config(name))).parameters()))


def cpu_shape_notice(name: str, dtype: Optional[str], tokens: int, runs: int) -> Optional[str]:
    """One line for `benchmark --shape NAME` on the CPU with a model of a billion parameters or more: it is
    sized for a GPU. `tokens` are the prefill tokens of one configuration, `runs` the configurations times
    their runs. None on a GPU or for a small shape; a ValueError where the weights exceed the memory."""
    if mx.default_device() != mx.cpu:
        return None
    parameters = shape_parameters(name)
    if parameters < 1e9:
        return None
    dtype_name, mx_dtype = resolve_dtype(dtype)
    weight_bytes = parameters * mx_dtype.size
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    size = f"a random {parameters / 1e9:.1f}B-parameter model, {weight_bytes / 1e9:.1f} GB of {dtype_name} weights"
    if weight_bytes > memory:
        raise ValueError(f"--shape {name} is {size}; this machine has {memory / 1e9:.1f} GB of memory. "
                         "It is sized for a GPU; --shape tiny runs the same code paths in seconds")
    flops = 2 * parameters * tokens * runs
    return (f"note: --shape {name} is sized for a GPU: {size}, and its prefills take {flops / 1e15:.0f} PFLOP "
            f"(2 x parameters x tokens), hours on this CPU; --shape tiny runs the same code paths in seconds")


def materialize(model: nn.Module) -> None:
    # one parameter at a time keeps random-init temporaries small for 8B shapes
    for _, parameter in tree_flatten(model.parameters()):
        mx.eval(parameter)


def quantize_weights(model: nn.Module, bits: Optional[int], group_size: int = 64) -> None:
    if bits is None or bits >= 16:
        return
    nn.quantize(model, group_size=group_size, bits=bits)
    materialize(model)


def build_shape_model(name: str, dtype: Optional[str] = None, weights_bits: Optional[int] = None,
                      seed: int = 0, overrides: Optional[Dict[str, Any]] = None) -> nn.Module:
    """A random-weight model of the named architecture, activations in `dtype`,
    weights quantized to `weights_bits` (None/16 = float weights); `overrides` replace
    config values (e.g. fewer layers for a quick run)."""
    from mlx_lm.utils import _get_classes

    config = {**shape_config(name), **(overrides or {})}
    model_class, args_class = _get_classes(config)
    _, mx_dtype = resolve_dtype(dtype)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(mx_dtype)
    materialize(model)
    quantize_weights(model, weights_bits)
    model.eval()
    return model


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def copy_tokenizer(target, source=None) -> Dict[str, Any]:
    """Copy the tokenizer files of `source` (SmolLM2's converted folder by default) into the folder `target`;
    returns `source`'s config.json, whose vocabulary size and special token ids a model folder needs."""
    import json
    import shutil
    from pathlib import Path

    from ..models import default_model_dir

    source, target = Path(source) if source else default_model_dir(), Path(target)
    target.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, target / name)
    return json.loads((source / "config.json").read_text())


def write_random_model_folder(target, config: Dict[str, Any], seed: int = 0, scale: float = 1.0,
                              weight_index: bool = False, tokenizer_from=None):
    """A model folder that `mlx_lm.load` and the servers open: `config`'s architecture (its `model_type`'s own
    mlx-lm class) with seeded random weights, 2-D weights multiplied by `scale`, and the tokenizer of
    `tokenizer_from` (SmolLM2's by default) and its vocabulary size, which replaces `config`'s. `weight_index`
    also writes `model.safetensors.index.json`, which pipeline loading reads."""
    import json
    from pathlib import Path

    from mlx.utils import tree_map
    from mlx_lm.utils import _get_classes

    target = Path(target)
    source_config = copy_tokenizer(target, tokenizer_from)
    config = {**config, "vocab_size": source_config["vocab_size"]}
    (target / "config.json").write_text(json.dumps(config))
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    if scale != 1.0:
        model.update(tree_map(lambda p: p * scale if p.ndim == 2 else p, model.parameters()))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(target / "model.safetensors"), weights)
    if weight_index:
        index = {"metadata": {}, "weight_map": {name: "model.safetensors" for name in weights}}
        (target / "model.safetensors.index.json").write_text(json.dumps(index))
    return target
