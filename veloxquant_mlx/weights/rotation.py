"""Structured orthogonal rotations of any input dimension, cheap to build and store.

A weight row w and an input x are rotated by the same orthogonal R, so
x . w = (R x) . (R w) and the layer can multiply rotated inputs against codes of
rotated rows (QuaRot, arXiv 2404.00456, Sec. 3; HIGGS, arXiv 2411.17525, Sec. 3).

Where `mx.hadamard_transform` supports the dimension (m * 2^k, m in 1, 12, 20, 28)
R is one randomised Hadamard transform, H diag(s) / sqrt(n). Elsewhere the dimension
is split into blocks that it does support (largest first) and R is a product of
`stages` rounds of  x -> blockdiag(H_1, ..., H_k) P diag(s) x  with a seeded random
sign vector s and permutation P per round: the permutations carry mass across
blocks, so after two rounds every output coordinate depends on every input one.
State is `stages` sign vectors and permutations (O(n) numbers, never an n x n
matrix), which is what the reservoir stores: loading rebuilds nothing random.
"""

from __future__ import annotations

import functools
from typing import Dict, List, Tuple

import mlx.core as mx
import numpy as np

from ..rotations import hadamard_base

_STREAM = 11  # independent of the KV cache's rotation streams (rotations.py)
DEFAULT_STAGES = 2


def hadamard_blocks(dim: int) -> Tuple[int, ...]:
    """`dim` as a sum of sizes `mx.hadamard_transform` supports, largest first."""
    if dim < 1:
        raise ValueError(f"dim must be positive, got {dim}")
    blocks: List[int] = []
    rest = dim
    while rest:
        size = max(n for n in _supported_up_to(rest))
        blocks.append(size)
        rest -= size
    return tuple(blocks)


def _supported_up_to(limit: int):
    for m in (1, 12, 20, 28):
        n = m
        while n <= limit:
            yield n
            n *= 2


class StructuredRotation:
    """R = prod over stages of blockdiag(H) P diag(s) (see the module doc)."""

    def __init__(self, dim: int, signs: mx.array, perms: mx.array | None, blocks: Tuple[int, ...]):
        if sum(blocks) != dim:
            raise ValueError(f"blocks {blocks} do not add up to dim {dim}")
        if signs.ndim != 2 or signs.shape[1] != dim:
            raise ValueError(f"signs must have shape (stages, {dim}), got {signs.shape}")
        if perms is not None and perms.shape != signs.shape:
            raise ValueError(f"perms must have shape {signs.shape}, got {perms.shape}")
        self.dim = dim
        self.blocks = tuple(int(b) for b in blocks)
        self.signs = signs.astype(mx.float32)
        # uint16 where it fits: the permutations are then 2 bytes per input feature per stage
        index = mx.uint16 if dim <= 1 << 16 else mx.uint32
        self.perms = None if perms is None else perms.astype(index)
        self._offsets = np.concatenate([[0], np.cumsum(self.blocks)]).tolist()
        self._sign_cache = {}
        # one stage, one block: apply_signed is one transform (the common Hadamard-size case)
        self._one_transform = self.perms is None and len(self.blocks) == 1 and self.signs.shape[0] == 1

    @classmethod
    def seeded(cls, dim: int, seed: int = 0, stages: int = DEFAULT_STAGES) -> "StructuredRotation":
        rng = np.random.default_rng([int(seed), _STREAM, int(dim)])
        if hadamard_base(dim) is not None:
            signs = rng.choice([-1.0, 1.0], (1, dim)).astype(np.float32)
            return cls(dim, mx.array(signs), None, (dim,))
        if stages < 1:
            raise ValueError(f"stages must be >= 1, got {stages}")
        signs = rng.choice([-1.0, 1.0], (stages, dim)).astype(np.float32)
        perms = np.stack([rng.permutation(dim) for _ in range(stages)]).astype(np.uint32)
        return cls(dim, mx.array(signs), mx.array(perms), hadamard_blocks(dim))

    @property
    def stages(self) -> int:
        return self.signs.shape[0]

    def apply(self, x: mx.array, scale: mx.array | None = None) -> mx.array:
        """R x for every vector along the last axis (orthonormal: norms are kept); with
        `scale`, R (scale * x), the scale folded into the first stage's signs."""
        return self.apply_signed(x * self._signs(0, x.dtype, scale))

    def apply_signed(self, x: mx.array) -> mx.array:
        """R x for an x already multiplied by the first stage's signs: what is left of `apply`
        once the signs (and an input scale) are folded into a preceding multiply, such as a
        norm's weight (`shared.RotatingRMSNorm`)."""
        if self._one_transform:
            return mx.hadamard_transform(x)
        for stage in range(self.stages):
            if stage:
                x = x * self._signs(stage, x.dtype, None)
            if self.perms is not None:
                x = mx.take(x, self._perm(stage), axis=-1)
            if len(self.blocks) == 1:
                x = mx.hadamard_transform(x)
            else:
                o = self._offsets
                x = mx.concatenate(
                    [mx.hadamard_transform(x[..., o[i]:o[i + 1]]) for i in range(len(self.blocks))], axis=-1)
        return x

    def _signs(self, stage: int, dtype, scale: mx.array | None) -> mx.array:
        """signs[stage] (times `scale`) in `dtype`, kept from call to call: a decode step
        calls every layer once, and rebuilding these would cost a kernel and host time
        per layer. The signs are +-1, so x * (signs * scale) rounds as x * scale does."""
        key = (stage, dtype, None if scale is None else id(scale))
        cached = self._sign_cache.get(key)
        if cached is None or cached[0] is not scale:
            vector = self.signs[stage] if scale is None else self.signs[stage] * scale.astype(mx.float32)
            cached = (scale, vector.astype(dtype))
            self._sign_cache[key] = cached
        return cached[1]

    def apply_transpose(self, y: mx.array) -> mx.array:
        """R^T y along the last axis: the stages undone in reverse (embedding lookups decode
        rotated rows back to the model's basis with it)."""
        for stage in reversed(range(self.stages)):
            o = self._offsets
            if len(self.blocks) == 1:
                y = _hadamard_transpose(y)
            else:
                y = mx.concatenate([_hadamard_transpose(y[..., o[i]:o[i + 1]]) for i in range(len(self.blocks))],
                                   axis=-1)
            if self.perms is not None:
                y = mx.take(y, self._inverse_perm(stage), axis=-1)
            y = y * self._signs(stage, y.dtype, None)
        return y

    def _perm(self, stage: int) -> mx.array:
        """perms[stage], kept: a view made once, so that a compiled caller that takes the layer's
        parameters as inputs (`compiled_mlp.py`) meets it as a constant, not as the parameter."""
        if not hasattr(self, "_stage_perms"):
            self._stage_perms = [self.perms[s] for s in range(self.stages)]
            mx.eval(self._stage_perms)
        return self._stage_perms[stage]

    def _inverse_perm(self, stage: int) -> mx.array:
        if not hasattr(self, "_inverse"):
            self._inverse = [mx.argsort(self.perms[s].astype(mx.uint32)).astype(mx.uint32)
                             for s in range(self.stages)]
        return self._inverse[stage]

    def state(self) -> Dict[str, mx.array]:
        state = {"signs": self.signs.astype(mx.int8)}
        if self.perms is not None:
            state["perms"] = self.perms
        return state

    def meta(self) -> Dict[str, object]:
        return {"dim": self.dim, "blocks": list(self.blocks)}

    @classmethod
    def from_state(cls, state: Dict[str, mx.array], meta: Dict[str, object]) -> "StructuredRotation":
        return cls(int(meta["dim"]), state["signs"], state.get("perms"), tuple(meta["blocks"]))


@functools.lru_cache(maxsize=None)
def _base_matrix(m: int) -> mx.array:
    return mx.hadamard_transform(mx.eye(m), stream=mx.cpu)  # MLX's CUDA build fails for m alone (N = 1)


def _hadamard_transpose(y: mx.array) -> mx.array:
    """The inverse of `mx.hadamard_transform` (row vectors: T(x) = x A with A = H_m kron H_2^k,
    orthonormal). A is symmetric for m in (1, 12); for m = 20, 28 the inverse x = y A^T is, with
    y as an (m, 2^k) matrix Y, H_m (Y H_2^k): one power-of-two transform and an m x m product."""
    n = y.shape[-1]
    m = hadamard_base(n)
    if m is None:
        raise ValueError(f"mx.hadamard_transform does not support {n}")
    if m in (1, 12):
        return mx.hadamard_transform(y)
    lead = y.shape[:-1]
    z = y.reshape(*lead, m, n // m)
    if n // m > 1:
        z = mx.hadamard_transform(z)
    return (_base_matrix(m).astype(y.dtype) @ z).reshape(*lead, n)


def dense_rotation_matrix(dim: int, seed: int = 0) -> mx.array:
    """A Haar-random orthogonal matrix: only the quality baseline of benchmarks."""
    q, r = np.linalg.qr(np.random.default_rng([int(seed), _STREAM + 1, dim]).standard_normal((dim, dim)))
    return mx.array((q * np.where(np.diag(r) < 0, -1.0, 1.0)).astype(np.float32))
