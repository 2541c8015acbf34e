"""Smoothed keys for any method: option `smooth_keys=ALPHA` (0 < ALPHA <= 1, calibrated).

A data-oblivious key code (a random rotation, then codes) leaves an error e that is about
isotropic, so its score error q . e weighs every channel alike, while SmolLM2's keys and
queries put most of their energy in a few channels. With per-channel scales s, the base
codec codes k / s and queries enter as q * s, so (q * s) . (k / s) = q . k before
quantization, and the isotropic error e' of the scaled key reaches the score as
(q * s) . e'. For channel RMS k_j, q_j:

    E[((q * s) . e')^2]  ~  sum_j q_j^2 s_j^2  *  sum_j k_j^2 / s_j^2

which s_j^2 = k_j / q_j minimises (Cauchy-Schwarz), giving (sum_j q_j k_j)^2 instead of
sum_j q_j^2 * sum_j k_j^2. That is SmoothQuant's migration (arXiv 2211.10438, Eq. 4,
s_j = k_j^alpha / q_j^(1 - alpha)) at alpha = 0.5, with RMS for max as KVQuant's per-channel
key handling (arXiv 2401.18079, Sec. 3.1) and VecInfer's smooth scaling (arXiv 2510.06175)
motivate. The key RMS is taken after centering when the config centres keys, since the codec
then sees centred keys.

The domain map is A = A_base diag(s): to_domain(q) = A_base (s * q), from_domain(y) =
s * A_base^T y (the adjoint), so the scores of the codes are exact in the domain, but A is
not orthogonal: the format says so. A domain element is the base codec's, so the base's decode
snippet serves the formats' kernels as it is (`kernel_decode`): they score queries mapped by
`to_domain` and keep the fp16 sinks / window as held, as for a sketch (`engine.keys_in_query_space`).
The base's own kernel family ("mse") is not named, as its kernels take raw queries and keys; they
read the base's codes (`codes_codec`) instead: the CPU's C++ kernel with queries mapped by
`to_domain`, the GPU decode steps with the scales as an input (queries as q * s before the
in-kernel rotation, the new key encoded as k / s; `kernels/templates.py`, KSC).
Values are never smoothed (they meet attention probabilities, not queries).
Params: "smooth.scale" (H, D), one row per kv head.
"""

from __future__ import annotations

import mlx.core as mx

from ..formats import Format
from .codec import Codec
from .outliers import calibration_needed, per_head

SMOOTH_PREFIX = "smooth."
SCALE = SMOOTH_PREFIX + "scale"
_FLOOR = 1e-6


class SmoothedKeyCodec(Codec):
    def __init__(self, base: Codec, scale: mx.array):
        if scale.ndim != 2 or scale.shape[1] != base.dim:
            raise ValueError(f"smoothing scales must be (kv heads, {base.dim}), got shape {scale.shape}")
        if base.positional:
            raise ValueError("smooth_keys scales post-RoPE channels; a positional key codec (commvq) codes "
                             "keys before RoPE, where those scales do not apply")
        self.base = base
        self.scale = scale.astype(mx.float32)
        self.heads = scale.shape[0]
        self.dim, self.domain_dim = base.dim, base.domain_dim
        self.positional = base.positional
        fmt = base.format
        self.format = Format(f"{fmt.name}+smooth", fmt.dim, fmt.domain_dim, fmt.fields,
                             token_block=fmt.token_block, orthogonal_domain=False)
        self.codes_codec = base  # whose codes and domain elements these are (`kernels.ops.codes_codec`)
        if callable(getattr(base, "kernel_decode", None)):
            self.kernel_decode = base.kernel_decode  # the element of the base's domain (module docstring)

    def encode(self, x):
        if x.ndim == 4 and x.shape[1] != self.heads:
            raise ValueError(f"smoothing scales were calibrated for {self.heads} kv heads, got {x.shape[1]}")
        return self.base.encode(unscale_keys(x, self.scale))

    def position_free(self, x, first):
        return self.base.position_free(x, first)

    def decode(self, fields):
        return self.base.decode(fields)

    def to_domain(self, x):
        return self.base.to_domain(scale_queries(x, self.scale))

    def from_domain(self, y):
        return scale_queries(self.base.from_domain(y), self.scale)

    def score(self, queries, fields):
        return self.base.score(queries, fields)

    def params(self):
        return {**self.base.params(), SCALE: self.scale}


def scale_queries(x: mx.array, scale: mx.array) -> mx.array:
    """x * s in float32, s (H, D) per kv head, for queries (or the domain's adjoint) of any layout
    `outliers.per_head` takes."""
    return x.astype(mx.float32) * per_head(scale[:, None, :], x)


def unscale_keys(x: mx.array, scale: mx.array) -> mx.array:
    """x / s in float32: keys as the base codec codes them."""
    return x.astype(mx.float32) / per_head(scale[:, None, :], x)


def smoothed_key_codec(base: Codec, alpha: float, params) -> SmoothedKeyCodec:
    scale = (params or {}).get(SCALE)
    if scale is None:
        raise calibration_needed(f"option smooth_keys={alpha:g}")
    return SmoothedKeyCodec(base, scale)


def smoothing_scales(keys: mx.array, queries: mx.array, alpha: float, center: bool) -> mx.array:
    """keys (H, N, D), queries (Hq, N, D) -> s (H, D) = k_rms^alpha / q_rms^(1 - alpha), the query
    RMS over the kv head's query heads, the key RMS of centred keys when `center`; scaled to a
    geometric mean of 1 per head (the scores do not depend on it; the codes' norms stay in range)."""
    heads, _, dim = keys.shape
    keys = keys.astype(mx.float32)
    if center:
        keys = keys - mx.mean(keys, axis=1, keepdims=True)
    rep = queries.shape[0] // heads
    key_rms = mx.sqrt(mx.mean(keys * keys, axis=1))
    grouped = queries.astype(mx.float32).reshape(heads, rep * queries.shape[1], dim)
    query_rms = mx.sqrt(mx.mean(grouped * grouped, axis=1))
    log_scale = alpha * mx.log(mx.maximum(key_rms, _FLOOR)) - (1.0 - alpha) * mx.log(mx.maximum(query_rms, _FLOOR))
    return mx.exp(log_scale - mx.mean(log_scale, axis=-1, keepdims=True))
