"""Outlier channels for any method: `outliers=K` (keys), `value_outliers=K` (values).

Keys of most models carry a few channels far larger than the rest, in fixed positions
(KIVI Sec. 3.2; KVQuant, arXiv 2401.18079, Sec. 3.4 keeps them dense-and-sparse). A
calibration (`veloxquant calibrate`) picks each head's top-K channels by RMS; this codec
stores them as int8 with one fp16 scale per token and head (symmetric, scale = max|x|/127),
and hands the other D - K channels to the chosen method's codec, built at dim D - K.

The domain is [base domain of the rest | the K outlier channels]:

    to_domain(x)   = [A_base S_rest^T x ; S_out^T x]      S_rest (D, D-K), S_out (D, K) one-hot
    from_domain(y) = S_rest A_base^T y_1 + S_out y_2

so (S_rest S_rest^T + S_out S_out^T = I) the map is an isometry whenever the base one is:
q.k = to_domain(q) . to_domain(k) and attention adds the int8 channels' scores and values
to the base codec's exactly. The selections differ per head: params are per layer, (H, D, K).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..formats import Format, fp16, packed
from ..packing import pack, unpack
from .codec import Codec

OUTLIER_PREFIX = "outliers."
INT8_MAX = 127


class CalibrationRequiredError(ValueError):
    """A method or option that learns from activations, used without an artifact dir."""


def calibration_needed(what: str) -> CalibrationRequiredError:
    return CalibrationRequiredError(
        f"{what} needs calibration: `veloxquant calibrate ... --out DIR` with the same cache options, "
        f"then artifact_dir=DIR (docs/methods.md)"
    )


def per_head(a: mx.array, x: mx.array) -> mx.array:
    """Per-head matrices a (H, p, q) shaped to right-multiply x, whose head axis is 1 of
    (B, H, T, D), (B, Hq, L, D) (query heads: kv head h // rep), (B, H, R, L, D), or 0 of
    (B*H, R, D) (the engine's merged partials)."""
    heads = a.shape[0]
    if x.ndim == 5:
        return a[:, None]
    if x.ndim == 4:
        n = x.shape[1]
        return a if n == heads else mx.repeat(a, n // heads, axis=0)
    if x.ndim == 3:
        return mx.tile(a, (x.shape[0] // heads, 1, 1))
    raise ValueError(f"per-head outlier channels cannot map an array of shape {x.shape}")


def selections(channels: mx.array, dim: int):
    """One-hot (H, D, K) for the outlier channels and (H, D, D-K) for the rest, in channel order."""
    heads, count = channels.shape
    eye = mx.eye(dim, dtype=mx.float32)
    out = eye[channels]  # (H, K, D)
    chosen = mx.sum(out, axis=1) > 0  # (H, D)
    rest_index = mx.argsort(chosen.astype(mx.int32), axis=-1)[:, : dim - count]  # stable: ascending channels
    rest = eye[mx.sort(rest_index, axis=-1)]  # (H, D-K, D)
    return out.swapaxes(-1, -2), rest.swapaxes(-1, -2)


class OutlierCodec(Codec):
    def __init__(self, base: Codec, channels: mx.array, dim: int):
        channels = channels.astype(mx.int32)
        if channels.ndim != 2 or int(mx.max(channels).item()) >= dim or int(mx.min(channels).item()) < 0:
            raise ValueError(f"outlier channels must be (heads, K) indices below {dim}, got shape {channels.shape}")
        self.base, self.channels = base, channels
        self.heads, self.count = channels.shape
        self.dim, self.domain_dim = dim, base.domain_dim + self.count
        self.out_select, self.rest_select = selections(channels, dim)
        base_fmt = base.format
        self.format = Format(
            f"{base_fmt.name}+outliers{self.count}", dim, self.domain_dim,
            base_fmt.fields + (packed("outlier_codes", self.count, 8), fp16("outlier_scale")),
            token_block=base_fmt.token_block, orthogonal_domain=base_fmt.orthogonal_domain,
        )
        self._base_names = tuple(f.name for f in base_fmt.fields)
        # A base whose map is one matrix for every head (a rotation, or none) folds into the selections:
        # A_h = [S_rest,h R^T | S_out,h] (D, D), so each map is one matmul, not six operations.
        self.domain_map = None
        if base.domain in ("rotation", "identity"):
            self.domain_map = mx.concatenate([base.to_domain(self.rest_select), self.out_select], axis=-1)
        if callable(getattr(base, "kernel_decode", None)):
            self.kernel_decode = self._kernel_decode  # the kernels decode it where they decode the base
        if callable(getattr(base, "kernel_encode", None)):
            self.kernel_encode = self._kernel_encode

    def _check_heads(self, x):
        if x.ndim == 4 and x.shape[1] != self.heads:
            raise ValueError(f"outlier channels were calibrated for {self.heads} kv heads, got {x.shape[1]}")

    def _split(self, fields):
        return {n: fields[n] for n in self._base_names}

    def encode(self, x):
        self._check_heads(x)
        x = x.astype(mx.float32)
        outliers = x @ per_head(self.out_select, x)
        scale = (mx.max(mx.abs(outliers), axis=-1, keepdims=True) / INT8_MAX).astype(mx.float16)
        scale32 = scale.astype(mx.float32)
        q = mx.round(outliers / mx.where(scale32 > 0, scale32, 1.0))
        codes = (mx.clip(q, -INT8_MAX, INT8_MAX) + INT8_MAX).astype(mx.uint8)
        fields = self.base.encode(x @ per_head(self.rest_select, x))
        fields.update(outlier_codes=pack(codes, 8), outlier_scale=scale)
        return fields

    def _outliers(self, fields):
        codes = unpack(fields["outlier_codes"], 8, self.count).astype(mx.float32) - INT8_MAX
        return codes * fields["outlier_scale"].astype(mx.float32)

    def decode(self, fields):
        return mx.concatenate([self.base.decode(self._split(fields)), self._outliers(fields)], axis=-1)

    def _kernel_decode(self, a):
        """The kernels' element j (`kernels/dequant.py`): the base's snippet for j < n (its domain),
        in a scope of its own, so that its code loads run only there; `_outliers`'s element after."""
        n = self.base.domain_dim
        first = len(a.lines)
        value = self.base.kernel_decode(a)  # emits its code loads into a.lines first
        base = "\n".join(a.lines[first:] + ["    " + value])
        del a.lines[first:]
        code = a.code("outlier_codes", f"(j < {n} ? 0 : j - {n})")
        return (f"if (j < {n}) {{\n{base}\n    }} else {{ v = ((float){code} - {INT8_MAX}.0f) * "
                f"{a.half('outlier_scale', '0')}; }}")

    def _kernel_encode(self, e):
        """The encode kernel's element t (`kernels/encode.py`): `encode`'s int8 outlier channels (the
        head's channel t < K, its scale the block's max |x| / 127 in fp16), then the base's snippet, in
        a scope where the vector is the head's other D - K channels (thread t < D - K holds the t-th)."""
        n, count = self.base.domain_dim, self.count
        head = e.head()
        rest = e.table(np.array(mx.argmax(self.rest_select, axis=1)).astype(np.float32).reshape(-1))  # (H, D - K)
        out = e.table(np.array(self.channels).astype(np.float32).reshape(-1))  # (H, K)
        vec = e.shared(e.x)
        x_rest, x_out = e.var(), e.var()
        e.emit(f"const float {x_rest} = t < {n} ? {vec}[(int){rest}[{head} * {n} + t]] : 0.0f;")
        e.emit(f"const float {x_out} = t < {count} ? {vec}[(int){out}[{head} * {count} + t]] : 0.0f;")
        e.emit("VQ_SYNC();")  # vq_buf is written again by the next helper
        peak = e.maximum(f"VQ_ABSF({x_out})")
        scale, q = e.var(), e.var()
        e.emit(f"const float {scale} = VQ_F(VQ_CAST(vq_half, {peak} / {INT8_MAX}.0f));")
        e.emit(f"float {q} = VQ_ROUND({x_out} / ({scale} > 0.0f ? {scale} : 1.0f));")
        e.emit(f"{q} = {q} < -{INT8_MAX}.0f ? -{INT8_MAX}.0f : ({q} > {INT8_MAX}.0f ? {INT8_MAX}.0f : {q});")
        e.code("outlier_codes", f"(uint32_t)({q} + {INT8_MAX}.0f)")
        e.half("outlier_scale", scale)
        x, codec = e.x, e.codec
        e.x, e.codec = x_rest, self.base  # the base's fields have the same names and widths here
        try:
            with e.within(n):
                self.base.kernel_encode(e)
        finally:
            e.x, e.codec = x, codec

    def to_domain(self, x):
        x = x.astype(mx.float32)
        if self.domain_map is not None:
            return x @ per_head(self.domain_map, x)
        rest = self.base.to_domain(x @ per_head(self.rest_select, x))
        return mx.concatenate([rest, x @ per_head(self.out_select, x)], axis=-1)

    def from_domain(self, y):
        if self.domain_map is not None:
            return y @ per_head(self.domain_map.swapaxes(-1, -2), y)
        n = self.base.domain_dim
        rest = self.base.from_domain(y[..., :n])
        out = y[..., n:]
        return rest @ per_head(self.rest_select.swapaxes(-1, -2), rest) + out @ per_head(
            self.out_select.swapaxes(-1, -2), out)

    def score(self, queries, fields):
        n = self.base.domain_dim
        base = self.base.score(queries[..., :n], self._split(fields))
        return base + queries[..., n:] @ self._outliers(fields).swapaxes(-1, -2)

    def weighted_sum(self, weights, fields):
        base = self.base.weighted_sum(weights, self._split(fields))
        out = weights @ mx.expand_dims(self._outliers(fields), 2)
        return mx.concatenate([base, out], axis=-1)

    def params(self):
        return {**self.base.params(), OUTLIER_PREFIX + "channels": self.channels}


def outlier_codec(method, role: str, config, dim: int, count: int, params, base_params) -> OutlierCodec:
    option = "outliers" if role == "keys" else "value_outliers"
    channels = (params or {}).get(OUTLIER_PREFIX + "channels")
    if channels is None:
        raise calibration_needed(f"option {option}={count}")
    if channels.shape[-1] != count:
        raise ValueError(f"the artifact holds {channels.shape[-1]} outlier channels per head, the config asks {count}")
    if not 0 < count < dim:
        raise ValueError(f"{option} must be in 1..{dim - 1} for head dim {dim}, got {count}")
    make = method.key_codec if role == "keys" else method.value_codec
    return OutlierCodec(make(config, dim - count, base_params), channels, dim)


def top_channels(x: mx.array, count: int) -> mx.array:
    """Each head's `count` channels of largest RMS over the calibration tokens: x (H, N, D) -> (H, K)."""
    rms = mx.mean(x.astype(mx.float32) ** 2, axis=1)
    return mx.sort(mx.argsort(-rms, axis=-1)[:, :count], axis=-1).astype(mx.int32)
