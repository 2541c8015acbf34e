"""Each MLP of a quantized model as one compiled call at decode shapes.

A decode step's graph is built in Python, layer by layer, while the GPU runs the previous
step; where building takes longer than the GPU's work, the GPU waits (docs/methods.md,
"Sibling layers in one launch, and compiled routes"). A dense MLP (gate/up, the activation,
down_proj) is three of our layer calls, their routes and the activation's ops. Under
`mx.compile` the whole MLP is one call that replays its traced graph instead.

The MLP keeps its module and parameters: its class is swapped for a subclass whose
`__call__` runs the compiled form (the pattern of torch's `parametrize`), so the parameter
tree, saving and `update` are unchanged. The compiled form reads the MLP's current
parameters at every call (`mx.compile(inputs=...)`), so a later `update` is seen.
The first call of each input shape runs uncompiled: it makes the layers' routes and runs
their kernels' first-use checks, which evaluate arrays and so cannot run inside a trace.
Prefill shapes stay uncompiled: a compiled function traces again for every new shape.
"""

from __future__ import annotations

from functools import lru_cache, partial

import mlx.core as mx
import mlx.nn as nn

from . import kernel
from .linear import MAX_KERNEL_ROWS, QuantizedLinear
from .shared import transformer_blocks

# Benchmarks compare against it off; `VELOXQUANT_WEIGHT_COMPILE=0` (kernel.COMPILE_ROUTES) turns it
# off with every other compiled route. Read at each new input shape.
COMPILE_MLPS = True


def compiles(mlp: nn.Module) -> bool:
    """A dense MLP of our layers: every child module a QuantizedLinear, at least two of them."""
    children = list(mlp.children().values())
    return len(children) >= 2 and all(isinstance(child, QuantizedLinear) for child in children)


def compile_mlps(model: nn.Module) -> int:
    """Make the `mlp` of every block (`shared.transformer_blocks`) whose
    layers are all ours a `compiled` one; returns how many. Again on a model already done,
    it forgets the traced forms (the layers may have been replaced)."""
    count = 0
    for _, module in transformer_blocks(model):
        mlp = module["mlp"]
        if isinstance(mlp, nn.Module) and compiles(mlp):
            base = getattr(type(mlp), "uncompiled_class", type(mlp))
            mlp.__class__ = compiled_class(base)
            mlp.__dict__["_decode_calls"] = {}
            count += 1
    return count


@lru_cache(maxsize=None)
def compiled_class(base: type) -> type:
    """The subclass of an MLP class whose decode-shaped calls run compiled."""

    def __call__(self, x: mx.array) -> mx.array:
        key = (x.shape, x.dtype)
        call = self._decode_calls.get(key)
        if call is not None:
            return call(x)
        y = base.__call__(self, x)
        if x.size // x.shape[-1] <= MAX_KERNEL_ROWS and COMPILE_MLPS and kernel.COMPILE_ROUTES:
            # evaluated, the constants the layers' routes keep (signs scaled by the input scales)
            # hold no graph back to the parameters, which the trace would meet as uncaptured inputs
            mx.eval(y)
            self._decode_calls[key] = mx.compile(partial(base.__call__, self), inputs=self)
        return y

    return with_call(base, __call__)


def with_call(base: type, call) -> type:
    """The subclass of `base` whose `__call__` is `call`, under base's name and module, with
    `uncompiled_class` naming base (an instance's class is swapped for it: `compile_mlps`)."""
    return type(base.__name__, (base,), {"__call__": call, "uncompiled_class": base,
                                         "__module__": base.__module__, "__qualname__": base.__qualname__})
