import math

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.codebooks import Codebook, dequantize, lloyd_max, quantize

# Max (1960); TurboQuant arXiv 2504.19874 Table / Thm 1.
GAUSSIAN_MSE = {1: 0.3634, 2: 0.1175, 3: 0.03455, 4: 0.009501}
SPHERE_128_SCALED_MSE = {1: 0.36, 2: 0.117, 3: 0.03454, 4: 0.0095}


def significant(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits - 1}e}")


@pytest.mark.parametrize("bits", GAUSSIAN_MSE)
def test_gaussian_mse_published(bits):
    assert significant(lloyd_max("gaussian", bits).mse) == GAUSSIAN_MSE[bits]


def test_gaussian_three_bit_centroids_published():
    expected = [0.2451, 0.7560, 1.3439, 2.1519]
    expected = [-c for c in reversed(expected)] + expected
    np.testing.assert_allclose(np.array(lloyd_max("gaussian", 3).centroids), expected, atol=5e-5)


def test_one_bit_centroids_closed_form():
    # E|X|: sqrt(2/pi) for N(0,1), 1/sqrt(2) for the unit-variance Laplace (MSE 1 - 1/2).
    gaussian = lloyd_max("gaussian", 1)
    assert significant(float(gaussian.centroids[1])) == 0.7979
    assert gaussian.centroids[1].item() == pytest.approx(math.sqrt(2 / math.pi), rel=1e-6)
    laplace = lloyd_max("laplace", 1)
    assert laplace.centroids[1].item() == pytest.approx(1 / math.sqrt(2), rel=1e-6)
    assert laplace.mse == pytest.approx(0.5, rel=1e-6)


@pytest.mark.parametrize("bits", SPHERE_128_SCALED_MSE)
def test_sphere_mse_matches_turboquant(bits):
    assert 128 * lloyd_max("sphere", bits, dim=128).mse == pytest.approx(
        SPHERE_128_SCALED_MSE[bits], rel=0.03
    )


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_sphere_approaches_gaussian(bits):
    gaussian = np.array(lloyd_max("gaussian", bits).centroids)
    gaps = [
        np.abs(np.array(lloyd_max("sphere", bits, dim=d).centroids) * math.sqrt(d) - gaussian).max()
        for d in (16, 128, 1024, 8192)
    ]
    assert all(a > b for a, b in zip(gaps, gaps[1:]))
    assert gaps[-1] < 2e-3


@pytest.mark.parametrize("bits", [1, 2, 3])
def test_sphere_dim_3_is_uniform(bits):
    # In R^3 one coordinate is uniform on [-1, 1] (Archimedes): uniform quantizer.
    levels = 1 << bits
    codebook = lloyd_max("sphere", bits, dim=3)
    expected = -1 + (2 * np.arange(levels) + 1) / levels
    np.testing.assert_allclose(np.array(codebook.centroids), expected, atol=1e-6)
    assert codebook.mse == pytest.approx((2 / levels) ** 2 / 12, rel=1e-6)


def every_width(distributions):
    """(distribution, dim, bits) for bits 1..8. An 8-bit Lloyd-Max codebook takes seconds to solve, so
    `make test` solves the Gaussian one and `make test-all` every distribution's."""
    return [(d, dim, bits) if bits < 8 or d == "gaussian" else pytest.param(d, dim, bits, marks=pytest.mark.slow)
            for d, dim in distributions for bits in range(1, 9)]


@pytest.mark.parametrize("distribution,dim,bits", every_width([("gaussian", None), ("laplace", None), ("sphere", 64)]))
def test_codebook_structure(distribution, dim, bits):
    codebook = lloyd_max(distribution, bits, dim)
    assert isinstance(codebook, Codebook)
    assert codebook is lloyd_max(distribution, bits, dim)
    assert (codebook.bits, codebook.distribution, codebook.dim) == (bits, distribution, dim)
    c, b = np.array(codebook.centroids), np.array(codebook.boundaries)
    assert codebook.centroids.dtype == mx.float32 and c.shape == (1 << bits,)
    assert codebook.boundaries.dtype == mx.float32 and b.shape == ((1 << bits) - 1,)
    assert np.all(np.diff(c) > 0)
    np.testing.assert_allclose(c, -c[::-1], atol=1e-7)
    np.testing.assert_allclose(b, (c[1:] + c[:-1]) / 2, rtol=1e-6, atol=1e-7)
    assert 0 < codebook.mse


def sample(distribution: str, dim: int | None, size: int, rng) -> np.ndarray:
    if distribution == "gaussian":
        return rng.standard_normal(size)
    if distribution == "laplace":
        return rng.laplace(scale=1 / math.sqrt(2), size=size)
    # First coordinate of g / |g|, g ~ N(0, I_dim): g_1 / sqrt(g_1^2 + chi^2_{dim-1}).
    first = rng.standard_normal(size)
    return first / np.sqrt(first**2 + rng.chisquare(dim - 1, size))


def density(distribution: str, dim: int | None, x: np.ndarray) -> np.ndarray:
    if distribution == "gaussian":
        return np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    if distribution == "laplace":
        return np.exp(-math.sqrt(2) * np.abs(x)) / math.sqrt(2)
    log_norm = math.lgamma(dim / 2) - math.lgamma((dim - 1) / 2) - 0.5 * math.log(math.pi)
    return np.exp(log_norm + 0.5 * (dim - 3) * np.log1p(-x * x))


SAMPLED = [("gaussian", None), ("laplace", None), ("sphere", 128), ("sphere", 8)]


@pytest.mark.parametrize("distribution,dim", SAMPLED)
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_empirical_mse(distribution, dim, bits):
    # Laplace's heavier tails make the estimate noisier: 2M samples keep its
    # standard error (about 0.6% at 4 bits) well inside the 2% tolerance.
    size = 2_000_000 if distribution == "laplace" else 200_000
    codebook = lloyd_max(distribution, bits, dim)
    x = mx.array(sample(distribution, dim, size, np.random.default_rng(bits)).astype(np.float32))
    error = dequantize(quantize(x, codebook), codebook) - x
    assert mx.mean(error * error).item() == pytest.approx(codebook.mse, rel=0.02)


@pytest.mark.parametrize("distribution,dim,bits", every_width(SAMPLED))
def test_expected_mse_by_quadrature(distribution, dim, bits):
    # At 5+ bits a large share of the MSE comes from rare tail values that 200k
    # random samples do not see reliably, so integrate against the density instead
    # (midpoint rule on an independent grid).
    codebook = lloyd_max(distribution, bits, dim)
    half_width = 1.0 if distribution == "sphere" else {"gaussian": 12.0, "laplace": 30.0}[distribution]
    points = 400_000
    step = 2 * half_width / points
    x = -half_width + (np.arange(points) + 0.5) * step
    reconstructed = np.array(dequantize(quantize(mx.array(x.astype(np.float32)), codebook), codebook))
    mse = np.sum((reconstructed - x) ** 2 * density(distribution, dim, x)) * step
    assert mse == pytest.approx(codebook.mse, rel=1e-4)


@pytest.mark.parametrize("bits", range(1, 9))
def test_quantize_picks_nearest_centroid(bits):
    codebook = lloyd_max("gaussian", bits)
    centroids = np.array(codebook.centroids).astype(np.float64)
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((50, 4, 100)) * 2.5).astype(np.float32)  # includes far tails
    x[0, 0, :4] = [-1e6, 1e6, 0.0, -0.0]
    codes = quantize(mx.array(x), codebook)
    assert codes.dtype == mx.uint8 and codes.shape == x.shape
    brute = np.abs(x[..., None].astype(np.float64) - centroids).argmin(-1)
    np.testing.assert_array_equal(np.array(codes), brute)

    # Values exactly on a boundary are equidistant up to float32 rounding.
    boundaries = np.array(codebook.boundaries)
    on_boundary = np.concatenate([boundaries, np.nextafter(boundaries, np.inf), np.nextafter(boundaries, -np.inf)])
    chosen = np.array(quantize(mx.array(on_boundary), codebook.boundaries))
    distance = np.abs(on_boundary[:, None].astype(np.float64) - centroids)
    assert np.all(distance[np.arange(len(chosen)), chosen] <= distance.min(-1) + 1e-6)


def test_quantize_dequantize_accept_raw_arrays():
    codebook = lloyd_max("laplace", 3)
    x = mx.array(np.random.default_rng(1).laplace(size=(2, 3, 16)).astype(np.float32))
    codes = quantize(x, codebook.boundaries)
    assert mx.array_equal(codes, quantize(x, codebook)).item()
    values = dequantize(codes, codebook.centroids)
    assert values.dtype == mx.float32 and values.shape == x.shape
    assert mx.array_equal(values, dequantize(codes, codebook)).item()
    np.testing.assert_array_equal(np.array(values), np.array(codebook.centroids)[np.array(codes)])


def test_argument_errors():
    with pytest.raises(ValueError, match="gaussian.*laplace.*sphere"):
        lloyd_max("uniform", 2)
    for bits in (0, 9, -1, 2.5, True):
        with pytest.raises(ValueError, match="bits"):
            lloyd_max("gaussian", bits)
    with pytest.raises(ValueError, match="dim"):
        lloyd_max("sphere", 2)
    with pytest.raises(ValueError, match="dim"):
        lloyd_max("sphere", 2, dim=2)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_quantize_counts_the_midpoints_each_input_exceeds(bits, dtype):
    # Up to 4 bits quantize compares against the midpoints one at a time (a chain that mx.compile
    # fuses); above, against all at once. Both must give the count of float32 midpoints exceeded.
    boundaries = mx.sort(mx.random.normal((2 ** bits - 1,), key=mx.random.key(bits)))
    # random inputs, and the midpoints themselves (equal is not above)
    x = mx.concatenate([mx.random.normal((4, 257), key=mx.random.key(7)),
                        mx.broadcast_to(boundaries, (4, boundaries.shape[0]))], axis=1).astype(dtype)
    expected = (x.astype(mx.float32)[..., None] > boundaries).sum(axis=-1).astype(mx.uint8)
    assert mx.array_equal(quantize(x, boundaries), expected)
