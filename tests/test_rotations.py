import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.rotations import (
    DenseRotation,
    HadamardRotation,
    Rotation,
    gaussian_projection,
    random_rotation,
    rotation_from_state,
)

HADAMARD_DIMS = [64, 80, 96, 112, 128, 256]
DENSE_DIMS = [72, 100]
DIMS = HADAMARD_DIMS + DENSE_DIMS


def as_matrix(rotation) -> np.ndarray:
    # apply() maps each row e_i to R e_i, so the rows of apply(I) are the columns of R.
    return np.array(rotation.apply(mx.eye(rotation.dim))).T


def random_vectors(shape, seed=0) -> mx.array:
    return mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


@pytest.mark.parametrize("dim", DIMS)
def test_kind_dispatch(dim):
    rotation = random_rotation(dim, seed=3)
    assert isinstance(rotation, Rotation)
    assert isinstance(rotation, HadamardRotation if dim in HADAMARD_DIMS else DenseRotation)
    assert rotation.dim == dim


@pytest.mark.parametrize("dim", DIMS)
def test_orthogonal(dim):
    r = as_matrix(random_rotation(dim, seed=1)).astype(np.float64)
    np.testing.assert_allclose(r.T @ r, np.eye(dim), atol=1e-5)
    np.testing.assert_allclose(r @ r.T, np.eye(dim), atol=1e-5)


@pytest.mark.parametrize("dim", DIMS)
def test_invert_is_transpose(dim):
    rotation = random_rotation(dim, seed=2)
    r = as_matrix(rotation)
    r_inverse = np.array(rotation.invert(mx.eye(dim))).T
    np.testing.assert_allclose(r_inverse, r.T, atol=1e-5)


@pytest.mark.parametrize("dim", DIMS)
def test_round_trip_and_norms(dim):
    rotation = random_rotation(dim, seed=4)
    x = random_vectors((64, dim))
    y = rotation.apply(x)
    np.testing.assert_allclose(np.array(rotation.invert(y)), np.array(x), atol=1e-5)
    np.testing.assert_allclose(np.array(rotation.apply(rotation.invert(x))), np.array(x), atol=1e-5)
    np.testing.assert_allclose(
        np.linalg.norm(np.array(y), axis=-1), np.linalg.norm(np.array(x), axis=-1), rtol=1e-5
    )


@pytest.mark.parametrize("dim", DIMS)
def test_batched(dim):
    rotation = random_rotation(dim, seed=5)
    x = random_vectors((2, 3, 5, dim))
    y = rotation.apply(x)
    assert y.shape == x.shape and y.dtype == mx.float32
    flat = rotation.apply(x.reshape(-1, dim)).reshape(x.shape)
    np.testing.assert_allclose(np.array(y), np.array(flat), atol=1e-6)
    np.testing.assert_allclose(np.array(rotation.invert(y)), np.array(x), atol=1e-5)


@pytest.mark.parametrize("dim", DIMS)
def test_deterministic_and_seeded(dim):
    x = random_vectors((8, dim))
    a = random_rotation(dim, seed=7).apply(x)
    b = random_rotation(dim, seed=7).apply(x)
    c = random_rotation(dim, seed=8).apply(x)
    assert mx.array_equal(a, b).item()
    assert not np.allclose(np.array(a), np.array(c), atol=1e-3)


@pytest.mark.parametrize("dim", DIMS)
def test_state_round_trip(dim, tmp_path):
    rotation = random_rotation(dim, seed=9)
    path = str(tmp_path / "rotation.safetensors")
    mx.save_safetensors(path, rotation.state())
    rebuilt = rotation_from_state(mx.load(path))
    assert type(rebuilt) is type(rotation) and rebuilt.dim == dim
    x = random_vectors((4, 6, dim))
    assert mx.array_equal(rebuilt.apply(x), rotation.apply(x)).item()
    assert mx.array_equal(rebuilt.invert(x), rotation.invert(x)).item()


@pytest.mark.parametrize("base", [1, 12])
def test_mlx_hadamard_assumed_symmetric_is_symmetric(base):
    # HadamardRotation inverts these dims by re-applying the transform.
    for dim in (base * 4, base * 8, base * 16):
        h = np.array(mx.hadamard_transform(mx.eye(dim)))
        np.testing.assert_allclose(h, h.T, atol=1e-6)


def test_hadamard_entries_are_signed_constants():
    r = as_matrix(HadamardRotation(80, seed=0))
    np.testing.assert_allclose(np.abs(r), np.full((80, 80), 80**-0.5), rtol=1e-5)


def test_gaussian_projection():
    p = gaussian_projection(256, 128, seed=0)
    assert p.shape == (256, 128) and p.dtype == mx.float32
    assert mx.array_equal(p, gaussian_projection(256, 128, seed=0)).item()
    assert not mx.array_equal(p, gaussian_projection(256, 128, seed=1)).item()
    values = np.array(p)
    assert abs(values.mean()) < 0.02 and abs(values.std() - 1) < 0.02


def test_projection_independent_of_rotation_with_same_seed():
    dense = np.array(DenseRotation(64, seed=0).matrix)
    q, _ = np.linalg.qr(np.array(gaussian_projection(64, 64, seed=0), dtype=np.float64))
    assert not np.allclose(np.abs(dense), np.abs(q), atol=1e-3)


def test_errors():
    with pytest.raises(ValueError):
        HadamardRotation(72, seed=0)
    with pytest.raises(ValueError):
        random_rotation(0, seed=0)
    with pytest.raises(ValueError):
        random_rotation(64, seed=-1)
    with pytest.raises(ValueError):
        rotation_from_state({"something": mx.zeros((3,))})
