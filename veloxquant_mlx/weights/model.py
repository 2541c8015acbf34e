"""`quantize_model`: swap a model's linear layers for `QuantizedLinear` (or `GroupAffineLinear`), one at a time."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import warnings
import zlib
from typing import Dict, Iterable, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from .affine import GroupAffineLinear
from .embedding import QuantizedEmbedding
from .linear import QuantizedLinear
from .rotation import StructuredRotation
from .shared import (SHARED_ALPHA, RotatingRMSNorm, SharedInput, find_shared_inputs, share_input_rotations,
                     shared_input_scales)


def _linear_shape(module) -> Optional[Tuple[int, int]]:
    """(out, in) of a float or MLX-quantized linear layer, of a QuantizedLinear, else None
    (embeddings, quantized or not, are not linear layers here)."""
    if isinstance(module, QuantizedEmbedding):
        return None
    if isinstance(module, (QuantizedLinear, GroupAffineLinear)):
        return module.out_features, module.in_features
    if isinstance(module, nn.QuantizedLinear):
        return module.weight.shape[0], module.weight.shape[1] * 32 // module.bits
    if isinstance(module, nn.Linear):
        return tuple(module.weight.shape)
    return None


def _float_weight(module) -> mx.array:
    if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        return mx.dequantize(module.weight, module.scales, module.get("biases"), module.group_size,
                             module.bits, mode=getattr(module, "mode", "affine"))
    return module.weight


def _skipped(path: str, skip: Iterable[str]) -> bool:
    return any(fnmatch.fnmatch(path, pattern) or pattern in path.split(".") or path.startswith(pattern + ".")
               or path == pattern for pattern in skip)


def linear_paths(model: nn.Module, skip: Iterable[str] = ()) -> List[str]:
    """Paths of the linear layers quantize_model would replace (already-quantized ones excluded)."""
    return [path for path, module in model.named_modules()
            if isinstance(module, (nn.Linear, nn.QuantizedLinear))
            and not isinstance(module, (QuantizedLinear, GroupAffineLinear)) and not _skipped(path, skip)]


def embedding_paths(model: nn.Module, skip: Iterable[str] = ()) -> List[str]:
    """Paths of the embedding tables quantize_model(embeddings=True) would replace."""
    return [path for path, module in model.named_modules()
            if isinstance(module, (nn.Embedding, nn.QuantizedEmbedding)) and not _skipped(path, skip)]


def quantized_layers(model: nn.Module) -> List[Tuple[str, QuantizedLinear]]:
    return [(path, m) for path, m in model.named_modules() if isinstance(m, QuantizedLinear)]


def layer_seed(seed: int, path: str) -> int:
    """Each layer's rotation seed: the model seed and a stable hash of its path."""
    return (int(seed) * 1_000_003 + zlib.crc32(path.encode())) % (1 << 63)


def quantize_model(model: nn.Module, bits: int, seed: int = 0, skip: Iterable[str] = (), *,
                   group_size: Optional[int] = None, stages: int = 2, column_alpha: float = 0.5,
                   embeddings: bool = False, calibration: Optional[mx.array] = None,
                   share_rotations: bool = False, shared_alpha: Optional[float] = None,
                   progress: bool = True, format: str = "rotated", scale_bits: Optional[int] = None,
                   center_bits: Optional[int] = None) -> nn.Module:
    """Replace every linear layer of `model` (but those matching `skip`: a name such as
    "lm_head", a dotted path or an fnmatch pattern) with a `QuantizedLinear`, in place.

    Layers are quantised one at a time and each float weight is dropped from the model
    as soon as its codes exist, so peak memory stays near the model's size plus one
    layer's working set. With `embeddings=True` the embedding tables become
    `QuantizedEmbedding`s with the same codec (a tied output layer goes with them:
    it calls the table's `as_linear`); otherwise they are left as they are.

    `calibration` (batch, tokens) token ids selects data-aware GPTQ codes (`gptq.py`): the
    model runs once on them and each linear layer is quantized when its inputs arrive,
    on those inputs (embedding tables are coded without data).

    `share_rotations` (off by default: it costs quality, docs/methods.md): where the block structure is recognised (`shared.BLOCKS`:
    llama, qwen2, qwen3, gemma3), the layers reading one norm's output (q/k/v; gate/up)
    share one rotation and one input scale, folded into that norm (`shared.py`); a warning
    names the blocks where this is not done. `shared_alpha` is the column-scaling exponent of
    those groups (default `shared.SHARED_ALPHA`; `column_alpha` for the other layers).

    `format="group_affine"` makes `affine.GroupAffineLinear` layers instead: per-group min-max
    affine codes (groups of `group_size`, default 32) with their scales and centres coded at
    `scale_bits` and `center_bits` bits; data-free, linear layers only, no rotation (seed,
    stages, column_alpha, share_rotations do not apply to it). Returns `model`.
    """
    from tqdm.auto import tqdm

    skip = tuple(skip)
    if format == "group_affine":
        if calibration is not None or embeddings or share_rotations:
            raise ValueError("format='group_affine' is data-free and for linear layers only: "
                             "calibration, embeddings and share_rotations are not supported with it")
        return _quantize_group_affine(model, bits, linear_paths(model, skip), group_size, scale_bits, center_bits,
                                      progress)
    if format != "rotated":
        raise ValueError(f"format must be 'rotated' or 'group_affine', got {format!r}")
    if scale_bits is not None or center_bits is not None:
        raise ValueError("scale_bits and center_bits belong to format='group_affine'")
    paths = linear_paths(model, skip)
    tables = set(embedding_paths(model, skip)) if embeddings else set()
    paths += sorted(tables)
    groups = shared_groups(model, paths) if share_rotations else []
    alpha = SHARED_ALPHA if shared_alpha is None else shared_alpha
    inputs = _shared_settings(model, groups, seed, stages, alpha)
    if calibration is not None:
        _quantize_calibrated(model, bits, seed, paths, sorted(tables), calibration, group_size=group_size,
                             stages=stages, column_alpha=column_alpha, progress=progress, inputs=inputs)
        return link_decode_paths(share_input_rotations(model, groups))
    modules = dict(model.named_modules())
    for path in tqdm(paths, desc=f"quantizing to {bits} bits", unit="layer", disable=not progress):
        module = modules.pop(path)
        if path in tables:
            layer = QuantizedEmbedding.from_embedding(_float_weight(module), bits, seed=layer_seed(seed, path),
                                                      group_size=group_size, stages=stages,
                                                      column_alpha=column_alpha)
        else:
            layer = QuantizedLinear.from_weight(_float_weight(module), bits, seed=layer_seed(seed, path),
                                                group_size=group_size, stages=stages, bias=module.get("bias"),
                                                **{"column_alpha": column_alpha, **inputs.get(path, {})})
        model.update_modules(tree_unflatten([(path, layer)]))
        del module
    return link_decode_paths(share_input_rotations(model, groups))


def link_decode_paths(model: nn.Module) -> nn.Module:
    """`model` with the sibling layers of each recognised block sharing one launch (`siblings.py`),
    its MLPs compiled at decode shapes (`compiled_mlp.py`), and the halves of its llama, qwen2 and
    Gemma 3 blocks around the attention compiled at decode shapes (`compiled_block.py`)."""
    from .compiled_block import compile_blocks
    from .compiled_mlp import compile_mlps
    from .siblings import link_siblings

    link_siblings(model)
    compile_mlps(model)
    compile_blocks(model)
    return model


def _quantize_group_affine(model, bits, paths, group_size, scale_bits, center_bits, progress) -> nn.Module:
    from tqdm.auto import tqdm

    from .affine import DEFAULT_CENTER_BITS, DEFAULT_GROUP_SIZE, DEFAULT_SCALE_BITS

    settings = {"group_size": group_size or DEFAULT_GROUP_SIZE,
                "scale_bits": DEFAULT_SCALE_BITS if scale_bits is None else scale_bits,
                "center_bits": DEFAULT_CENTER_BITS if center_bits is None else center_bits}
    modules = dict(model.named_modules())
    for path in tqdm(paths, desc=f"quantizing to {bits} bits (group affine)", unit="layer", disable=not progress):
        module = modules.pop(path)
        layer = GroupAffineLinear.from_weight(_float_weight(module), bits, bias=module.get("bias"), **settings)
        model.update_modules(tree_unflatten([(path, layer)]))
        del module
    return model


def shared_groups(model: nn.Module, paths: Iterable[str]) -> List[SharedInput]:
    """The shared inputs (`shared.find_shared_inputs`) whose layers are all about to be
    quantized; warns about blocks not recognised and groups left per-layer by `skip`."""
    paths = set(paths)
    found, unrecognised = find_shared_inputs(model)
    groups = [g for g in found if all(p in paths for p in g.layers)]
    partial = [g.norm for g in found if g not in groups and any(p in paths for p in g.layers)]
    if unrecognised:
        warnings.warn(f"shared input rotations: block structure not recognised at {_listing(unrecognised)}; "
                      "those layers rotate their own inputs (slower decode)", RuntimeWarning, stacklevel=3)
    if partial:
        warnings.warn(f"shared input rotations: not all layers after {_listing(partial)} are quantized (skip); "
                      "those layers rotate their own inputs", RuntimeWarning, stacklevel=3)
    if not groups and not unrecognised and not partial and paths:
        warnings.warn("shared input rotations: no transformer block found (modules with self_attn and mlp); "
                      "every layer rotates its own input", RuntimeWarning, stacklevel=3)
    return groups


def _listing(items: List[str], shown: int = 3) -> str:
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more


def _shared_settings(model, groups: List[SharedInput], seed: int, stages: int,
                     column_alpha: float) -> Dict[str, dict]:
    """Per layer path, the rotation and input scales it shares with its group (from_weight kwargs;
    `column_alpha` is the group's, so a layer computes no scales of its own when the group has
    none). The rotation is seeded from the norm's path."""
    modules = dict(model.named_modules())
    settings = {}
    for group in groups:
        dim = _linear_shape(modules[group.layers[0]])[1]
        rotation = StructuredRotation.seeded(dim, layer_seed(seed, group.norm), stages)
        scales = shared_input_scales([_float_weight(modules[p]) for p in group.layers], column_alpha)
        for path in group.layers:
            settings[path] = {"rotation": rotation, "input_scales": scales, "column_alpha": column_alpha}
    return settings


def _quantize_calibrated(model, bits, seed, paths, tables, calibration, *, group_size, stages, column_alpha,
                         progress, inputs) -> nn.Module:
    from tqdm.auto import tqdm

    from .gptq import CalibratingLinear

    if calibration.ndim != 2 or calibration.size == 0:
        raise ValueError(f"calibration must be (batch, tokens) token ids, got shape {calibration.shape}")
    shared_inputs = inputs
    modules = dict(model.named_modules())
    for path in tables:  # data-free, before the pass, so that the layers see the quantized table
        table = QuantizedEmbedding.from_embedding(_float_weight(modules.pop(path)), bits,
                                                  seed=layer_seed(seed, path), group_size=group_size,
                                                  stages=stages, column_alpha=column_alpha)
        model.update_modules(tree_unflatten([(path, table)]))
    linear = [p for p in paths if p not in tables]
    bar = tqdm(total=len(linear), desc=f"quantizing to {bits} bits (GPTQ)", unit="layer", disable=not progress)

    def maker(path, module):
        def make(inputs):
            layer = QuantizedLinear.from_weight(_float_weight(module), bits, seed=layer_seed(seed, path),
                                                group_size=group_size, stages=stages, bias=module.get("bias"),
                                                calibration_inputs=inputs,
                                                **{"column_alpha": column_alpha, **shared_inputs.get(path, {})})
            bar.update(1)
            return layer
        return make

    stand_ins = [(path, CalibratingLinear(maker(path, modules.pop(path)))) for path in linear]
    model.update_modules(tree_unflatten(stand_ins))
    mx.eval(model(calibration))
    bar.close()
    idle = [path for path, s in stand_ins if s.quantized is None]
    if idle:
        raise ValueError(f"layers {idle[:3]} received no calibration input (not used by the forward pass?)")
    model.update_modules(tree_unflatten([(path, s.quantized) for path, s in stand_ins]))
    return model


def fingerprint(model: nn.Module) -> str:
    """What a reservoir must match: the path and (out, in) shape of every linear layer
    (float, MLX-quantized or ours alike) and the values of the 1-D norm weights, which
    no quantizer changes (a `RotatingRMSNorm` keeps the norm's own weight beside the folded
    one) and which tell two fine-tunes of one architecture apart."""
    h = hashlib.sha256()
    linear, rotating = [], set()
    for path, module in model.named_modules():
        shape = _linear_shape(module)
        if shape is not None:
            linear.append([path, list(shape), "bias" in module])
        if isinstance(module, RotatingRMSNorm):
            rotating.add(path)
    h.update(json.dumps(sorted(linear)).encode())
    linear_paths_set = {p for p, _, _ in linear}
    for name, value in sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0]):
        owner, leaf = name.rsplit(".", 1)
        if owner in rotating and leaf != "weight":  # what sharing a rotation added to a norm
            continue
        if value.ndim == 1 and "norm" in name and owner not in linear_paths_set:
            h.update(name.encode())
            h.update(bytes(memoryview(value.astype(mx.float16))))
    return h.hexdigest()
