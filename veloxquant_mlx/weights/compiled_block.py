"""The two halves of each llama-family block around its attention as compiled calls at decode shapes.

A decode step's graph is built in Python while the GPU runs the previous step; ours is
host-bound (docs/weights.md, "Each block's halves as compiled calls"). With the MLP compiled
(`compiled_mlp.py`), a block still makes about fifteen Python-level calls around its
attention: the norm, q/k/v, their reshapes and transposes, the output's transpose and
reshape, o_proj, the residual adds and the MLP's norm. At decode shapes the block's class is
swapped for a subclass whose call runs, as mlx-lm's `Attention` and `TransformerBlock` do:

    q, k, v = before(x)                  compiled: norm, projections, split into heads
    rotary embedding, cache update, attention
                                         mlx-lm's own calls, outside: they read the cache's
                                         Python offset, which would retrace every step
    out = after(attention output, x)     compiled: heads merged, o_proj, residual, norm, MLP, residual

The attention function is looked up in the block's module at each call, so a compressed
cache's hook (`integration.install_attention_hook`) is honoured. Only the blocks of
`BLOCK_MODULES` take it, whose attention is exactly this sequence; other blocks keep
their own call. As for the MLPs: the class keeps its name and parameters, the compiled
halves read the current parameters at every call (`mx.compile(inputs=...)`), the first
call of each input shape runs uncompiled (it makes the layers' routes and runs their first-use
checks), and prefill shapes stay uncompiled.
"""

from __future__ import annotations

import sys
from functools import lru_cache

import mlx.core as mx
import mlx.nn as nn

from . import kernel
from .linear import MAX_KERNEL_ROWS
from .shared import transformer_blocks

# Benchmarks compare against it off; `VELOXQUANT_WEIGHT_COMPILE=0` (kernel.COMPILE_ROUTES) turns it
# off with every other compiled route. Read at each new input shape.
COMPILE_BLOCKS = True
# mlx-lm modules whose TransformerBlock and Attention compute exactly what `_decode` does.
BLOCK_MODULES = ("mlx_lm.models.llama", "mlx_lm.models.qwen2")


def compile_blocks(model: nn.Module) -> int:
    """Make every block of `BLOCK_MODULES` a `compiled_class` one; returns how many. Again on a
    model already done, it forgets the traced forms (the layers may have been replaced)."""
    count = 0
    for _, block in transformer_blocks(model):
        base = getattr(type(block), "uncompiled_class", type(block))
        if base.__module__ in BLOCK_MODULES and base.__name__ == "TransformerBlock":
            block.__class__ = compiled_class(base)
            block.__dict__["_decode_halves"] = {}
            count += 1
    return count


def _halves(block: nn.Module):
    """(before, after) of `block`, each under mx.compile with its modules' parameters as inputs."""
    attn = block.self_attn

    def before(x):
        b, n, _ = x.shape
        h = block.input_layernorm(x)
        q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
        return (q.reshape(b, n, attn.n_heads, -1).transpose(0, 2, 1, 3),
                k.reshape(b, n, attn.n_kv_heads, -1).transpose(0, 2, 1, 3),
                v.reshape(b, n, attn.n_kv_heads, -1).transpose(0, 2, 1, 3))

    def after(attended, x):
        b, n, _ = x.shape
        h = x + attn.o_proj(attended.transpose(0, 2, 1, 3).reshape(b, n, -1))
        return h + block.mlp(block.post_attention_layernorm(h))

    return (mx.compile(before, inputs=[block.input_layernorm, attn.q_proj, attn.k_proj, attn.v_proj]),
            mx.compile(after, inputs=[attn.o_proj, block.post_attention_layernorm, block.mlp]))


@lru_cache(maxsize=None)
def compiled_class(base: type) -> type:
    """The subclass of a block class whose decode-shaped calls with a cache run compiled halves."""

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        if cache is None:
            return base.__call__(self, x, mask, cache)
        halves = self._decode_halves.get((x.shape, x.dtype))
        if halves is None:
            y = base.__call__(self, x, mask, cache)
            if x.size // x.shape[-1] <= MAX_KERNEL_ROWS and COMPILE_BLOCKS and kernel.COMPILE_ROUTES:
                # evaluated, the constants the layers' routes keep hold no graph back to the parameters
                mx.eval(y)
                self._decode_halves[(x.shape, x.dtype)] = _halves(self)
            return y
        attn = self.self_attn
        queries, keys, values = halves[0](x)
        queries = attn.rope(queries, offset=cache.offset)
        keys = attn.rope(keys, offset=cache.offset)
        keys, values = cache.update_and_fetch(keys, values)
        attention = sys.modules[base.__module__].scaled_dot_product_attention
        attended = attention(queries, keys, values, cache=cache, scale=attn.scale, mask=mask)
        return halves[1](attended, x)

    return type(base.__name__, (base,), {"__call__": __call__, "uncompiled_class": base,
                                         "__module__": base.__module__, "__qualname__": base.__qualname__})
