"""The two halves of each transformer block around its attention as compiled calls at decode shapes.

A decode step's graph is built in Python while the GPU runs the previous step; ours is
host-bound (docs/methods.md, "Each block's halves as compiled calls"). With the MLP compiled
(`compiled_mlp.py`), a block still makes about fifteen Python-level calls around its
attention: the norm, q/k/v, their reshapes and transposes, the output's transpose and
reshape, o_proj, the residual adds and the MLP's norm. At decode shapes the block's class is
swapped for a subclass whose call runs, as mlx-lm's `Attention` and `TransformerBlock` do
(llama's here; `HALVES` has each architecture's):

    q, k, v = before(x, offset)          compiled: norm, projections, split into heads, rotary
                                         embedding (the offset an array input, so that one trace
                                         serves every position)
    cache update, attention              mlx-lm's own calls, outside: the cache is Python state
    out = after(attention output, x)     compiled: heads merged, o_proj, residual, norm, MLP, residual

A rotary embedding that cannot take an array offset stays outside too. The attention
function is looked up in the block's module at each call, so a compressed cache's hook
(`integration.install_attention_hook`) is honoured. Only the blocks of the architectures in
`HALVES` (llama, qwen2, gemma3_text) take it; other blocks keep their own call. As for the
MLPs: the class keeps its name and parameters, the first call of each input shape runs
uncompiled (it makes the layers' routes and runs their first-use checks), and prefill shapes
stay uncompiled. Unlike them, the parameters enter the traces as constants, so that a call
passes only its activations (`mx.compile` flattens every input tree at every call); each call
first checks that every parameter is still the array its trace holds, and traces again if
one was replaced (`model.update`).
"""

from __future__ import annotations

import sys
from functools import lru_cache

import mlx.core as mx
import mlx.nn as nn

from . import kernel
from .compiled_mlp import with_call
from .linear import MAX_KERNEL_ROWS
from .shared import transformer_blocks

# Benchmarks compare against it off; `VELOXQUANT_WEIGHT_COMPILE=0` (kernel.COMPILE_ROUTES) turns it
# off with every other compiled route. Read at each new input shape.
COMPILE_BLOCKS = True


def compile_blocks(model: nn.Module) -> int:
    """Make every block of an architecture in `HALVES` a `compiled_class` one; returns how many.
    Again on a model already done, it forgets the traced forms (the layers may have been replaced)."""
    count = 0
    for _, block in transformer_blocks(model):
        base = getattr(type(block), "uncompiled_class", type(block))
        if base.__module__ in HALVES and base.__name__ == "TransformerBlock":
            block.__class__ = compiled_class(base)
            block.__dict__["_decode_halves"] = {}
            count += 1
    return count


def _parameter_leaves(tree, out: list) -> list:
    """(container, key, array) of every array in a tree of modules, dicts and lists."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    for key, value in items:
        if isinstance(value, mx.array):
            out.append((tree, key, value))
        elif isinstance(value, (dict, list, tuple)):
            _parameter_leaves(value, out)
    return out


# mlx-lm's rotary embeddings that hand `offset` to mx.fast.rope unchanged, so that it may be an array
# (an input of the compiled half, so one trace serves every position); DynamicNTKScalingRoPE does
# arithmetic on it and stays outside.
ROPES_TAKING_ARRAY_OFFSETS = ("RoPE", "Llama3RoPE", "YarnRoPE", "SuScaledRoPE", "ProportionalRoPE")
_OFFSETS: dict = {}  # the cache offset of the step -> it as an array, made once for every layer


def _offset_array(offset) -> mx.array:
    if isinstance(offset, mx.array):
        return offset
    array = _OFFSETS.get(offset)
    if array is None:
        if len(_OFFSETS) > 16:
            _OFFSETS.clear()
        array = _OFFSETS[offset] = mx.array(offset, dtype=mx.int32)
    return array


def _attention_inputs(block, x, offset, head_norms=None):
    """q, k, v of the block's normed input, split into heads (batch, heads, tokens, head dim) as
    mlx-lm's attentions do, q and k then normed per head (`head_norms`, Gemma's) and, with an
    offset, given the rotary embedding."""
    attn = block.self_attn
    b, n, _ = x.shape
    h = block.input_layernorm(x)
    q = attn.q_proj(h).reshape(b, n, attn.n_heads, -1).transpose(0, 2, 1, 3)
    k = attn.k_proj(h).reshape(b, n, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    v = attn.v_proj(h).reshape(b, n, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    if head_norms is not None:
        q, k = head_norms[0](q), head_norms[1](k)
    if offset is not None:
        q, k = attn.rope(q, offset=offset), attn.rope(k, offset=offset)
    return q, k, v


def _merged(attended, x):
    b, n, _ = x.shape
    return attended.transpose(0, 2, 1, 3).reshape(b, n, -1)


def _llama_halves(block, module, mlp_call):
    """mlx-lm's llama and qwen2 blocks: attention(norm(x)) + x, then mlp(norm(h)) + h."""
    attn = block.self_attn

    def before(x, offset):
        return _attention_inputs(block, x, offset)

    def after(attended, x):
        h = x + attn.o_proj(_merged(attended, x))
        return h + mlp_call(block.mlp, block.post_attention_layernorm(h))

    return before, after


def _gemma3_halves(block, module, mlp_call):
    """mlx-lm's gemma3_text block: q and k normed per head before the rotary embedding, and a norm
    on each branch's output before its clipped residual."""
    attn, clip_residual = block.self_attn, module.clip_residual

    def before(x, offset):
        return _attention_inputs(block, x, offset, head_norms=(attn.q_norm, attn.k_norm))

    def after(attended, x):
        h = clip_residual(x, block.post_attention_layernorm(attn.o_proj(_merged(attended, x))))
        r = mlp_call(block.mlp, block.pre_feedforward_layernorm(h))
        return clip_residual(h, block.post_feedforward_layernorm(r))

    return before, after


# mlx-lm module of a TransformerBlock -> its halves around the attention, computing exactly what its
# block and attention calls compute. Every one's middle is the same: rotary embedding (unless inside
# `before`), `cache.update_and_fetch`, the module's scaled_dot_product_attention.
HALVES = {
    "mlx_lm.models.llama": _llama_halves,
    "mlx_lm.models.qwen2": _llama_halves,
    "mlx_lm.models.gemma3_text": _gemma3_halves,
}


class Halves:
    """The compiled halves of one block at one input shape, with the parameters their traces
    hold as constants (`current`: whether each is still the block's)."""

    def __init__(self, block: nn.Module, base: type):
        mlp_call = getattr(type(block.mlp), "uncompiled_class", type(block.mlp)).__call__
        before, after = HALVES[base.__module__](block, sys.modules[base.__module__], mlp_call)
        self.rope_inside = type(block.self_attn.rope).__name__ in ROPES_TAKING_ARRAY_OFFSETS
        self.before = mx.compile(before if self.rope_inside else lambda x: before(x, None))
        self.after = mx.compile(after)
        self.leaves = _parameter_leaves(block, [])

    def current(self) -> bool:
        for container, key, array in self.leaves:
            if container[key] is not array:
                return False
        return True


@lru_cache(maxsize=None)
def compiled_class(base: type) -> type:
    """The subclass of a block class whose decode-shaped calls with a cache run compiled halves."""

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        if cache is None:
            return base.__call__(self, x, mask, cache)
        halves = self._decode_halves.get((x.shape, x.dtype))
        if halves is None or not halves.current():
            y = base.__call__(self, x, mask, cache)
            if x.size // x.shape[-1] <= MAX_KERNEL_ROWS and COMPILE_BLOCKS and kernel.COMPILE_ROUTES:
                # evaluated, the arrays the traces keep as constants hold no graph
                mx.eval(y)
                self._decode_halves[(x.shape, x.dtype)] = Halves(self, base)
            return y
        attn = self.self_attn
        if halves.rope_inside:
            queries, keys, values = halves.before(x, _offset_array(cache.offset))
        else:
            queries, keys, values = halves.before(x)
            queries = attn.rope(queries, offset=cache.offset)
            keys = attn.rope(keys, offset=cache.offset)
        keys, values = cache.update_and_fetch(keys, values)
        attention = sys.modules[base.__module__].scaled_dot_product_attention
        attended = attention(queries, keys, values, cache=cache, scale=attn.scale, mask=mask)
        return halves.after(attended, x)

    return with_call(base, __call__)
