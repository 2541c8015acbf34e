"""Data-aware codes: GPTQ error feedback (Frantar et al., arXiv 2210.17323, Alg. 1) in the
rotated domain, on the same Lloyd-Max grid and storage as the data-free codes.

The layer computes (x c R^T)(W/c R^T)^T (`linear.py`), so the loss of a quantized rotated
weight W'_hat is || (W' - W'_hat) X'^T ||^2 with X' = R (c * x) over calibration inputs x:
the Hessian is H' = X'^T X', formed in float64 from the rotated inputs (so that it is
positive semi-definite to rounding, whatever the activations' outliers). Columns are coded left to right on each row's grid t * centroids (t = ||w|| rms(u),
the data-free scale) and each column's error is spread over the columns not yet coded,
through the Cholesky factor of H'^-1 (lazy batches of `BLOCK` columns, Sec. 4 "Step 2").
The row scale is then refitted on the data: s = <W' H', q> / <q H', q> for the codes'
centroids q, which minimises the same loss for the chosen codes.

Quantisation-time only (NumPy float64); the stored layer is an ordinary `QuantizedLinear`.
"""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .rotation import StructuredRotation

BLOCK = 128
DAMP = 0.01  # fraction of the mean diagonal added to H' (the paper's lambda)


def rotated_hessian(inputs: mx.array, rotation: StructuredRotation, input_scales: Optional[mx.array]) -> np.ndarray:
    """H' = X'^T X' (float64) of the calibration inputs X (tokens, in) as the layer rotates them."""
    x = inputs.astype(mx.float32)
    if input_scales is not None:
        x = x * input_scales.astype(mx.float32)
    rotated = np.array(rotation.apply(x), dtype=np.float64)
    return rotated.T @ rotated


def gptq_codes(weight: np.ndarray, hessian: np.ndarray, centroids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes (out, in) uint8, scales (out,)) of the rotated rows `weight` (float64)."""
    w = weight.copy()
    out_features, n = w.shape
    h = hessian.copy()
    dead = np.diag(h) <= 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h[np.diag_indices(n)] += DAMP * np.mean(np.diag(h))
    try:
        upper = np.linalg.cholesky(np.linalg.inv(h)).T  # H^-1 = U^T U
    except np.linalg.LinAlgError as error:
        raise ValueError(f"GPTQ: the damped Hessian is not positive definite ({error}); "
                         "use more calibration tokens") from None
    norms = np.sqrt((weight * weight).sum(axis=1))
    step = norms * np.sqrt(((weight / np.maximum(norms, 1e-30)[:, None]) ** 2).mean(axis=1))
    step = np.maximum(step, 1e-30)
    midpoints = (centroids[1:] + centroids[:-1]) * 0.5
    codes = np.zeros((out_features, n), dtype=np.uint8)
    for b0 in range(0, n, BLOCK):
        b1 = min(n, b0 + BLOCK)
        block = w[:, b0:b1].copy()
        errors = np.zeros_like(block)
        u = upper[b0:b1, b0:b1]
        for i in range(b1 - b0):
            column = block[:, i]
            k = np.searchsorted(midpoints, column / step).astype(np.uint8)
            codes[:, b0 + i] = k
            error = (column - step * centroids[k]) / u[i, i]
            block[:, i:] -= np.outer(error, u[i, i:])
            errors[:, i] = error
        w[:, b1:] -= errors @ upper[b0:b1, b1:]
    q = centroids[codes]
    scales = ((weight @ hessian) * q).sum(axis=1) / np.maximum(((q @ hessian) * q).sum(axis=1), 1e-30)
    return codes, scales


class CalibratingLinear(nn.Module):
    """Stands in for a float linear layer during one calibration forward pass: the first call
    quantizes the layer on its actual inputs (which come from the layers
    quantized before it, as in GPTQ's sequential mode) and every call runs the quantized layer."""

    def __init__(self, make: Callable[[mx.array], nn.Module]):
        super().__init__()
        self._make = make
        self._done = None

    @property
    def quantized(self):
        return self._done

    def __call__(self, x: mx.array) -> mx.array:
        if self._done is None:
            flat = x.reshape(-1, x.shape[-1]).astype(mx.float32)
            mx.eval(flat)
            self._done = self._make(flat)
            mx.eval(self._done.parameters())
        return self._done(x)


CALIBRATION_ROW = 256  # tokens per calibration sequence


def calibration_tokens(tokenizer, n_tokens: int, text_path: Optional[str] = None) -> mx.array:
    """(n_tokens / CALIBRATION_ROW, CALIBRATION_ROW) token ids: the first tokens of `text_path`,
    by default the text shipped in the package (veloxquant_mlx/data/python-reference.txt)."""
    from ..texts import load_text, sample_text_path, tokenize_prefix

    if n_tokens < CALIBRATION_ROW or n_tokens % CALIBRATION_ROW:
        raise ValueError(f"calibration tokens must be a positive multiple of {CALIBRATION_ROW}, got {n_tokens}")
    text = load_text(str(text_path) if text_path else str(sample_text_path()))
    ids = tokenize_prefix(tokenizer, text, n_tokens)
    return mx.array(ids).reshape(n_tokens // CALIBRATION_ROW, CALIBRATION_ROW)
