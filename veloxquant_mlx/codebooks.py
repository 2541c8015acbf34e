"""Lloyd-Max scalar codebooks and the quantize / dequantize lookups.

After a random rotation every coordinate of a head vector follows (nearly) one
known 1-D distribution, so a fixed MSE-optimal scalar quantizer per bit width is
enough (TurboQuant, arXiv 2504.19874, Sec. 3.1). The codebooks are solved once in
float64 numpy (Lloyd 1982; Max 1960) and cached; the hot path is pure MLX.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx
import numpy as np

DISTRIBUTIONS = ("gaussian", "laplace", "sphere")
MAX_BITS = 8

_GRID_POINTS = 1 << 19
_MAX_ITERATIONS = 200_000
_TOLERANCE = 1e-10


@dataclass(frozen=True, eq=False)  # arrays have no scalar ==; compare by identity
class Codebook:
    """An MSE-optimal scalar quantizer for one distribution and bit width.

    `mse` is the expected squared error per coordinate under that distribution.
    """

    bits: int
    centroids: mx.array
    boundaries: mx.array
    mse: float
    distribution: str
    dim: int | None = None


def _density_grid(distribution: str, dim: int | None) -> tuple[np.ndarray, np.ndarray]:
    """A fine symmetric grid (0 is a node) and the density on it, normalised."""
    if distribution == "gaussian":
        x = np.linspace(-13.0, 13.0, _GRID_POINTS + 1)
        log_p = -0.5 * x * x
    elif distribution == "laplace":
        # Unit variance: scale 1/sqrt(2), density ~ exp(-sqrt(2)|x|).
        x = np.linspace(-32.0, 32.0, _GRID_POINTS + 1)
        log_p = -math.sqrt(2.0) * np.abs(x)
    else:
        # One coordinate of a uniform unit vector in R^dim:
        # p(x) ~ (1 - x^2)^((dim - 3) / 2) on [-1, 1] (TurboQuant Lemma 1).
        # Its std is 1/sqrt(dim); beyond 40 std the mass is negligible.
        half_width = min(1.0, 40.0 / math.sqrt(dim))
        x = np.linspace(-half_width, half_width, _GRID_POINTS + 1)
        with np.errstate(divide="ignore"):
            log_p = 0.5 * (dim - 3) * np.log1p(-x * x) if dim > 3 else np.zeros_like(x)
    p = np.exp(log_p - log_p.max())
    return x, p / _cumulative(x, p)[-1]


def _cumulative(x: np.ndarray, f: np.ndarray) -> np.ndarray:
    """Cumulative trapezoid integral of f on the grid, starting at 0."""
    return np.concatenate([[0.0], np.cumsum(0.5 * (f[1:] + f[:-1]) * np.diff(x))])


def _solve(x: np.ndarray, p: np.ndarray, levels: int) -> np.ndarray:
    """Lloyd-Max iteration on a tabulated symmetric density; returns centroids."""
    mass = _cumulative(x, p)
    first_moment = _cumulative(x, x * p)
    # Symmetric start near the optimum: high-rate theory puts the optimal point
    # density proportional to p^(1/3) (Panter & Dite 1951), so start at its quantiles.
    companded = _cumulative(x, np.cbrt(p))
    quantiles = (np.arange(levels) + 0.5) / levels * companded[-1]
    centroids = np.interp(quantiles, companded, x)
    for _ in range(_MAX_ITERATIONS):
        edges = np.concatenate([[x[0]], 0.5 * (centroids[1:] + centroids[:-1]), [x[-1]]])
        cell_mass = np.diff(np.interp(edges, x, mass))
        cell_moment = np.diff(np.interp(edges, x, first_moment))
        updated = cell_moment / cell_mass
        updated = 0.5 * (updated - updated[::-1])  # keep it exactly symmetric
        change = np.max(np.abs(updated - centroids))
        centroids = updated
        if change < _TOLERANCE * centroids[-1]:
            break
    return centroids


def _expected_mse(x: np.ndarray, p: np.ndarray, centroids: np.ndarray) -> float:
    # (x - c(x))^2 is continuous at the midpoints, so the trapezoid rule is accurate.
    boundaries = 0.5 * (centroids[1:] + centroids[:-1])
    error = x - centroids[np.searchsorted(boundaries, x)]
    return float(_cumulative(x, error * error * p)[-1])


@lru_cache(maxsize=None, typed=True)
def lloyd_max(distribution: str, bits: int, dim: int | None = None) -> Codebook:
    """The Lloyd-Max codebook with 2**bits levels for `distribution`.

    "gaussian" is N(0, 1), "laplace" the unit-variance Laplace, and "sphere" one
    coordinate of a uniformly random unit vector in R^dim (needs dim >= 3).
    """
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"unknown distribution {distribution!r}; known: {', '.join(DISTRIBUTIONS)}")
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= MAX_BITS:
        raise ValueError(f"bits must be an integer in 1..{MAX_BITS}, got {bits!r}")
    if distribution == "sphere":
        if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim < 3:
            raise ValueError(f"distribution 'sphere' needs an integer dim >= 3, got {dim!r}")
        dim = int(dim)
    else:
        dim = None  # only the sphere distribution depends on the dimension

    x, p = _density_grid(distribution, dim)
    centroids = _solve(x, p, 1 << bits)
    boundaries = 0.5 * (centroids[1:] + centroids[:-1])
    return Codebook(
        bits=bits,
        centroids=mx.array(centroids.astype(np.float32)),
        boundaries=mx.array(boundaries.astype(np.float32)),
        mse=_expected_mse(x, p, centroids),
        distribution=distribution,
        dim=dim,
    )


def quantize(x: mx.array, codebook_or_boundaries: Codebook | mx.array) -> mx.array:
    """Index of the nearest centroid for every element of x, as uint8 codes.

    With sorted centroids the nearest one is the number of midpoints x exceeds.
    """
    boundaries = getattr(codebook_or_boundaries, "boundaries", codebook_or_boundaries)
    if boundaries.shape[0] > 15:
        return (x[..., None] > boundaries).sum(axis=-1).astype(mx.uint8)
    # Up to 4 bits, one compare and add per midpoint, against Python floats: elementwise only, so
    # `mx.compile` fuses it with what comes before (a broadcast compare and a sum are two launches
    # and an (..., K) array; indexing the boundaries array would be a gather per midpoint).
    if x.dtype in (mx.float16, mx.bfloat16):
        x = x.astype(mx.float32)  # a Python float compares in x's dtype; the midpoints are float32
    midpoints = boundaries.tolist()
    codes = (x > midpoints[0]).astype(mx.uint8)
    for midpoint in midpoints[1:]:
        codes = codes + (x > midpoint).astype(mx.uint8)
    return codes


def dequantize(codes: mx.array, codebook_or_centroids: Codebook | mx.array) -> mx.array:
    """The centroid of every code, as float32."""
    centroids = getattr(codebook_or_centroids, "centroids", codebook_or_centroids)
    return mx.take(centroids.astype(mx.float32), codes)
