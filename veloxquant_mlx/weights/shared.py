"""One input rotation for the linear layers that read the same input.

In a llama-style block the attention's q/k/v projections all read input_layernorm(x)
and the MLP's gate/up projections all read the MLP's norm output. Each
`QuantizedLinear` computes R (c * x) from its input (`linear.py`); if the layers of
one input share R and c, that is one computation, and since an RMSNorm ends in a
per-channel multiply by its weight g, c and the first stage's signs s fold into it:

    R (c * rms_norm(x, g)) = R' (rms_norm(x, g * c * s))

with R' = R without its first sign multiply (`StructuredRotation.apply_signed`). For
a dimension `mx.hadamard_transform` supports, R' is that one transform, so the input
of q/k/v (or of gate/up) costs the norm and one FWHT: on a GPU back end one launch of
`rotation_kernel` for both (decode-sized batches), else two MLX ops. `RotatingRMSNorm` replaces the
norm and outputs the rotated activation; the layers it feeds take it as it is
(`QuantizedLinear(input_rotated=True)`). Keys and values are unchanged: the rotation
is undone inside the projections' matmuls, not after them.

The shared c is computed from the layers together: c = (rms / mean rms)^alpha as for one
layer (`linear.column_scales`), with the column RMS taken over the rows of all of them
stacked. One c cannot fit layers whose column profiles differ (q/k against v, in
SmolLM2), so this costs quality against per-layer scales: docs/methods.md has the numbers.

Blocks are recognised by the mlx-lm module that defines them (the table below says
which norm feeds which layers there); other models keep one rotation per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn

from .rotation import StructuredRotation

# mlx-lm module of a transformer block -> (the norm whose output is the attention input,
# the norm whose output is the MLP input). In these modules the block calls
# self_attn(input_norm(x)) and mlp(mlp_norm(h)), and nothing else reads those outputs.
BLOCKS: Dict[str, Tuple[str, str]] = {
    "mlx_lm.models.llama": ("input_layernorm", "post_attention_layernorm"),
    "mlx_lm.models.qwen2": ("input_layernorm", "post_attention_layernorm"),
    "mlx_lm.models.qwen3": ("input_layernorm", "post_attention_layernorm"),
    "mlx_lm.models.gemma3_text": ("input_layernorm", "pre_feedforward_layernorm"),
}
# Column-scaling exponent of a shared group (`quantize_model(shared_alpha=)`); see shared_input_scales.
SHARED_ALPHA = 0.5
ATTENTION_INPUTS = ("q_proj", "k_proj", "v_proj")
MLP_INPUTS = ("gate_proj", "up_proj")


@dataclass(frozen=True)
class SharedInput:
    """A norm and the linear layers that read its output (paths in the model)."""
    norm: str
    layers: Tuple[str, ...]
    offset: float  # the norm computes rms_norm(x, offset + weight): 0 (nn.RMSNorm) or 1 (Gemma)


def _norm_offset(norm) -> Optional[float]:
    """offset of a norm computing rms_norm(x, offset + weight), None if not such a norm."""
    if isinstance(norm, nn.RMSNorm):
        return 0.0
    if type(norm).__name__ == "RMSNorm" and type(norm).__module__ == "mlx_lm.models.gemma3_text":
        return 1.0
    return None


def transformer_blocks(model: nn.Module):
    """(path, module) of every transformer block: a module with `self_attn` and `mlp` children."""
    return [(path, module) for path, module in model.named_modules()
            if isinstance(module, nn.Module) and "self_attn" in module and "mlp" in module]


def find_shared_inputs(model: nn.Module) -> Tuple[List[SharedInput], List[str]]:
    """(the shared inputs of every recognised block, the paths of blocks not recognised);
    blocks as `transformer_blocks` finds them."""
    found, unrecognised = [], []
    for path, module in transformer_blocks(model):
        names = BLOCKS.get(type(module).__module__)
        if names is None:
            unrecognised.append(f"{path} ({type(module).__module__}.{type(module).__name__})")
            continue
        for norm_name, owner, layer_names in ((names[0], "self_attn", ATTENTION_INPUTS),
                                              (names[1], "mlp", MLP_INPUTS)):
            norm, parent = module.get(norm_name), module[owner]
            offset = None if norm is None else _norm_offset(norm)
            if offset is None or not all(name in parent for name in layer_names):
                unrecognised.append(f"{path}.{norm_name}")
                continue
            found.append(SharedInput(f"{path}.{norm_name}", tuple(f"{path}.{owner}.{n}" for n in layer_names),
                                     offset))
    return found, unrecognised


def shared_input_scales(weights: Sequence[mx.array], alpha: float) -> Optional[mx.array]:
    """c for layers reading one input: `linear.column_scales` of their weights stacked (the
    column RMS over every row of every layer), fp16; None when alpha is 0."""
    if not alpha:
        return None
    squares = None
    rows = 0
    for weight in weights:
        w = weight.astype(mx.float32)
        column = (w * w).sum(axis=0)
        squares = column if squares is None else squares + column
        rows += w.shape[0]
        mx.eval(squares)
    rms = mx.sqrt(squares / rows)
    return mx.power(mx.maximum(rms, 1e-8) / mx.maximum(rms.mean(), 1e-8), alpha).astype(mx.float16)


class RotatingRMSNorm(nn.Module):
    """An RMSNorm whose output is R (c * rms_norm(x, offset + weight)), the rotated input of
    the layers after it: rms_norm with the folded weight (offset + weight) * c * s, then the
    rest of R (module doc). `weight` is the norm's own, unchanged (the model's fingerprint
    reads it); `folded_weight` is what runs."""

    def __init__(self, weight: mx.array, eps: float, rotation: StructuredRotation,
                 input_scales: Optional[mx.array], offset: float = 0.0, folded_weight: Optional[mx.array] = None):
        super().__init__()
        if weight.shape != (rotation.dim,):
            raise ValueError(f"norm weight of shape {weight.shape} for a rotation of dim {rotation.dim}")
        self.weight = weight
        self.eps = float(eps)
        self.offset = float(offset)
        self.rotation_signs = rotation.signs
        if rotation.perms is not None:
            self.rotation_perms = rotation.perms
        self._rotation = rotation
        if input_scales is not None:
            self.input_scales = input_scales
        if folded_weight is None:
            folded = (self.offset + weight).astype(mx.float32) * rotation.signs[0]
            if input_scales is not None:
                folded = folded * input_scales.astype(mx.float32)
            folded_weight = folded.astype(weight.dtype)
        self.folded_weight = folded_weight
        self.freeze()

    @property
    def rotation(self) -> StructuredRotation:
        return self._rotation

    @property
    def column_scales(self) -> Optional[mx.array]:
        return self.get("input_scales")

    def storage_nbytes(self) -> int:
        """Bytes added to the model: the rotation, the column scales and the folded weight."""
        arrays = list(self.rotation.state().values()) + [self.folded_weight]
        if "input_scales" in self:
            arrays.append(self.input_scales)
        return sum(a.nbytes for a in arrays)

    def __call__(self, x: mx.array) -> mx.array:
        routes = self.__dict__.setdefault("_routes", {})
        run = routes.get((x.shape, x.dtype))
        if run is None:
            run = self._route_for(x)
        return run(x, self["folded_weight"])

    def _route_for(self, x: mx.array):
        """(x, folded weight) -> the rotated input, for inputs of x's shape and dtype: on a GPU
        back end for decode-sized batches the norm and the transform in one `rotation_kernel`
        launch (kept per shape, like `QuantizedLinear`'s routes), else mx.fast.rms_norm and
        the rest of R as MLX ops."""
        from . import kernel, rotation_kernel

        decode = x.size // x.shape[-1] <= kernel.MAX_ROWS  # decode shapes are kept; prefill ones vary
        run = rotation_kernel.route(x, self._rotation, self["folded_weight"], eps=self.eps)
        if run is None:
            rotation, eps = self._rotation, self.eps

            def run(x: mx.array, weight: mx.array) -> mx.array:
                return rotation.apply_signed(mx.fast.rms_norm(x, weight, eps))
            if decode:
                run = kernel.compiled(run)
        if decode:
            self._routes[(x.shape, x.dtype)] = run
        return run

    def _extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, offset={self.offset}, blocks={self.rotation.blocks}"


def share_input_rotations(model: nn.Module, groups: Sequence[SharedInput]) -> nn.Module:
    """Replace each group's norm with a `RotatingRMSNorm` and its layers with their
    `input_rotated` form, in place. The layers must be `QuantizedLinear`s built with one
    rotation object and one input-scale array per group (`quantize_model` does that)."""
    from mlx.utils import tree_unflatten

    from .linear import QuantizedLinear

    modules = dict(model.named_modules())
    swaps = []
    for group in groups:
        layers = [modules[p] for p in group.layers]
        first = layers[0]
        if not all(isinstance(layer, QuantizedLinear) and not layer.input_rotated for layer in layers):
            raise ValueError(f"{group.norm}: the layers {group.layers} are not all quantized with their own rotation")
        if any(layer.rotation is not first.rotation or layer.column_scales is not first.column_scales
               for layer in layers):
            raise ValueError(f"{group.norm}: the layers {group.layers} do not share one rotation and input scale")
        norm = modules[group.norm]
        swaps.append((group.norm, RotatingRMSNorm(norm.weight, norm.eps, first.rotation, first.column_scales,
                                                  group.offset)))
        swaps += [(path, layer.with_rotated_input()) for path, layer in zip(group.layers, layers)]
    model.update_modules(tree_unflatten(swaps))
    return model


def rotating_norms(model: nn.Module) -> List[Tuple[str, RotatingRMSNorm]]:
    return [(path, m) for path, m in model.named_modules() if isinstance(m, RotatingRMSNorm)]
