"""Seeded random orthogonal rotations of head vectors, and Gaussian sketches.

A random rotation makes every coordinate of a (fixed) vector follow the same
known distribution, which is what lets one scalar codebook serve all
coordinates (TurboQuant, arXiv 2504.19874, Sec. 3.1).

Randomness is drawn once, in numpy, from `np.random.default_rng([seed, stream])`
where `stream` is a fixed per-purpose constant (1: Hadamard signs, 2: dense
rotation, 3: Gaussian projection). So a rotation and a projection built with
the same seed are independent, and results do not depend on MLX's RNG state.
"""

from __future__ import annotations

from typing import Dict, Protocol, runtime_checkable

import mlx.core as mx
import numpy as np

_HADAMARD_STREAM = 1
_DENSE_STREAM = 2
_GAUSSIAN_STREAM = 3

# mx.hadamard_transform handles n = m * 2^k for these m. The m = 20 and m = 28
# matrices it uses are not symmetric, so the transform is not its own inverse there.
_HADAMARD_BASES = (1, 12, 20, 28)
_SYMMETRIC_HADAMARD_BASES = (1, 12)


def _rng(seed: int, stream: int) -> np.random.Generator:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    return np.random.default_rng([int(seed), stream])


def _check_dim(dim: int) -> int:
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim < 1:
        raise ValueError(f"dim must be a positive integer, got {dim!r}")
    return int(dim)


def hadamard_base(dim: int) -> int | None:
    """The m in dim = m * 2^k that mx.hadamard_transform uses, or None if unsupported."""
    for m in _HADAMARD_BASES:
        if dim % m == 0:
            k = dim // m
            if k & (k - 1) == 0:
                return m
    return None


@runtime_checkable
class Rotation(Protocol):
    """An orthogonal map R acting on the last axis."""

    dim: int

    def apply(self, x: mx.array) -> mx.array:
        """y = R x for every vector along the last axis."""
        ...

    def invert(self, y: mx.array) -> mx.array:
        """x = R^T y for every vector along the last axis."""
        ...

    def state(self) -> dict[str, mx.array]:
        """Arrays that rebuild this rotation exactly with `rotation_from_state`."""
        ...


class HadamardRotation:
    """R = H diag(s) / sqrt(n): a Hadamard transform after seeded random signs s."""

    def __init__(self, dim: int, seed: int = 0, *, signs: mx.array | None = None):
        self.dim = _check_dim(dim)
        self._base = hadamard_base(self.dim)
        if self._base is None:
            raise ValueError(f"mx.hadamard_transform does not support dim {dim}")
        if signs is None:
            signs = mx.array(_rng(seed, _HADAMARD_STREAM).choice([-1.0, 1.0], self.dim).astype(np.float32))
        if signs.shape != (self.dim,):
            raise ValueError(f"signs must have shape ({self.dim},), got {signs.shape}")
        self.signs = signs.astype(mx.float32)
        self._transposed = None
        if self._base not in _SYMMETRIC_HADAMARD_BASES:
            # Row i of hadamard_transform(I) is H e_i, so that matrix is H^T and
            # y @ it.T = H^T y. Tiny (n <= a few hundred), built once.
            self._transposed = mx.hadamard_transform(mx.eye(self.dim)).T

    def apply(self, x: mx.array) -> mx.array:
        return mx.hadamard_transform(x * self.signs)

    def invert(self, y: mx.array) -> mx.array:
        if self._transposed is None:
            return mx.hadamard_transform(y) * self.signs
        return (y @ self._transposed) * self.signs

    def state(self) -> dict[str, mx.array]:
        return {"hadamard_signs": self.signs}


class DenseRotation:
    """A seeded Haar-random orthogonal matrix (QR of a Gaussian, Mezzadri 2007)."""

    def __init__(self, dim: int, seed: int = 0, *, matrix: mx.array | None = None):
        self.dim = _check_dim(dim)
        if matrix is None:
            gaussian = _rng(seed, _DENSE_STREAM).standard_normal((self.dim, self.dim))
            q, r = np.linalg.qr(gaussian)
            # Fixing the signs of diag(r) makes q exactly Haar distributed.
            q = q * np.where(np.diag(r) < 0, -1.0, 1.0)
            matrix = mx.array(q.astype(np.float32))
        if matrix.shape != (self.dim, self.dim):
            raise ValueError(f"matrix must have shape ({self.dim}, {self.dim}), got {matrix.shape}")
        self.matrix = matrix.astype(mx.float32)

    def apply(self, x: mx.array) -> mx.array:
        return x @ self.matrix.T

    def invert(self, y: mx.array) -> mx.array:
        return y @ self.matrix

    def state(self) -> dict[str, mx.array]:
        return {"dense_matrix": self.matrix}


def random_rotation(dim: int, seed: int = 0) -> Rotation:
    """A randomized Hadamard rotation where MLX supports dim, else a dense one."""
    if hadamard_base(_check_dim(dim)) is not None:
        return HadamardRotation(dim, seed)
    return DenseRotation(dim, seed)


def rotation_from_state(state: dict[str, mx.array]) -> Rotation:
    """Rebuild the rotation whose `state()` this is."""
    if "hadamard_signs" in state:
        signs = state["hadamard_signs"]
        return HadamardRotation(signs.shape[-1], signs=signs)
    if "dense_matrix" in state:
        matrix = state["dense_matrix"]
        return DenseRotation(matrix.shape[-1], matrix=matrix)
    raise ValueError(f"not a rotation state: keys {sorted(state)}")


def gaussian_projection(rows: int, dim: int, seed: int = 0) -> mx.array:
    """A seeded (rows, dim) matrix of i.i.d. N(0, 1) entries, float32 (QJL sketches)."""
    rows, dim = _check_dim(rows), _check_dim(dim)
    return mx.array(_rng(seed, _GAUSSIAN_STREAM).standard_normal((rows, dim)).astype(np.float32))


ROTATION_PREFIX = "rotation."


def rotation_params(rotation) -> Dict[str, mx.array]:
    """A rotation's state under the `rotation.` prefix, for a codec's `params()`."""
    return {ROTATION_PREFIX + k: v for k, v in rotation.state().items()}


def rotation_from_params(params: Dict[str, mx.array]):
    """Rebuild the rotation stored by `rotation_params` among a codec's params."""
    n = len(ROTATION_PREFIX)
    return rotation_from_state({k[n:]: v for k, v in params.items() if k.startswith(ROTATION_PREFIX)})
