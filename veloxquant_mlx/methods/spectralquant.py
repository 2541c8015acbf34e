"""SpectralQuant: a learned PCA basis per layer and head instead of a random rotation.

calibrate: for each layer, role and kv head, the eigenvectors U of E[u u^T] over the
         captured unit vectors u = x / ||x|| (keys after RoPE, as the cache sees them),
         sorted by variance sigma_j^2 (descending), and sigma_j.
encode:  y = U^T x / ||x||; the first r coordinates (high variance) get b_hi bits, the
         other D - r get b_lo bits, each coordinate a Gaussian Lloyd-Max codebook scaled
         by its sigma_j; (r, b_hi, b_lo) minimise the expected error
         sum_j sigma_j^2 mse_gauss(b_j) under r b_hi + (D - r) b_lo = b D (r a multiple of
         32, so both code fields fill whole words), i.e. reverse water-filling over the
         spectrum restricted to two widths;
store:   `codes_hi` (r x b_hi bits), `codes` ((D - r) x b_lo bits), `norm` (fp16): the same
         bits per token as `turboquant_mse` at b;
attend:  domain = the PCA coordinates (orthogonal, per head): scores (U^T q) . y^.

This is the ablation the randomized Hadamard basis is measured against: same bits, same
norm, same Lloyd-Max scalar codes; only the basis and the widths differ.
"""

from __future__ import annotations

from typing import List, Optional

import mlx.core as mx
import numpy as np

from ..codebooks import dequantize, lloyd_max, quantize
from ..formats import Format, fp16, packed
from ..packing import pack, unpack
from .base import Codec, Method, register_method, split_width_centroid
from .outliers import calibration_needed, per_head

GRID_CODES = 32


def _gauss_mse(bits: int) -> float:
    return lloyd_max("gaussian", bits).mse if bits >= 1 else 1.0


def choose_split(variances: np.ndarray, bits: int, dim: int):
    """(r, b_hi, b_lo) of least expected error sum_j var_j mse(b_j) at an average of `bits`."""
    best = (float(np.sum(variances) * _gauss_mse(bits)), 0, bits, bits)
    for r in range(GRID_CODES, dim, GRID_CODES):
        for hi in range(bits + 1, 9):
            total = bits * dim - r * hi
            if total % (dim - r):
                continue
            lo = total // (dim - r)
            if lo < 1:
                continue
            err = float(np.sum(variances[:r]) * _gauss_mse(hi) + np.sum(variances[r:]) * _gauss_mse(lo))
            if err < best[0]:
                best = (err, r, hi, lo)
    return best[1:]


class SpectralCodec(Codec):
    def __init__(self, dim: int, bits: int, params):
        self.dim = self.domain_dim = dim
        self.basis = params["heads.basis"].astype(mx.float32)  # (H, D, D): columns = components
        self.sigma = params["heads.sigma"].astype(mx.float32)  # (H, D)
        self.heads = self.basis.shape[0]
        self.high, self.hi_bits, self.lo_bits = (int(v) for v in params["split"].tolist())
        self.books = {b: lloyd_max("gaussian", b) for b in {self.hi_bits, self.lo_bits}}
        fields = [packed("codes_hi", self.high, self.hi_bits)] if self.high else []
        fields += [packed("codes", dim - self.high, self.lo_bits), fp16("norm")]
        self.format = Format(f"spectral_{bits}", dim, dim, tuple(fields))
        self._params = params

    def _parts(self):
        parts = [("codes_hi", 0, self.high, self.hi_bits)] if self.high else []
        return parts + [("codes", self.high, self.dim, self.lo_bits)]

    def _sigma(self, x):
        return per_head(self.sigma[:, None, :], x)  # (H, 1, D), placed as per_head places the basis

    def encode(self, x):
        if x.shape[1] != self.heads:
            raise ValueError(f"spectralquant was calibrated for {self.heads} kv heads, got {x.shape[1]}")
        x = x.astype(mx.float32)
        norm = mx.sqrt(mx.sum(x * x, axis=-1, keepdims=True))
        y = (x @ per_head(self.basis, x)) / mx.maximum(norm, 1e-30) / self._sigma(x)
        fields = {}
        for name, a, b, bits in self._parts():
            book = self.books[bits]
            codes = quantize(y[..., a:b], book.boundaries)
            fields[name] = pack(codes, bits)
        fields["norm"] = norm.astype(mx.float16)
        return fields

    def decode(self, fields):
        parts = [dequantize(unpack(fields[name], bits, b - a), self.books[bits].centroids)
                 for name, a, b, bits in self._parts()]
        y = mx.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]
        return y * self.sigma[:, None, :] * fields["norm"].astype(mx.float32)

    def kernel_decode(self, a):
        """The kernels' element j (`kernels/dequant.py`): `decode`'s c[code_j] * sigma_j * norm, with
        sigma from the row of kv head bh % H (the kernels' row bh is batch * H + head)."""
        value = split_width_centroid(a, self._parts(), self.books)
        sigma = a.table(np.array(self.sigma).reshape(-1))
        return f"v = {value} * {sigma}[(bh % {self.heads}) * {self.dim} + j] * {a.half('norm', '0')};"

    def kernel_encode(self, e):
        """The encode kernel's element t (`kernels/encode.py`): `encode`'s steps, coordinate t of the
        token's head's basis (a dot product over the vector in shared memory), then its part's codes."""
        head = e.head()
        vector = e.shared(e.x)
        basis = e.table(np.array(self.basis).reshape(-1))  # (H, D, D), column t = component t
        projected = e.var()
        e.emit(f"float {projected} = 0.0f;")
        e.emit(f"if (act) for (int i_ = 0; i_ < D; ++i_) {projected} += {vector}[i_] * {basis}[({head} * D + i_) * D + t];")
        norm, y = e.var(), e.var()
        e.emit(f"const float {norm} = VQ_SQRT({e.sum(f'{e.x} * {e.x}')});")
        sigma = e.table(np.array(self.sigma).reshape(-1))
        e.emit(f"const float {y} = act ? {projected} / VQ_MAXF({norm}, 1e-30f) / {sigma}[{head} * D + t] : 0.0f;")
        for name, start, stop, bits in self._parts():
            e.code(name, e.nearest(y, self.books[bits].boundaries), index=f"t - {start}")
        e.half("norm", norm)

    def to_domain(self, x):
        return x.astype(mx.float32) @ per_head(self.basis, x)

    def from_domain(self, y):
        return y @ per_head(self.basis.swapaxes(-1, -2), y)

    def params(self):
        return dict(self._params)


def learn_basis(x: mx.array, bits: int) -> dict:
    """x (H, N, D) -> params: per-head PCA basis and sigma of unit vectors, and the width split."""
    u = x / mx.maximum(mx.sqrt(mx.sum(x * x, axis=-1, keepdims=True)), 1e-30)
    cov = np.array((u.swapaxes(-1, -2) @ u) / u.shape[1]).astype(np.float64)  # (H, D, D)
    values, vectors = np.linalg.eigh(cov)
    order = np.argsort(-values, axis=-1)
    values = np.take_along_axis(values, order, axis=-1)
    vectors = np.take_along_axis(vectors, order[:, None, :], axis=-1)
    values = np.maximum(values, 1e-12)
    dim = x.shape[-1]
    high, hi, lo = choose_split(values.mean(axis=0), bits, dim)
    return {"heads.basis": mx.array(vectors.astype(np.float32)), "heads.sigma": mx.array(np.sqrt(values).astype(np.float32)),
            "split": mx.array([high, hi, lo], mx.int32)}


@register_method("spectralquant")
class SpectralQuant(Method):
    key_bits = range(1, 9)
    value_bits = range(1, 9)
    calibrated = True
    status = "experimental"
    status_note = "worse than turboquant_mse (Hadamard basis) at equal bits (docs/methods.md)"
    summary = "per-head PCA basis (calibrated) + two widths by variance + Gaussian Lloyd-Max + fp16 norm"
    values_summary = "same at value_bits"

    @classmethod
    def _codec(cls, role, dim, bits, params):
        if not params or "heads.basis" not in params:
            raise calibration_needed(f"spectralquant ({role})")
        return SpectralCodec(dim, bits, params)

    @classmethod
    def key_codec(cls, config, dim, params=None):
        return cls._codec("keys", dim, config.bits, params)

    @classmethod
    def value_codec(cls, config, dim, params=None):
        return cls._codec("values", dim, config.value_bits, params)

    @classmethod
    def calibrate(cls, config, layers, progress=None) -> Optional[List[dict]]:
        return [None if layer is None else {"keys": learn_basis(layer["keys"], config.bits),
                                            "values": learn_basis(layer["values"], config.value_bits)}
                for layer in layers]
