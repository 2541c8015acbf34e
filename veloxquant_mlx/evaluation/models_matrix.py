"""The architecture matrix: every mlx-lm model file with a KV cache, run on a tiny random model with
mlx-lm's caches and with VeloxQuant's, and a status per file (`veloxquant models`, docs/models.md).

Each file's model is built from its own `ModelArgs`: sizes shrunk to 2-4 layers, a small hidden size and
vocabulary, at the family's default head dim where the file states one (`derive_config`; `OVERRIDES` only
where derivation cannot guess a field). A prompt is prefilled, then the next tokens are fed one at a time
(the same tokens for every cache), and the decode steps' logits are compared with those of mlx-lm's caches.

Statuses: "supported" (runs, mean KL under `KL_THRESHOLD` for every spec), "refused" (the library raises
`UnsupportedModelError`, which names the reason), "bug" (anything else: an error, NaN, a wrong shape, a KL
over the threshold). A file whose model cannot be built or run with mlx-lm's own caches is "unbuilt".
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import os
import re
import time
import traceback
import typing
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import mlx.core as mx
import mlx_lm.models
from mlx.utils import tree_flatten
from mlx_lm.models import cache as mlx_cache

from ..integration import UnsupportedModelError
from .moe_routing import RouterReplay
from .specs import parse_method_spec

SPECS = ("vq4", "kivi:4")
SUPPORTED, REFUSED, BUG, UNBUILT = "supported", "refused", "bug", "unbuilt"

# Files of mlx-lm's models folder that hold no model.
HELPERS = {"__init__", "activations", "base", "bitlinear_layers", "cache", "gated_delta", "mla", "pipeline",
           "rope_utils", "ssm", "switch_layers"}

LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB, FFN, EXPERTS, WINDOW = 2, 4, 2, 64, 512, 128, 4, 128

MAX_PARAMETERS = 40_000_000

# Fields set whatever the file's default is (by name); the hidden size follows the heads and head dim.
SIZES = {
    "num_hidden_layers": LAYERS, "n_layer": LAYERS, "n_layers": LAYERS, "num_layers": LAYERS,
    "vocab_size": VOCAB, "num_vocab": VOCAB, "num_attention_heads": HEADS, "n_head": HEADS, "n_heads": HEADS,
    "num_heads": HEADS, "num_key_value_heads": KV_HEADS, "n_kv_heads": KV_HEADS, "num_kv_heads": KV_HEADS,
    "multi_query_group_num": KV_HEADS, "intermediate_size": FFN, "ffn_dim": FFN, "n_inner": FFN,
    "moe_intermediate_size": FFN, "shared_expert_intermediate_size": FFN, "expert_intermediate_size": FFN,
    "num_experts": EXPERTS, "n_routed_experts": EXPERTS, "num_local_experts": EXPERTS, "moe_num_experts": EXPERTS,
    "num_experts_per_tok": 2, "moe_k": 2, "top_k": 2, "n_group": 1, "topk_group": 1,
    "max_position_embeddings": 4096, "n_positions": 4096, "n_ctx": 4096, "max_seq_len": 4096,
    "rms_norm_eps": 1e-5, "layer_norm_eps": 1e-5, "norm_eps": 1e-5, "layer_norm_epsilon": 1e-5,
    "rope_theta": 10000.0, "tie_word_embeddings": True,
    "kv_lora_rank": 64, "q_lora_rank": 64, "first_k_dense_replace": 0,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 64,
    "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4,
    "ffn_hidden_size": FFN, "expert_ffn_hidden_size": FFN, "ff_intermediate_size": FFN,
    "num_attention_groups": KV_HEADS,
}
# A top-k of experts whose default is over EXPERTS (it would pick more experts than are built) is cut to 2.
TOP_K_PATTERN = re.compile(r"experts_per_tok|^(moe_)?top_?k$")
HIDDEN_NAMES = ("hidden_size", "d_model", "n_embd", "dim", "model_dim", "embed_dim")
HEAD_DIM_NAMES = ("head_dim", "head_size", "kv_channels", "attention_head_dim")
WINDOW_NAMES = ("sliding_window", "sliding_window_size", "window_size", "attention_window_size")

# Fields derivation cannot guess, per file (merged over the derived config; a dict into a derived dict).
_SLIDING_FULL = ["sliding_attention", "full_attention"]
_ROPE = {"rope_theta": 10000.0, "rope_type": "default"}
_LLAMA4_ROPE = {**_ROPE, "llama_4_scaling_beta": 0.1, "original_max_position_embeddings": 4096}
OVERRIDES: Dict[str, Dict[str, Any]] = {
    "Klear": {"mlp_only_layers": [], "decoder_sparse_step": 1},
    "afm7": {"hidden_dim": HEADS * HEAD_DIM, "num_kv_reuse_layers": 1, "num_layers": 3},
    "afmoe": {"layer_types": _SLIDING_FULL, "num_hidden_layers": 2},
    "dbrx": {"ffn_config": {"ffn_hidden_size": FFN, "moe_num_experts": EXPERTS, "moe_top_k": 2},
             "attn_config": {"kv_n_heads": KV_HEADS, "rope_theta": 10000.0, "clip_qkv": 8.0}},
    "deepseek_v2": {"rope_scaling": {"factor": 1.0, "mscale_all_dim": 0, "original_max_position_embeddings": 4096,
                                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0}},
    "minicpm3": {"rope_scaling": {"original_max_position_embeddings": 4096, "short_factor": 1.0,
                                  "long_factor": 1.0}, "dim_model_base": 256, "scale_depth": 1.4,
                 "scale_emb": 12.0, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32},
    "exaone_moe": {"layer_types": _SLIDING_FULL, "is_moe_layer": [False, True], "num_hidden_layers": 2},
    "gear": {"layer_types": _SLIDING_FULL, "num_hidden_layers": 2},
    "muse_spark": {"text_config": {"rope_parameters": _ROPE, "layer_types": _SLIDING_FULL,
                                   "layer_rope_theta": [10000.0, 10000.0], "num_hidden_layers": 2}},
    "hunyuan": {"rope_scaling": {"alpha": 1.0, "factor": 1.0, "type": "dynamic"}},
    "jamba": {"layers_block_type": ["mamba", "attention"], "num_hidden_layers": 2},
    "kimi_linear": {"linear_attn_config": {"kda_layers": [1], "num_heads": HEADS, "head_dim": HEAD_DIM,
                                           "short_conv_kernel_size": 4}},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_hidden_layers": 2},
    "llama4_text": {"no_rope_layers": [1, 0], "num_hidden_layers": 2},
    "mellum": {"layer_types": _SLIDING_FULL, "num_hidden_layers": 2,
               "rope_parameters": {"sliding_attention": _ROPE, "full_attention": _ROPE}},
    "minimax": {"rotary_dim": HEAD_DIM},
    "ministral3": {"rope_parameters": _LLAMA4_ROPE},
    "mistral4": {"rope_parameters": _LLAMA4_ROPE},
    "olmo3": {"layer_types": _SLIDING_FULL, "num_hidden_layers": 2},
    "olmo_hybrid": {"layer_types": ["linear_attention", "full_attention"], "num_hidden_layers": 2},
    "openelm": {"num_query_heads": [HEADS, HEADS], "num_kv_heads": [KV_HEADS, KV_HEADS],
                "ffn_multipliers": [2.0, 2.0]},
    "phi": {"partial_rotary_factor": 0.5},
    "plamo": {"n_shared_head": 2},
    "granite": {"attention_multiplier": 1 / HEAD_DIM, "logits_scaling": 8.0, "embedding_multiplier": 12.0,
                "residual_multiplier": 0.22},
    "granitemoe": {"attention_multiplier": 1 / HEAD_DIM, "logits_scaling": 8.0, "embedding_multiplier": 12.0,
                   "residual_multiplier": 0.22},
    "gemma4_text": {"num_kv_shared_layers": 2, "vocab_size_per_layer_input": VOCAB},
    "gemma4": {"text_config": {"num_kv_shared_layers": 2, "vocab_size_per_layer_input": VOCAB}},
    "gemma3n": {"text_config": {"layer_types": _SLIDING_FULL * 2, "num_hidden_layers": 4,
                                "activation_sparsity_pattern": [0.0] * 4, "num_kv_shared_layers": 2,
                                "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 64,
                                "rope_local_base_freq": 10000.0, "final_logit_softcapping": 30.0,
                                "altup_num_inputs": 4, "altup_coef_clip": 120.0, "altup_correct_scale": True,
                                "altup_active_idx": 0, "laurel_rank": 64}},
    "baichuan_m1": {"sliding_window_layers": [0], "conv_window": 2, "tie_word_embeddings": False},
    "exaone4": {"sliding_window_pattern": "LG", "rope_scaling": None, "num_hidden_layers": 2,
                "sliding_window": WINDOW},
    "glm_moe_dsa": {"rope_parameters": _ROPE, "topk_method": "noaux_tc", "index_topk": 128, "index_n_heads": HEADS},
    "mimo_v2_flash": {"hybrid_layer_pattern": [1, 0], "moe_layer_freq": [0, 1], "num_hidden_layers": 2,
                      "topk_method": "noaux_tc", "add_swa_attention_sink_bias": True,
                      "add_full_attention_sink_bias": False},  # as MiMo-V2-Flash's config
    "granitemoehybrid": {"layer_types": ["mamba", "attention"], "num_hidden_layers": 2, "mamba_n_heads": 4,
                         "mamba_d_head": 32, "mamba_proj_bias": False, "mamba_d_state": 16, "mamba_d_conv": 4,
                         "mamba_n_groups": 1, "mamba_conv_bias": True,
                         "shared_intermediate_size": FFN},
    "mamba2": {"intermediate_size": HEADS * HEAD_DIM, "state_size": 16, "conv_kernel": 4, "n_groups": 1,
               "time_step_rank": "auto", "time_step_limit": (0.001, 100.0)},
    "nemotron_h": {"hybrid_override_pattern": "M*", "num_hidden_layers": 2, "mamba_num_heads": 4,
                   "mamba_head_dim": 32, "ssm_state_size": 16, "n_groups": 1, "conv_kernel": 4,
                   "time_step_limit": (0.001, 100.0)},
    "kimi_k3": {"text_config": {"linear_attn_config": {"kda_layers": [1], "num_heads": HEADS,
                                                       "head_dim": HEAD_DIM, "short_conv_kernel_size": 4},
                                "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64}},
    "lfm2": {"layer_types": ["conv", "full_attention"], "num_hidden_layers": 2, "block_dim": HEADS * HEAD_DIM,
             "block_ff_dim": FFN, "block_auto_adjust_ff_dim": False, "conv_L_cache": 3},
    "llama4": {"text_config": {"num_experts_per_tok": 1, "no_rope_layers": [1, 1, 1, 0], "num_hidden_layers": 4}},
    # DeepSeek-V4.1: the output LoRA keeps its 8 x 1024 default (17M parameters a layer) unless sized here; the
    # per-layer roles are id lists, which derivation leaves empty (then every layer is window-only). As the
    # released config in small: window only, a ratio-2 and a ratio-1 compressing KV source, one reusing layer,
    # the ratio-1 source picking candidate blocks; top-k's small enough to choose among 300 tokens.
    "deepseek_v41": {"num_hidden_layers": 4, "o_groups": 2, "o_lora_rank": 64, "compress_ratios": [0, 2, 1, 1],
                     "kv_source_layer_ids": [1, 2], "index_source_layer_ids": [1, 2], "candidate_source_layer_id": 2,
                     "candidate_topk_blocks": 8, "index_topk": 16},
    # LongCat-Flash reads these scales only when true, as its config sets them (false: an attribute error).
    "longcat_flash": {"mla_scale_q_lora": True, "mla_scale_kv_lora": True, "zero_expert_type": "identity"},
    "longcat_flash_ngram": {"mla_scale_q_lora": True, "mla_scale_kv_lora": True},
    # One block config per layer (a list derivation leaves empty): attention, no-op attention, attention
    # replaced by a linear layer, attention, as Nemotron-NAS's pruned layers are.
    "nemotron-nas": {"num_hidden_layers": 4, "block_configs": [
        {"attention": {"n_heads_in_group": HEADS // KV_HEADS}, "ffn": {"ffn_mult": 1.0}},
        {"attention": {"no_op": True}, "ffn": {"ffn_mult": 1.0}},
        {"attention": {"replace_with_linear": True}, "ffn": {"ffn_mult": 1.0}},
        {"attention": {"n_heads_in_group": HEADS // KV_HEADS}, "ffn": {"ffn_mult": 1.0}}]},
    "spark2_5": {"layer_types": _SLIDING_FULL, "num_hidden_layers": 2,
                 "rope_parameters": {"sliding_attention": _ROPE, "full_attention": _ROPE}},
    # The block list is optional (two spellings in the 2B and 9B configs), so derivation leaves it None; the
    # soft cap and conv width as RecurrentGemma's config (a derived cap of 1 would squash every logit).
    "recurrent_gemma": {"block_types": ["recurrent", "attention"], "logits_soft_cap": 30.0, "conv1d_width": 4},
    # A Hadamard pack must name its schema and list its packed modules: one, layer 0's MLP down projection
    # (its shared expert's; 2-bit codes, zero at init, so that projection gives zeros; attention is Qwen3.5's).
    "prism_hadamard_qwen35": {"schema_version": 1, "tensor_namespace": "mlx-lm-text",
                              "quantization": {"bits": 2, "group_size": 128, "mode": "affine"},
                              "modules": [{"path": "model.layers.0.mlp.shared_expert.down_proj", "embedding": False,
                                           "dtype": "float16", "block": 0}]},
    # A linear-attention layer, then a softmax one (derived 1: every layer softmax, and the GLA mask asks the
    # KV cache for an SSM mask).
    "bailing_moe_linear": {"layer_group_size": 2},
    # Every 2nd layer dense and the GeGELU limit as Phi-3-small (derived 1: every layer block-sparse); the file
    # sets the logits of fixed token ids up to 100351 to -inf, which at a smaller vocabulary writes out of
    # bounds and kills the process.
    "phi3small": {"dense_attention_every_n_layers": 2, "gegelu_limit": 20.0, "vocab_size": 100352},
}


@dataclass
class Record:
    """One file's row."""

    file: str
    arch: str = ""
    group: str = ""
    status: str = UNBUILT
    reason: str = ""
    head_dim: Optional[int] = None
    caches: str = ""
    kl: Dict[str, Optional[float]] = field(default_factory=dict)
    max_dlogit: Dict[str, Optional[float]] = field(default_factory=dict)
    bytes_ratio: Dict[str, Optional[float]] = field(default_factory=dict)  # every layer's cache
    attention_bytes_ratio: Dict[str, Optional[float]] = field(default_factory=dict)  # the attention layers' only
    # A file in `moe_routing.REPLAYABLE`: the KL with mlx-lm's expert choices replayed, which decides the status,
    # and the routings that flipped when routing freely ("flipped/routed").
    kl_routing_replayed: Dict[str, float] = field(default_factory=dict)
    routings_flipped: Dict[str, str] = field(default_factory=dict)
    spec_status: Dict[str, str] = field(default_factory=dict)
    spec_reason: Dict[str, str] = field(default_factory=dict)
    tracebacks: Dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0


def model_files() -> List[str]:
    folder = os.path.dirname(mlx_lm.models.__file__)
    names = sorted(n[:-3] for n in os.listdir(folder) if n.endswith(".py"))
    return [n for n in names if n not in HELPERS]


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return dataclasses.MISSING


def _filler(name: str, annotation) -> Any:
    """A value for a required field that `SIZES` does not name, from its name and type."""
    text = str(annotation).replace("typing.", "")
    if text.startswith("Optional") or text.endswith("None]") or "NoneType" in text:
        return None
    if text.startswith(("Dict", "dict", "<class 'dict'>")):
        return {}
    if text.startswith(("List", "list", "<class 'list'>", "Tuple", "tuple")):
        return []
    if "head_dim" in name:
        return HEAD_DIM
    if "window" in name and "int" in text:
        return WINDOW
    if "bool" in text:
        return False
    if "int" in text:
        return 1
    if "float" in text:
        return 1e-5 if "eps" in name else 1.0
    if "str" in text:
        return "silu" if "act" in name else name
    return None


LAYER_COUNT_NAMES = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")


def _mix_layer_kinds(config: Dict[str, Any], fields: Dict[str, dataclasses.Field]) -> None:
    """Keep every kind of layer the family mixes in the few layers built: a `*pattern` of every n-th layer
    becomes every 2nd of 4, and a per-layer list (as long as the default layer count) cycles over its kinds."""
    count_key = next((k for k in LAYER_COUNT_NAMES if k in fields), None)
    default_count = _default(fields[count_key]) if count_key else None
    layers = config.get(count_key, LAYERS) if count_key else LAYERS
    for key, f in fields.items():
        default = _default(f)
        if ("pattern" in key or key.endswith("_interval")) and isinstance(default, int) and not isinstance(default, bool) and default > 1:
            config[key], layers = 2, max(layers, 4)
        elif (isinstance(default, (list, tuple)) and isinstance(default_count, int) and len(default) == default_count
              and key not in config):
            kinds = list(dict.fromkeys(default))
            layers = max(layers, min(4, len(kinds)) if len(kinds) > 1 else layers)
            config[key] = [kinds[i % len(kinds)] for i in range(max(layers, LAYERS))]
    if count_key:
        config[count_key] = layers
    for key, value in config.items():  # lists fixed before the count grew
        if key in fields and isinstance(value, list) and isinstance(_default(fields[key]), (list, tuple)) \
                and len(value) not in (0, layers) and isinstance(default_count, int) \
                and len(_default(fields[key])) == default_count:
            kinds = list(dict.fromkeys(value))
            config[key] = [kinds[i % len(kinds)] for i in range(layers)]


NESTED_NAMES = ("text_config", "llm_config", "language_config")


def _inner_module(name: str) -> Optional[str]:
    """The model file a wrapper (a vision-language file) builds its language model from."""
    module = importlib.import_module(f"mlx_lm.models.{name}")
    source = open(module.__file__).read()
    found = re.findall(r"from \. import ([a-z0-9_]+)|from \.([a-z0-9_]+) import", source)
    for pair in found:
        inner = pair[0] or pair[1]
        if inner not in HELPERS and inner != name:
            return inner
    return None


def wrapped_file(name: str) -> Optional[str]:
    """The file whose language model a wrapper file (a nested text config) runs: it shares that architecture."""
    try:
        module = importlib.import_module(f"mlx_lm.models.{name}")
    except (Exception, SystemExit):  # olmo exits on import without its package
        return None
    nested = [f.name for f in dataclasses.fields(module.ModelArgs) if f.name in NESTED_NAMES]
    if not nested or any(dataclasses.is_dataclass(getattr(module, n, None))
                         for n in ("TextConfig", "TextArgs", "TextModelArgs")):
        return None
    return _inner_module(name)


def derive_fields(cls, name: str, module) -> Dict[str, Any]:
    """A tiny config for the dataclass `cls` of file `name`, from its fields and defaults."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    try:
        hints = typing.get_type_hints(cls)
    except Exception:
        hints = {}
    config: Dict[str, Any] = {}
    for key, f in fields.items():
        default = _default(f)
        if key in SIZES:
            config[key] = SIZES[key]
        elif key in NESTED_NAMES and default is dataclasses.MISSING or (key in NESTED_NAMES and default is None):
            inner = next((getattr(module, n) for n in ("TextConfig", "TextArgs", "TextModelArgs")
                          if dataclasses.is_dataclass(getattr(module, n, None))), None)
            if inner is not None:
                config[key] = derive_fields(inner, name, module)
            elif _inner_module(name):
                inner_config = derive_config(_inner_module(name))
                config[key] = inner_config.get(key, inner_config)  # a wrapper of a wrapper (Qwen3.5-MoE)
        elif default is dataclasses.MISSING:
            config[key] = _filler(key, hints.get(key, f.type))
        elif TOP_K_PATTERN.search(key) and type(default) is int and default > EXPERTS:
            config[key] = 2
    head_dim = next((_default(fields[k]) for k in HEAD_DIM_NAMES if k in fields
                     and isinstance(_default(fields[k]), int)), None) or HEAD_DIM
    for key in HEAD_DIM_NAMES:
        if key in fields:
            config[key] = head_dim
    for key in HIDDEN_NAMES:
        if key in fields:
            config[key] = HEADS * head_dim
    for key in WINDOW_NAMES:
        if key in fields and isinstance(_default(fields[key]), int) and _default(fields[key]) > WINDOW:
            config[key] = WINDOW
    _mix_layer_kinds(config, fields)
    if "model_type" in fields and _default(fields["model_type"]) is dataclasses.MISSING:
        config["model_type"] = name
    return config


def derive_config(name: str) -> Dict[str, Any]:
    """A tiny config for `mlx_lm.models.<name>`, from its `ModelArgs` (`OVERRIDES` merged on top)."""
    module = importlib.import_module(f"mlx_lm.models.{name}")
    config = derive_fields(module.ModelArgs, name, module)
    for key, value in OVERRIDES.get(name, {}).items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    return config


def _one_plus_weight(cls) -> bool:
    try:
        source = inspect.getsource(cls.__call__)
    except (OSError, TypeError):
        return False
    return bool(re.search(r"1(\.0)? \+ self\.weight|self\.weight \+ 1\b", source))


def unit_norm_scale(model) -> int:
    """Zero the weights of norms that scale by (1 + weight) (the Gemma families, Nemotron), so that at random init
    they scale by 1 as every other family's norms do; returns how many. At their init of ones they scale
    queries and keys by 2 after the QK norms, making attention scores 4 times sharper than in any other
    random model here (and the KL of any quantizer many times larger: docs/models.md)."""
    count = 0
    for module in model.modules():
        if isinstance(getattr(module, "weight", None), mx.array) and _one_plus_weight(type(module)):
            module.weight = mx.zeros_like(module.weight)
            count += 1
    return count


def fold_unit_attention_scale(model) -> int:
    """An attention with scale 1 and a QK norm (Gemma 4) leaves the 1/sqrt(head dim) to its trained q-norm
    weights; at random init (ones) its scores would be sqrt(head dim) times sharper than any other family's.
    Fold the usual scale into the q-norm weights; returns how many attentions."""
    count = 0
    for module in model.modules():
        norm = getattr(module, "q_norm", None)
        scale = getattr(module, "scale", None)  # a norm's scale can be an array (PLaMo 3)
        if isinstance(scale, (int, float)) and scale == 1.0 and isinstance(getattr(norm, "weight", None), mx.array):
            head_dim = getattr(module, "head_dim", norm.weight.shape[-1])
            norm.weight = norm.weight * head_dim**-0.5
            count += 1
    return count


def build_model(name: str, seed: int = 0):
    module = importlib.import_module(f"mlx_lm.models.{name}")
    config = derive_config(name)
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    size = sum(v.size for _, v in tree_flatten(model.parameters()))
    if size > MAX_PARAMETERS:
        raise ValueError(f"the derived model has {size / 1e6:.0f}M parameters (a size field kept its default)")
    unit_norm_scale(model)
    fold_unit_attention_scale(model)
    mx.eval(model.parameters())
    return model, config


def run_caches(model, caches, tokens: mx.array, prefill: int, chunk: int = 0) -> mx.array:
    """The logits of each token after prefilling `tokens[:prefill]`, float32, (steps, vocab): the next `chunk`
    tokens in one call (each attends over the compressed prefill), then the rest one at a time."""
    mx.eval(model(tokens[None, :prefill], cache=caches))
    out = []
    if chunk:
        logits = model(tokens[None, prefill:prefill + chunk], cache=caches)[0].astype(mx.float32)
        mx.eval(logits)
        out.extend(logits)
        prefill += chunk
    for t in range(prefill, tokens.shape[0]):
        logits = model(tokens[None, t:t + 1], cache=caches)[0, -1].astype(mx.float32)
        mx.eval(logits)
        out.append(logits)
    return mx.stack(out)


def kl_and_max(reference: mx.array, other: mx.array):
    logp = reference - mx.logsumexp(reference, axis=-1, keepdims=True)
    logq = other - mx.logsumexp(other, axis=-1, keepdims=True)
    kl = mx.sum(mx.exp(logp) * (logp - logq), axis=-1)
    return mx.mean(kl).item(), mx.max(mx.abs(reference - other)).item()


def cache_bytes(caches) -> int:
    return sum(int(getattr(c, "nbytes", 0) or 0) for c in caches)


def attention_bytes(caches) -> int:
    """`cache_bytes` of the attention layers' caches alone: a hybrid layer's `CacheList` counts its attention
    member, and the state caches of linear-attention and state-space layers (`ArraysCache`) count nothing."""
    total = 0
    for cache in caches:
        if isinstance(cache, mlx_cache.CacheList):
            total += attention_bytes(cache.caches)
        elif not isinstance(cache, mlx_cache.ArraysCache):
            total += int(getattr(cache, "nbytes", 0) or 0)
    return total


def cache_kinds(caches) -> str:
    return ",".join(sorted({type(c).__name__ for c in caches}))


def short_error(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".splitlines()[0]
    return text[:200]


def check_file(name: str, prefill: int = 300, decode: int = 20, specs=SPECS, seed: int = 0, stage=None,
               chunk: int = 0) -> Record:
    """One file's record: KL, largest logit difference and bytes ratio per spec; `apply_thresholds` gives the
    statuses of the KLs. `chunk`: the first `chunk` of the `decode` tokens in one call (`run_caches`).
    `stage(text)` is told what runs next (a worker's parent names a crash with it)."""
    stage = stage or (lambda text: None)
    with RouterReplay(name) as router:  # a file in moe_routing.REPLAYABLE: its router recorded and replayed
        return _check_file(name, prefill, decode, specs, seed, stage, chunk, router)


def _check_file(name: str, prefill: int, decode: int, specs, seed: int, stage, chunk: int,
                router: RouterReplay) -> Record:
    start = time.perf_counter()
    record = Record(file=name)
    stage("mlx-lm's caches")
    try:
        model, config = build_model(name, seed)
        record.arch = str(getattr(model, "model_type", None) or config.get("model_type") or name)
        vocab = int(config.get("vocab_size") or VOCAB)
        tokens = mx.random.randint(0, vocab, (prefill + decode,), key=mx.random.key(seed + 1))
        reference_caches = mlx_cache.make_prompt_cache(model)
        record.caches = cache_kinds(reference_caches)
        router.restart("record")
        reference = run_caches(model, reference_caches, tokens, prefill, chunk)
        router.restart("free")
        reference_bytes = cache_bytes(reference_caches)
        reference_attention = attention_bytes(reference_caches)
        record.group = group_of(record, config)
        record.head_dim = next((config[k] for k in HEAD_DIM_NAMES if isinstance(config.get(k), int)), None)
    except (Exception, SystemExit) as error:  # a file that exits on import (olmo asks for a package)
        record.reason = "mlx-lm's caches: " + short_error(error)
        record.seconds = time.perf_counter() - start
        return record
    if not bool(mx.all(mx.isfinite(reference)).item()):
        record.reason = "mlx-lm's caches give non-finite logits"
        record.seconds = time.perf_counter() - start
        return record
    for spec in specs:
        stage(spec)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                router.restart("count")
                caches = parse_method_spec(spec).make_caches(model)
                logits = run_caches(model, caches, tokens, prefill, chunk)
                if router.enabled:
                    record.routings_flipped[spec] = f"{router.flipped}/{router.routed}"
                    router.restart("replay")
                    replayed = run_caches(model, parse_method_spec(spec).make_caches(model), tokens, prefill, chunk)
                    record.kl_routing_replayed[spec] = kl_and_max(reference, replayed)[0]
                router.restart("free")
            if logits.shape != reference.shape:
                raise ValueError(f"logits of shape {logits.shape}, mlx-lm's {reference.shape}")
            if not bool(mx.all(mx.isfinite(logits)).item()):
                raise ValueError("non-finite logits")
            kl, worst = kl_and_max(reference, logits)
            record.kl[spec], record.max_dlogit[spec] = kl, worst
            record.bytes_ratio[spec] = cache_bytes(caches) / max(reference_bytes, 1)
            if reference_attention:
                record.attention_bytes_ratio[spec] = attention_bytes(caches) / reference_attention
            record.spec_status[spec] = SUPPORTED
        except UnsupportedModelError as error:
            record.spec_status[spec], record.spec_reason[spec] = REFUSED, str(error)
        except Exception as error:
            record.spec_status[spec], record.spec_reason[spec] = BUG, short_error(error)
            record.tracebacks[spec] = traceback.format_exc(limit=-4)
    record.seconds = time.perf_counter() - start
    return record


def group_of(record: Record, config: Dict[str, Any]) -> str:
    """The architecture group a file is tested in: the caches mlx-lm makes for it, and MLA."""
    kinds = set(record.caches.split(",")) - {""}
    if "kv_lora_rank" in config:
        return "mla"
    if kinds - {"KVCache", "RotatingKVCache"}:
        return "hybrid"
    if "RotatingKVCache" in kinds:
        return "sliding"
    return "full" if kinds else "unbuilt"


CALIBRATION_FILE = "llama"
K = 10.0  # a supported file's KL is at most K times the llama family's, per spec


def thresholds_from(record: Record, k: float = K) -> Dict[str, float]:
    """K times the calibration file's KL, per spec."""
    record = apply_thresholds(record, {spec: float("inf") for spec in record.kl})
    if record.status != SUPPORTED:
        raise RuntimeError(f"the llama family, which calibrates the threshold, is not supported: {record.reason}")
    return {spec: k * record.kl[spec] for spec in record.kl}


def apply_thresholds(record: Record, thresholds: Dict[str, float]) -> Record:
    """Mark a spec whose KL is over its threshold a bug, and set the file's status from its specs'. A file whose
    router is replayed is judged on its KL with mlx-lm's expert choices (`moe_routing`)."""
    for spec, kl in record.kl.items():
        replayed = spec in record.kl_routing_replayed
        kl = record.kl_routing_replayed.get(spec, kl)
        if record.spec_status.get(spec) == SUPPORTED and not kl <= thresholds[spec]:
            record.spec_status[spec] = BUG
            record.spec_reason[spec] = (f"{spec}: KL {kl:.3g}{' with routing replayed' if replayed else ''} over "
                                        f"the threshold {thresholds[spec]:.3g}")
    statuses = set(record.spec_status.values())
    if record.spec_status:
        record.status = BUG if BUG in statuses else REFUSED if REFUSED in statuses else SUPPORTED
        reasons = [record.spec_reason[s] for s in record.spec_status if s in record.spec_reason]
        record.reason = "; ".join(dict.fromkeys(reasons))
    return record


def _worker(files: List[str], prefill: int, decode: int, specs) -> None:
    """Check `files` in turn, printing a JSON line per stage and per record (see `checked_apart`)."""
    for name in files:
        def stage(text, name=name):
            print(json.dumps({"file": name, "stage": text}), flush=True)

        record = check_file(name, prefill, decode, specs, stage=stage)
        print(json.dumps({"record": dataclasses.asdict(record)}), flush=True)


def checked_apart(files: List[str], prefill: int, decode: int, specs) -> List[Record]:
    """`check_file` of each file in a worker process, so that a file that kills its process (a native crash
    of a model or a cache) is recorded as such; the next worker goes on with the files after it."""
    import subprocess
    import sys

    records: Dict[str, Record] = {}
    pending = list(files)
    while pending:
        command = [sys.executable, "-m", "veloxquant_mlx.evaluation.models_matrix", "--worker",
                   str(prefill), str(decode), ",".join(specs), *pending]
        child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        last = None
        for line in child.stdout:
            if not line.startswith("{"):
                continue
            message = json.loads(line)
            if "record" in message:
                record = Record(**message["record"])
                records[record.file] = record
                last = None
                yield record
            else:
                last = message
        code = child.wait()
        done = [f for f in pending if f in records]
        pending = [f for f in pending if f not in records]
        if pending and last is not None:
            crashed = Record(file=last["file"])
            where = last["stage"]
            crashed.reason = f"{where}: the process died (exit code {code})"
            if where != "mlx-lm's caches":
                crashed.status = BUG
                crashed.spec_status[where] = BUG
                crashed.spec_reason[where] = crashed.reason
            records[crashed.file] = crashed
            yield crashed
            pending.remove(crashed.file)
        elif pending:
            raise RuntimeError(f"the matrix worker exited with code {code} before checking {pending[0]}")
        del done


def run_matrix(files: Optional[List[str]] = None, prefill: int = 300, decode: int = 20, specs=SPECS,
               thresholds: Optional[Dict[str, float]] = None, k: float = K, progress=None,
               apart: bool = False) -> dict:
    """Every file's record, with thresholds calibrated on the llama family (or the ones given); `apart`: each
    file in a worker process (`checked_apart`)."""
    files = list(files or model_files())
    if thresholds is None:
        thresholds = thresholds_from(check_file(CALIBRATION_FILE, prefill, decode, specs), k)
    checked = (checked_apart(files, prefill, decode, specs) if apart
               else (check_file(name, prefill, decode, specs) for name in files))
    records = []
    for record in checked:
        record = apply_thresholds(record, thresholds)
        records.append(record)
        if progress:
            progress(record)
    return {
        "settings": {"prefill": prefill, "decode": decode, "specs": list(specs), "k": k,
                     "calibration_file": CALIBRATION_FILE, "layers": LAYERS, "heads": HEADS,
                     "kv_heads": KV_HEADS, "default_head_dim": HEAD_DIM, "vocab": VOCAB, "window": WINDOW,
                     "mlx_lm": mlx_lm_version()},
        "thresholds": thresholds,
        "records": [dataclasses.asdict(r) for r in records],
    }


def mlx_lm_version() -> str:
    from mlx_lm import __version__

    return __version__


def counts(result: dict) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for record in result["records"]:
        out[record["status"]] = out.get(record["status"], 0) + 1
    return out


def _number(value, fmt="{:.2g}") -> str:
    return "" if value is None else fmt.format(value)


def _routing_paragraph(records: List[dict]) -> List[str]:
    """The lines on the files whose MoE router the matrix replays (`moe_routing.REPLAYABLE`)."""
    replayed = [r for r in records if r.get("kl_routing_replayed")]
    if not replayed:
        return []
    files = "; ".join(
        f"`{r['file']}`: " + ", ".join(
            f"`{spec}` {r['kl'][spec]:.2g} routing freely ({r['routings_flipped'][spec]} routings flipped), "
            f"{kl:.2g} replayed" for spec, kl in r["kl_routing_replayed"].items()) for r in replayed)
    return ["MoE routing: on a random MoE model a tiny change of the keys can send a token to other experts, a "
            "jump of the model rather than of the cache. For the files whose gate it can replay "
            "(`veloxquant_mlx/evaluation/moe_routing.py`), the matrix also runs each spec with mlx-lm's expert "
            "choices replayed (the weights from the run's own router scores), and that KL decides the status; "
            f"the KL column shows both ({files}).", ""]


def markdown(result: dict) -> str:
    settings, thresholds = result["settings"], result["thresholds"]
    specs = settings["specs"]
    tally = counts(result)
    lines = [
        "# Models: the architecture matrix",
        "",
        f"Every model file of the installed mlx-lm ({settings['mlx_lm']}) that holds a model, run on a tiny random "
        f"model built from its own `ModelArgs` ({settings['layers']}-4 layers, {settings['heads']} query and "
        f"{settings['kv_heads']} KV heads, the family's default head dim where its file states one, else "
        f"{settings['default_head_dim']}, a vocabulary of {settings['vocab']}, sliding windows of at most "
        f"{settings['window']}). {settings['prefill']} random tokens are prefilled, then {settings['decode']} more "
        "are fed one at a time, the same for every cache; the decode steps' logits are compared with those of "
        "mlx-lm's own caches (`model.make_cache()` or `make_prompt_cache`).",
        "",
        "- **supported**: runs, and the mean KL (mlx-lm's caches || VeloxQuant's) of every spec is under its "
        f"threshold: {settings['k']:g} times the llama family's KL at the same settings ("
        + ", ".join(f"`{s}` {thresholds[s]:.3g}" for s in specs) + "). Random weights give peaky logits, so "
        "the KL of a file depends on its logit scale as much as on the cache: the threshold is a regression "
        "bound, not a quality claim. Real-weight quality is measured in the README only for SmolLM2 and Gemma 3.",
        "- **refused**: the library raises `UnsupportedModelError`, which names the reason.",
        "- **bug**: anything else (an error, non-finite logits, a KL over the threshold).",
        "- **unbuilt**: the matrix could not build or run the file's model with mlx-lm's own caches (a config "
        "it cannot derive); says nothing of the library.",
        "",
        "Counts: " + ", ".join(f"{tally.get(s, 0)} {s}" for s in (SUPPORTED, REFUSED, BUG, UNBUILT))
        + f" (of {len(result['records'])} files).",
        "",
        "Bytes: the caches' `nbytes` (allocated) after the last step, VeloxQuant's over mlx-lm's; a layer mlx-lm "
        "keeps in its own cache (linear attention, state) counts on both sides. The random models run in float32, "
        "so mlx-lm's caches hold float32: against an fp16 cache an attention-only model's ratio is twice the one shown. "
        "A hybrid model's state caches are kept as mlx-lm makes them, so its ratio over every layer (\"bytes ratio\": "
        "the memory saved as a share of the whole cache) is above its attention layers' alone (\"attention bytes "
        "ratio\"); the two are equal for a model whose every layer attends.",
        "",
        "Random-init adjustments (`build_model`): norms that scale by `1 + weight` (Gemma families, Nemotron) get "
        "zero weights, so that they scale by 1 as every other family's norms do at init (at their init of ones "
        "they double queries and keys after the QK norms, making attention scores 4 times sharper than in any other "
        "random model and every quantizer's KL many times larger); an attention with scale 1 and a q-norm "
        "(Gemma 4) gets 1/sqrt(head dim) folded into its q-norm weights, as trained weights carry it. "
        "Wrapper files (Gemma 3, Mistral 3, Qwen3-VL, ...) run their language model's file with a derived text "
        "config.",
        "",
        "MLA: a file that caches the latent of absorbed multi-head latent attention (DeepSeek-V3 and V3.2, "
        "Kimi-K2.5, Kimi-VL, Kimi-Linear, GLM-4-MoE-Lite, GLM-MoE-DSA, Mistral 4, Bailing) gets "
        "`CompressedLatentCache` (`veloxquant_mlx/cache/latent.py`): per token, the latent (`kv_lora_rank` wide, "
        "64 here) rotated over its whole width and coded with Lloyd-Max codes at the spec's key bits and one fp16 "
        "scale, and the RoPE part as int8 with one fp16 absmax scale; the spec's sinks, window and centring as for any cache. "
        "Attention runs in mlx-lm's absorbed form on arrays that the cache decodes at each call, one layer at a "
        "time; only the codes stay between calls. mlx-lm's batching (`batch_generate`, the server) merges these "
        "caches into `BatchLatentCache` (`veloxquant_mlx/batch_latent.py`), which returns each sequence's history "
        "decoded into `BatchKVCache`'s padded columns. One format serves every spec, so the `kivi:4` column is that "
        "format at 4 bits without sinks, window or centring. The RoPE part, on the tiny DeepSeek-V3 with `vq4` "
        "(its RoPE part is as wide as its latent here; at DeepSeek-V3's 512 + 64 it is a ninth of a token): "
        "fp16, KL 1.02e-4 at a bytes ratio of 0.352; int8, 1.03e-4 at 0.231; 4-bit rotated Lloyd-Max codes, "
        "1.07e-4 at 0.168: int8 keeps fp16's KL at two thirds of its bytes, and 4-bit codes would save a further "
        "ninth of a real model's token for a KL that real weights may not forgive. **The real-weight quality of the latent caches is unmeasured**: no MLA model's weights are "
        "available here. The sparse-attention files (DeepSeek-V3.2, GLM-MoE-DSA) keep their indexer's keys in "
        "mlx-lm's cache (counted in their bytes); GLM-MoE-DSA runs with `index_topk` 128 (derived, 1: every query "
        "would attend to one token). DeepSeek-V2 and MiniCPM3 cache per-head keys (192 wide) and values (128) "
        "and use the ordinary compressed cache.",
        "",
        "Learned attention sinks (GPT-OSS, MiMo-V2-Flash: one logit per query head in the softmax's denominator) run "
        "on every attention path; GPT-OSS's sliding layers hold compressed rotating caches. A hybrid layer's "
        "`CacheList` (Falcon-H1, Baichuan-M1) has its attention cache compressed and its state cache kept; "
        "MiniMax-M3's sparse layers, whose indexer reads its cached keys, keep theirs. PLaMo 2's attention layers "
        "call MLX's own `mx.fast.scaled_dot_product_attention` on what their cache returns; their module gets an "
        "`mx` whose attention routes a compressed history to its cache (`attention_hook.py`). Gemma 2 (soft-capped "
        "scores), Phi-3-small (block-sparse layers) and PLaMo (keys tiled over its shared heads) compute on the "
        "fetched keys and values themselves: their caches hand back the held tokens decoded, for that call only "
        "(`fetch_decoded`), so they hold only codes between calls, and each step decodes every layer's history "
        "once, one layer at a time. DeepSeek-V4.1 (learned "
        "sinks too) keeps its layers in a cache class of its own file (`LayerCache`: a sliding window rounded to "
        "FP8, pooled key groups and index keys rounded to FP4, read by its own sparse attention). It rounds them "
        "itself, so the library holds exactly those values in MLX's microscaling formats "
        "(`MicroscaledLayerCache`, `veloxquant_mlx/cache/microscaled_layer.py`): 8.25 bits per window value, 4.75 "
        "per group value and 4.25 per index-key value, against the model's float type; its logits are mlx-lm's "
        "bit for bit, whatever the spec, and a warning says that the spec's codes are not used.",
        "",
        *_routing_paragraph(result["records"]),
        "Generated by `veloxquant models` (`veloxquant_mlx/evaluation/models_matrix.py`); the JSON is in "
        "`benchmarks/results/models-matrix/`. `tests/test_models_matrix.py` fails if a supported file regresses.",
        "",
        "| file | arch | caches | status | " + " | ".join(f"KL {s}" for s in specs)
        + " | max abs dlogit | bytes ratio | attention bytes ratio | reason |",
        "|---|---|---|---|" + "---|" * len(specs) + "---|---|---|---|",
    ]
    for r in result["records"]:
        replayed = r.get("kl_routing_replayed") or {}
        kls = [_number(r["kl"].get(s)) + (f" ({_number(replayed[s])} replayed)" if s in replayed else "")
               for s in specs]
        worst = "/".join(_number(r["max_dlogit"].get(s), "{:.2f}") for s in specs if s in r["max_dlogit"])
        ratio = "/".join(_number(r["bytes_ratio"].get(s), "{:.2f}") for s in specs if s in r["bytes_ratio"])
        attention = r.get("attention_bytes_ratio") or {}
        attention_ratio = "/".join(_number(attention.get(s), "{:.2f}") for s in specs if s in attention)
        reason = r["reason"].replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r['file']} | {r['arch']} | {r['caches']} | {r['status']} | " + " | ".join(kls)
                     + f" | {worst} | {ratio} | {attention_ratio} | {reason} |")
    lines.append("")
    return "\n".join(lines)


def write_outputs(result: dict, docs_path: str, results_dir: str) -> None:
    os.makedirs(results_dir, exist_ok=True)
    with open(os.path.join(results_dir, "matrix.json"), "w") as handle:
        json.dump(result, handle, indent=1, sort_keys=False)
        handle.write("\n")
    os.makedirs(os.path.dirname(docs_path) or ".", exist_ok=True)
    with open(docs_path, "w") as handle:
        handle.write(markdown(result))


def run_models_command(args) -> dict:
    from ..outputs import check_out_file, check_results_dir

    files = args.files or None
    if files is None or args.render or args.update:  # where the outputs go, before the long run
        check_results_dir(args.out)
        check_out_file(args.docs, force=True, what="--docs")  # the table is meant to be written again
    done = []

    def progress(record: Record):
        done.append(record)
        print(f"{record.file:28s} {record.status:9s} {record.seconds:5.1f} s  {record.reason[:100]}", flush=True)

    if args.render or args.update:
        with open(os.path.join(args.out, "matrix.json")) as handle:
            result = json.load(handle)
        if args.update and files:
            settings = result["settings"]
            fresh = run_matrix(files, settings["prefill"], settings["decode"], tuple(settings["specs"]),
                               thresholds=result["thresholds"], progress=progress, apart=True)
            by_file = {r["file"]: r for r in fresh["records"]}
            result["records"] = [by_file.get(r["file"], r) for r in result["records"]]
        write_outputs(result, args.docs, args.out)
        return {}
    result = run_matrix(files, prefill=args.prefill, decode=args.decode, k=args.k, progress=progress, apart=True)
    if files is None:
        write_outputs(result, args.docs, args.out)
    else:
        print(json.dumps(counts(result)))
    return {}


def register_cli(subparsers) -> None:
    models = subparsers.add_parser("models", help="the architecture matrix: every mlx-lm model file on a tiny "
                                                  "random model, with mlx-lm's caches and VeloxQuant's")
    models.add_argument("files", nargs="*", help="model files to check (default: all; only then are outputs written)")
    models.add_argument("--prefill", type=int, default=300, help="prompt tokens (default: 300)")
    models.add_argument("--decode", type=int, default=20, help="decode steps compared (default: 20)")
    models.add_argument("--k", type=float, default=K, help=f"threshold: k times llama's KL (default: {K:g})")
    models.add_argument("--docs", default="docs/models.md", help="table to write (default: docs/models.md)")
    models.add_argument("--out", default="benchmarks/results/models-matrix",
                        help="JSON folder (default: benchmarks/results/models-matrix)")
    models.add_argument("--update", action="store_true",
                        help="check only the files given, with the thresholds of the JSON in --out, and replace "
                             "their rows there (default: off)")
    models.add_argument("--render", action="store_true",
                        help="only write the table again from the JSON in --out (default: off)")
    models.set_defaults(func=run_models_command)


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--worker"]:
        _worker(sys.argv[5:], int(sys.argv[2]), int(sys.argv[3]), tuple(sys.argv[4].split(",")))
