"""Sibling layers, the linear layers of a block that read one input (q/k/v; gate/up), in one launch.

At one batch row on a GPU back end each layer is one launch of the rotating LUT matmul
(`rotating_matmul.py`); the grouped form of that kernel computes all the siblings in one
launch instead, which halves a Llama block's weight launches and the host time spent
building them. mlx-lm's blocks call the siblings one after another on the same array
(`self.q_proj(x), self.k_proj(x), self.v_proj(x)`; `self.gate_proj(x) * self.up_proj(x)`), so
the first call launches for the group and keeps the others' outputs, and a sibling called on
that same array object takes its own. Any other call (another input, more rows, the CPU, a
grouped kernel that failed its first-use check, which warned) takes the layer's own route.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, List, Optional

import mlx.core as mx
import mlx.nn as nn

from . import rotating_matmul
from .shared import find_shared_inputs


class SiblingLaunch:
    """The layers of one input and their outputs of the last launch not yet taken."""

    def __init__(self, layers):
        self.layers = tuple(layers)
        self._launches = {}  # (shape, dtype) -> the grouped launch, or None where it is not taken
        self._input: Optional[mx.array] = None
        self._outputs: List[Optional[mx.array]] = [None] * len(self.layers)
        self._untaken = 0

    def route(self, index: int, x: mx.array, dialect: str) -> Optional[Callable[[mx.array], mx.array]]:
        """x -> layer `index`'s matmul of x (no bias) through the grouped launch, or None."""
        key = (x.shape, x.dtype)
        if key not in self._launches:
            self._launches[key] = rotating_matmul.group_route(self.layers, x, dialect)
        launch = self._launches[key]
        if launch is None:
            return None
        return partial(self._output, index, launch=launch)

    def _output(self, index: int, x: mx.array, launch) -> mx.array:
        outputs = self._outputs
        if x is not self._input or outputs[index] is None:
            outputs = self._outputs = list(launch(x))
            self._input = x  # held until every sibling took its output, so its id is not reused
            self._untaken = len(outputs)
        out, outputs[index] = outputs[index], None
        self._untaken -= 1
        if not self._untaken:
            self._input = None
        return out


def link_siblings(model: nn.Module) -> int:
    """Give the sibling layers of every recognised block (`shared.BLOCKS`) one `SiblingLaunch`;
    returns how many groups were linked. Layers that take their input rotated by the norm
    (`share_rotations`), or that differ in width, bits or scale groups, stay unlinked."""
    from .linear import QuantizedLinear

    modules = dict(model.named_modules())
    linked = 0
    for group in find_shared_inputs(model)[0]:
        layers = [modules.get(path) for path in group.layers]
        if not all(isinstance(layer, QuantizedLinear) and not layer.input_rotated for layer in layers):
            continue
        first = layers[0]
        if any((layer.in_features, layer.bits, layer.scales.shape[1]) !=
               (first.in_features, first.bits, first.scales.shape[1]) for layer in layers):
            continue
        siblings = SiblingLaunch(layers)
        for index, layer in enumerate(layers):
            layer.__dict__["_siblings"] = (siblings, index)
            layer._routes.clear()
        linked += 1
    return linked
