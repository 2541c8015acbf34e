"""VecInfer (Yao et al., arXiv 2510.06175): smooth scaling, Hadamard rotation, product VQ of keys.

calibrate: per layer and kv head, smoothing factors over the key channels,
             s_j = max|K_j|^alpha / max|Q_j|^(1 - alpha)
           (SmoothQuant, arXiv 2211.10438, Eq. 4, keys in the activation's place and the
           head's queries in the weight's; `alpha`, default 0.5; `smooth=False`: s = 1), then
           k-means codebooks C_m (2^c centroids of `sub_dim` coordinates), one per head and
           sub-vector m, of the captured keys u = R (k / s), R the seeded randomized Hadamard
           rotation (paper Sec. 3.2: the dual transformation spreads the outlier channels
           before the codebooks are learned).
encode:    code_m = argmin_c ||u_m - C_m[c]||^2 = argmin_c ||C_m[c]||^2 - 2 u_m . C_m[c]: one
           matmul per chunk of tokens, never a [tokens, centroids, sub_dim] difference tensor.
store:     `codes`: D / sub_dim codes of c bits per token and head, packed (c = 8: one byte per
           sub-vector). The codebooks live in the artifact dir, not in the cache.
attend:    the key domain is A q = R (s * q), so A q . R (k / s) = q . k exactly before
           quantization (R orthogonal, the smoothing cancels); A is not orthogonal, so the
           format says so. score(q, codes) = sum_m LUT_m[code_m] with the per-query look-up
           table LUT_m[c] = (A q)_m . C_m[c] (paper Sec. 3.3): 2^c x D / sub_dim products per
           query instead of decoding every key.

Key bits per coordinate are c / sub_dim: `bits` b with the defaults sub_dim = 8 // b and
c = b * sub_dim (b = 1: 256 centroids of 8 coordinates; b = 2: 256 of 4). Other widths through
the options, e.g. sub_dim=4, centroid_bits=6 for 1.5 bits (then bits = 2, the width rounded up).

Values: `values=mse` (default) TurboQuant-MSE at `value_bits` (its seeded rotation and
Lloyd-Max codebook are stored in the artifact); `values=vq` the same rotation + product VQ at
`value_bits` with no smoothing (values meet attention probabilities, not queries; the domain
stays orthogonal, so centering and the fused prefill apply).
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional

import mlx.core as mx
import numpy as np

from ..formats import Format, packed
from ..packing import pack, unpack
from ..rotations import HadamardRotation, rotation_from_params, rotation_params
from .base import Codec, Method, register_method
from .outliers import calibration_needed, per_head

KMEANS_ITERATIONS = 10
_KMEANS_STREAM = 7  # numpy rng stream of the k-means++ draws (rotations use 1..3)
# Elements of one distance block (groups x tokens x centroids), bounded by chunking the tokens.
BLOCK_ELEMENTS = 1 << 22
# k-means over whole layers on the CPU: blocks that stay in cache (the search is memory-bound there).
KMEANS_BLOCK_ELEMENTS = 1 << 18
VALUE_CODECS = ("mse", "vq")


# ---- nearest centroid and k-means, batched over groups (head x sub-vector) ------------------------

@mx.compile
def _nearest_block(x, transposed, norms):
    return mx.argmin(norms - 2.0 * (x @ transposed), axis=-1)


def nearest_centroid(x: mx.array, centroids: mx.array, block: int = BLOCK_ELEMENTS) -> mx.array:
    """x (G, N, d), centroids (G, K, d) -> (G, N) uint32 indices of the nearest centroid.

    ||x - c||^2 = ||x||^2 + ||c||^2 - 2 x.c, and ||x||^2 does not change the argmin: one matmul
    per chunk of tokens, each chunk's (G, chunk, K) distances bounded by `block` elements."""
    groups, n, _ = x.shape
    norms = mx.sum(centroids * centroids, axis=-1)[:, None, :]  # (G, 1, K)
    transposed = centroids.swapaxes(-1, -2)
    chunk = max(1, block // max(1, groups * centroids.shape[1]))
    parts = [_nearest_block(x[:, a : a + chunk], transposed, norms) for a in range(0, n, chunk)]
    codes = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)
    return codes.astype(mx.uint32)


def centroid_sums(x: mx.array, codes: mx.array, count: int):
    """Per centroid: the sum of its points (G, K, d) and how many there are (G, K), by a
    scatter-add over every point (no (G, N, K) one-hot, no (G, N, K, d) tensor)."""
    groups, n, d = x.shape
    rows = (codes + mx.arange(groups, dtype=mx.uint32)[:, None] * count).reshape(-1)
    sums = mx.zeros((groups * count, d), mx.float32).at[rows].add(x.reshape(-1, d))
    counts = mx.zeros((groups * count,), mx.float32).at[rows].add(1.0)
    return sums.reshape(groups, count, d), counts.reshape(groups, count)


def kmeans_plus_plus(x: np.ndarray, count: int, seed: int = 0) -> np.ndarray:
    """Greedy k-means++ seeding (Arthur & Vassilvitskii 2007, Sec. 6; as scikit-learn) in every
    group at once: each step draws 2 + ln(count) candidates with probability proportional to
    their squared distance to the nearest centroid so far and keeps the one that lowers the
    total distance most. x (G, N, d) -> (G, count, d). numpy: `count` small sequential steps
    (calibration only). The draws are made up front, so the groups split over threads (numpy
    releases the GIL) give the same seeds as one pass."""
    groups, n, _ = x.shape
    trials = 2 + int(math.log(count))
    rng = np.random.default_rng([int(seed), _KMEANS_STREAM])
    first = rng.integers(0, n, groups)
    draws = rng.random((count - 1, groups, trials))  # the same stream as one (groups, trials) draw per step
    parts = np.array_split(np.arange(groups), min(groups, os.cpu_count() or 1))
    with ThreadPoolExecutor(len(parts)) as pool:
        seeds = pool.map(lambda rows: _greedy_seeds(x[rows], count, first[rows], draws[:, rows]), parts)
        return np.concatenate(list(seeds), axis=0)


def _greedy_seeds(x: np.ndarray, count: int, first: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """kmeans_plus_plus on groups x (G, N, d) with its first picks (G,) and uniform draws
    (count - 1, G, trials), on one reused (G, trials, N) buffer."""
    groups, n, dim = x.shape
    trials = draws.shape[-1]
    rows = np.arange(groups)
    squares = np.sum(x * x, axis=-1)[:, None, :]  # (G, 1, N)
    points_last = np.ascontiguousarray(x.transpose(0, 2, 1))  # (G, d, N)
    offsets = rows[:, None].astype(np.float64)

    def distances(points, out):  # (G, L, d) -> squared distances (G, L, N) in `out`, by the norm expansion
        np.matmul(-2.0 * points, points_last, out=out)
        out += squares
        out += np.sum(points * points, axis=-1)[:, :, None]
        return out  # may dip below 0 by rounding: `dist` is clipped where it feeds the draws

    work = np.empty((groups, trials, n), np.float32)
    chosen = np.empty((groups, count, dim), np.float32)
    chosen[:, 0] = x[rows, first]
    dist = np.maximum(distances(chosen[:, :1], np.empty((groups, 1, n), np.float32))[:, 0], 0.0)
    for i in range(1, count):
        cumulative = np.cumsum(dist, axis=1)
        targets = draws[i - 1] * cumulative[:, -1:]
        # the first point whose running total reaches each draw, in every group at once: one
        # search in the groups' running totals laid end to end (group g shifted by g * span)
        span = 2.0 ** np.ceil(np.log2(float(cumulative[:, -1].max()) + 1.0))
        ends = (cumulative + offsets * span).ravel()
        picks = np.searchsorted(ends, (targets + offsets * span).ravel()).reshape(groups, trials)
        candidates = x[rows[:, None], np.minimum(picks - rows[:, None] * n, n - 1)]  # (G, L, d)
        after = np.minimum(distances(candidates, work), dist[:, None, :], out=work)
        best = np.argmin(after.sum(axis=-1), axis=-1)
        chosen[:, i] = candidates[rows, best]
        dist = np.maximum(after[rows, best], 0.0)
    return chosen


def kmeans(x: mx.array, count: int, iterations: int = KMEANS_ITERATIONS, seed: int = 0) -> mx.array:
    """Lloyd's k-means in every group at once from k-means++ seeds: x (G, N, d) -> centroids
    (G, count, d). A centroid that loses all its points keeps its place."""
    if x.shape[1] < count:
        raise ValueError(f"k-means with {count} centroids needs at least {count} calibration tokens, got {x.shape[1]}")
    centroids = mx.array(kmeans_plus_plus(np.array(x, dtype=np.float32), count, seed))
    for _ in range(iterations):
        sums, counts = centroid_sums(x, nearest_centroid(x, centroids, KMEANS_BLOCK_ELEMENTS), count)
        centroids = mx.where(counts[..., None] > 0, sums / mx.maximum(counts, 1.0)[..., None], centroids)
        mx.eval(centroids)
    return centroids


# ---- the codec ------------------------------------------------------------------------------------

class ProductVQCodec(Codec):
    """Optional per-head smoothing, the Hadamard rotation, product VQ with per-head, per-sub-vector
    codebooks (module docstring). params: "heads.codebooks" (H, S, 2^c, sub_dim), optional
    "heads.smooth" (H, D), the rotation's signs."""

    def __init__(self, dim: int, centroid_bits: int, params, name: str = "vecinfer"):
        books = params["heads.codebooks"]
        self.heads, self.subvectors, self.centroids, self.sub_dim = books.shape
        if self.subvectors * self.sub_dim != dim or self.centroids != 1 << centroid_bits:
            raise ValueError(f"vecinfer codebooks of shape {books.shape} do not fit head dim {dim} at "
                             f"{centroid_bits} bits per sub-vector")
        self.dim = self.domain_dim = dim
        self.centroid_bits = centroid_bits
        self.codebooks = books.astype(mx.float32)
        self.smooth = params["heads.smooth"].astype(mx.float32) if "heads.smooth" in params else None
        self.rotation = rotation_from_params(params)
        # Row (h, m, c) of `table` is centroid c of sub-vector m of head h: decoding is one gather.
        self.table = self.codebooks.reshape(-1, self.sub_dim)
        self.offsets = (mx.arange(self.heads, dtype=mx.uint32)[:, None] * self.subvectors
                        + mx.arange(self.subvectors, dtype=mx.uint32)) * self.centroids  # (H, S)
        self._params = dict(params)
        self.format = Format(name, dim, dim, (packed("codes", self.subvectors, centroid_bits),),
                             orthogonal_domain=self.smooth is None)

    @property
    def bits_per_coordinate(self) -> float:
        return self.centroid_bits / self.sub_dim

    def _smooth(self, x):
        return per_head(self.smooth[:, None, :], x)  # (H, 1, D), placed as per_head places matrices

    def encode_map(self, x):
        """u = R (x / s): what the codebooks quantize. to_domain(q) . encode_map(k) = q . k, and
        from_domain inverts it (A^T = diag(s) R^T)."""
        x = x.astype(mx.float32)
        return self.rotation.apply(x / self._smooth(x) if self.smooth is not None else x)

    def encode(self, x):
        if x.shape[1] != self.heads:
            raise ValueError(f"vecinfer was calibrated for {self.heads} kv heads, got {x.shape[1]}")
        u = self.encode_map(x)
        B, H, T, _ = u.shape
        groups = u.reshape(B, H, T, self.subvectors, self.sub_dim).transpose(1, 3, 0, 2, 4)
        codes = nearest_centroid(groups.reshape(H * self.subvectors, B * T, self.sub_dim),
                                 self.codebooks.reshape(H * self.subvectors, self.centroids, self.sub_dim))
        codes = codes.reshape(H, self.subvectors, B, T).transpose(2, 0, 3, 1)  # (B, H, T, S)
        return {"codes": pack(codes, self.centroid_bits)}

    def _codes(self, fields):
        return unpack(fields["codes"], self.centroid_bits, self.subvectors).astype(mx.uint32)

    def decode(self, fields):
        codes = self._codes(fields)
        vectors = mx.take(self.table, codes + self.offsets[:, None, :], axis=0)  # (B, H, T, S, sub_dim)
        return vectors.reshape(*codes.shape[:-1], self.dim)

    def kernel_decode(self, a):
        """The kernels' element j (`kernels/dequant.py`): element j % sub_dim of centroid code_m of
        sub-vector m = j / sub_dim of kv head bh % H (the kernels' row bh is batch * H + head): the
        row `decode` gathers from `table`."""
        sub = self.sub_dim
        code = a.code("codes", f"j / {sub}")
        row = f"((bh % {self.heads}) * {self.subvectors} + j / {sub}) * {self.centroids} + {code}"
        return f"v = {a.table(np.array(self.table).reshape(-1))}[({row}) * {sub} + j % {sub}];"

    def kernel_encode(self, e):
        """The encode kernel's element t (`kernels/encode.py`): u = R (x / s) in shared memory, then
        `nearest_centroid`'s search (||c||^2 - 2 u_m . c, the first smallest) of sub-vector m's codebook
        of the token's head by its sub_dim threads t = m * sub_dim + l, thread l taking centroids l,
        l + sub_dim, ...; thread m then picks the best of its sub-vector's (the smaller code on a tie,
        so the code is the first smallest, as the search over all centroids finds)."""
        head = e.head()
        if self.smooth is not None:
            scaled = e.var()
            e.emit(f"const float {scaled} = {e.x} / {e.table(np.array(self.smooth).reshape(-1))}[{head} * {self.dim} + t];")
            e.x = scaled
        u = e.shared(e.rotated(self.rotation))
        books = e.table(np.array(self.table).reshape(-1))
        norms = e.table(np.array(mx.sum(self.codebooks * self.codebooks, axis=-1)).reshape(-1))
        code, sub, count, subvectors = e.var(), self.sub_dim, self.centroids, self.subvectors
        e.emit(f"float best_ = -VQ_NEG_INF; uint32_t pick_ = 0u, {code} = 0u;")
        e.emit(f"if (act) {{ const int m_ = t / {sub}; const int g_ = {head} * {subvectors} + m_;")
        e.emit(f"  for (int c_ = t % {sub}; c_ < {count}; c_ += {sub}) {{ float d_ = 0.0f;")
        e.emit(f"    for (int k_ = 0; k_ < {sub}; ++k_) d_ += {u}[m_ * {sub} + k_] * {books}[(g_ * {count} + c_) * {sub} + k_];")
        e.emit(f"    const float dist_ = {norms}[g_ * {count} + c_] - 2.0f * d_;")
        e.emit("    if (dist_ < best_) { best_ = dist_; pick_ = (uint32_t)c_; } } }")
        e.emit("VQ_SYNC();")  # every thread has read u before vq_buf takes the candidates' codes
        e.emit("if (act) { vq_red[t] = best_; vq_buf[t] = (float)pick_; }")
        e.emit("VQ_SYNC();")
        e.emit(f"if (t < {subvectors}) {{ float b_ = vq_red[t * {sub}]; {code} = (uint32_t)vq_buf[t * {sub}];")
        e.emit(f"  for (int l_ = 1; l_ < {sub}; ++l_) {{ const float d_ = vq_red[t * {sub} + l_];"
               f" const uint32_t c_ = (uint32_t)vq_buf[t * {sub} + l_];")
        e.emit(f"    if (d_ < b_ || (d_ == b_ && c_ < {code})) {{ b_ = d_; {code} = c_; }} }} }}")
        e.emit("VQ_SYNC();")
        e.code("codes", code)

    def lookup_tables(self, queries: mx.array) -> mx.array:
        """Per-query tables of sub-vector inner products: queries (B, H, M, D) in the domain ->
        (B, H, M, S * 2^c), entry (m, c) = queries_m . C_m[c]."""
        B, H, M, _ = queries.shape
        q = queries.astype(mx.float32).reshape(B, H, M, self.subvectors, self.sub_dim).transpose(0, 1, 3, 2, 4)
        lut = q @ self.codebooks.swapaxes(-1, -2)  # (B, H, S, M, 2^c)
        return lut.transpose(0, 1, 3, 2, 4).reshape(B, H, M, self.subvectors * self.centroids)

    def score(self, queries, fields):
        """sum over sub-vectors of LUT[q][m][code_m]: the scores without decoding a key."""
        codes = self._codes(fields)  # (B, H, T, S)
        B, H, T, S = codes.shape
        lut = self.lookup_tables(queries)
        M = lut.shape[2]
        index = (codes + mx.arange(S, dtype=mx.uint32) * self.centroids).reshape(B, H, 1, T * S)
        rows = max(1, BLOCK_ELEMENTS // max(1, B * H * T * S))  # queries per gather
        parts = []
        for a in range(0, M, rows):
            part = lut[:, :, a : a + rows]
            gathered = mx.take_along_axis(part, mx.broadcast_to(index, (B, H, part.shape[2], T * S)), axis=-1)
            parts.append(mx.sum(gathered.reshape(B, H, part.shape[2], T, S), axis=-1))
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)

    def to_domain(self, x):
        x = x.astype(mx.float32)
        return self.rotation.apply(x * self._smooth(x) if self.smooth is not None else x)

    def from_domain(self, y):
        x = self.rotation.invert(y)
        return x * self._smooth(x) if self.smooth is not None else x

    def params(self):
        return dict(self._params)


# ---- calibration ----------------------------------------------------------------------------------

def smoothing_factors(keys: mx.array, queries: mx.array, alpha: float) -> mx.array:
    """keys (H, N, D), queries (Hq, N, D) -> s (H, D) = max|K_j|^alpha / max|Q_j|^(1 - alpha), the
    query maximum over the kv head's query heads."""
    heads, _, dim = keys.shape
    rep = queries.shape[0] // heads
    key_max = mx.max(mx.abs(keys), axis=1)
    query_max = mx.max(mx.abs(queries.reshape(heads, rep * queries.shape[1], dim)), axis=1)
    floor = 1e-5
    return mx.maximum(key_max, floor) ** alpha / mx.maximum(query_max, floor) ** (1.0 - alpha)


def learn_codebooks(x: mx.array, sub_dim: int, centroid_bits: int, seed: int,
                    smooth: Optional[mx.array] = None) -> dict:
    """x (H, N, D) captured vectors -> params: the rotation, k-means codebooks of R (x / s) per
    head and sub-vector, and s (when given)."""
    heads, n, dim = x.shape
    if dim % sub_dim:
        raise ValueError(f"vecinfer sub_dim {sub_dim} does not divide head dim {dim}")
    rotation = HadamardRotation(dim, seed)
    x = x.astype(mx.float32)
    if smooth is not None:
        x = x / smooth[:, None, :]
    u = rotation.apply(x)
    subvectors = dim // sub_dim
    groups = u.reshape(heads, n, subvectors, sub_dim).transpose(0, 2, 1, 3).reshape(heads * subvectors, n, sub_dim)
    books = kmeans(groups, 1 << centroid_bits, seed=seed).reshape(heads, subvectors, 1 << centroid_bits, sub_dim)
    params = {**rotation_params(rotation), "heads.codebooks": books}
    if smooth is not None:
        params["heads.smooth"] = smooth
    return params


@register_method("vecinfer")
class VecInfer(Method):
    key_bits = range(1, 9)
    value_bits = range(1, 9)
    options = {"sub_dim": int, "centroid_bits": int, "alpha": float, "smooth": bool, "values": str,
               "value_sub_dim": int}
    calibrated = True
    status = "experimental"
    status_note = ("beats turboquant_mse at 1-2.25 bits with fewer bits, but kivi:2 (group 64) reaches its KL "
                   "with 0.13 fewer bits (2.50 vs 2.62) on SmolLM2 (docs/methods.md)")
    summary = "smooth scaling + Hadamard + product VQ (k-means codebooks, calibrated); LUT scores"
    values_summary = "turboquant_mse at value_bits (values=mse) or Hadamard + product VQ (values=vq)"

    @staticmethod
    def widths(config, role: str):
        """(sub_dim, centroid_bits) of `role`'s codes (module docstring)."""
        bits = config.bits if role == "keys" else config.value_bits
        sub = config.options.get("sub_dim" if role == "keys" else "value_sub_dim")
        centroid_bits = config.options.get("centroid_bits") if role == "keys" else None
        if sub is None:
            sub = max(1, 8 // bits) if centroid_bits is None else max(1, centroid_bits // bits)
        if centroid_bits is None:
            centroid_bits = bits * sub
        return sub, centroid_bits

    @classmethod
    def validate(cls, config) -> None:
        super().validate(config)
        if config.options.get("values", "mse") not in VALUE_CODECS:
            raise ValueError(f"vecinfer option values must be one of {', '.join(VALUE_CODECS)}, "
                             f"got {config.options['values']!r}")
        roles = ("keys", "values") if config.options.get("values", "mse") == "vq" else ("keys",)
        for role in roles:
            sub, centroid_bits = cls.widths(config, role)
            bits = config.bits if role == "keys" else config.value_bits
            if sub < 1 or not 1 <= centroid_bits <= 8:
                raise ValueError(f"vecinfer {role}: codes of {centroid_bits} bits per {sub} coordinates; "
                                 f"codes take 1..8 bits (at most 256 centroids)")
            if math.ceil(centroid_bits / sub) != bits:
                raise ValueError(f"vecinfer {role}: {centroid_bits} bits per {sub} coordinates is "
                                 f"{centroid_bits / sub:g} bits per coordinate; set bits to {math.ceil(centroid_bits / sub)} "
                                 f"(the width rounded up)")

    @classmethod
    def key_codec(cls, config, dim, params=None):
        if not params or "heads.codebooks" not in params:
            raise calibration_needed("vecinfer (keys)")
        return ProductVQCodec(dim, cls.widths(config, "keys")[1], params)

    @classmethod
    def value_codec(cls, config, dim, params=None):
        if config.options.get("values", "mse") == "mse":
            from .turboquant_mse import MSECodec

            return MSECodec(dim, config.value_bits, config.seed + 1, params or None)
        if not params or "heads.codebooks" not in params:
            raise calibration_needed("vecinfer (values=vq)")
        return ProductVQCodec(dim, cls.widths(config, "values")[1], params, name="vecinfer_values")

    @classmethod
    def calibrate(cls, config, layers, progress=None) -> Optional[List[dict]]:
        from tqdm import tqdm

        from .turboquant_mse import MSECodec

        alpha = float(config.options.get("alpha", 0.5))
        key_sub, key_bits = cls.widths(config, "keys")
        out = []
        for layer in tqdm(layers, desc="k-means", unit="layer", disable=not progress):
            if layer is None:
                out.append(None)
                continue
            keys, values = layer["keys"], layer["values"]
            smooth = smoothing_factors(keys, layer["queries"], alpha) if config.options.get("smooth", True) else None
            entry = {"keys": learn_codebooks(keys, key_sub, key_bits, config.seed, smooth)}
            if config.options.get("values", "mse") == "vq":
                value_sub, value_bits = cls.widths(config, "values")
                entry["values"] = learn_codebooks(values, value_sub, value_bits, config.seed + 1)
            else:  # the uncalibrated value codec's arrays, so the artifact is self-contained
                entry["values"] = MSECodec(values.shape[-1], config.value_bits, config.seed + 1).params()
            out.append(entry)
        return out
