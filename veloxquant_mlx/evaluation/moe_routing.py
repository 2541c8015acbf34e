"""Replaying an MoE router's expert choices, to tell a cache's error from a jump of the model.

On a random MoE model a tiny change of the keys can send a token to other experts: a discontinuity of the model,
not of the cache. `RouterReplay` records the gate's choices on a run with mlx-lm's caches, then replays them on a
run with other caches (the weights recomputed from that run's own router scores), counting the choices that
would have flipped. `REPLAYABLE` names, per model file, the gate class and how its weights follow from chosen
experts.
"""

from __future__ import annotations

import importlib
from typing import Callable, Dict, List, Tuple

import mlx.core as mx


def _laguna_weights(gate, x: mx.array, indices: mx.array) -> mx.array:
    logits = gate.proj(x).astype(mx.float32)
    if gate.softcap > 0.0:
        logits = mx.tanh(logits / gate.softcap) * gate.softcap
    scores = mx.take_along_axis(gate._routing_scores(logits), indices, axis=-1)
    return scores / scores.sum(axis=-1, keepdims=True)


# file -> (gate class in mlx_lm.models.<file>, the gate's weights for given expert indices)
REPLAYABLE: Dict[str, Tuple[str, Callable]] = {"laguna": ("MoEGate", _laguna_weights)}


class RouterReplay:
    """A context that wraps a file's gate (`enabled`: the file is in `REPLAYABLE`; otherwise it wraps nothing).
    `mode`: "free" (the gate as it is), "record" (keep its choices), "count" (route freely, count the calls
    whose choices differ from the recorded ones) or "replay" (route as recorded, counting as "count" does)."""

    def __init__(self, file: str):
        self.enabled = file in REPLAYABLE
        if self.enabled:
            class_name, self.weights = REPLAYABLE[file]
            self.gate_class = getattr(importlib.import_module(f"mlx_lm.models.{file}"), class_name)
        self.choices: List[mx.array] = []
        self.restart("free")

    def restart(self, mode: str) -> None:
        self.mode, self.at, self.flipped, self.routed = mode, 0, 0, 0
        if mode == "record":
            self.choices = []

    def __enter__(self) -> "RouterReplay":
        if self.enabled:
            self.original = self.gate_class.__call__
            self.gate_class.__call__ = lambda gate, x: self._gate(gate, x)
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self.gate_class.__call__ = self.original

    def _gate(self, gate, x: mx.array):
        indices, weights = self.original(gate, x)
        if self.mode == "record":
            mx.eval(indices)
            self.choices.append(indices)
        elif self.mode in ("count", "replay"):
            recorded = self.choices[self.at]
            self.at += 1
            differs = mx.any(mx.sort(indices, axis=-1) != mx.sort(recorded, axis=-1), axis=-1)
            self.flipped += int(differs.sum().item())
            self.routed += differs.size
            if self.mode == "replay":
                indices, weights = recorded, self.weights(gate, x, recorded)
        return indices, weights
