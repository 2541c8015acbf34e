"""PolarQuant (Han et al., arXiv 2502.02617): angles of a recursive polar transform.

encode:  y = R x (R a seeded random rotation), then the recursive polar transform
         (Sec. 3, Alg. 1): level 1 maps pairs (y_2i, y_2i+1) to a radius and an angle
         theta in [0, 2 pi); level l > 1 maps pairs of level l-1 radii (r_2i, r_2i+1) to a
         radius and an angle psi = atan2(r_2i+1, r_2i) in [0, pi/2]. After L levels
         (option `levels`, default 4 as in the paper) d / 2^L radii remain.
         Each angle is replaced by its nearest codebook angle, one codebook per level;
store:   `codes`: one packed bitstream per token and head holding the angle codes of
         all levels (level l has d / 2^l angles of b_l bits) and then the bit patterns
         of the d / 2^L final radii in fp16: sum_l b_l d / 2^l + 16 d / 2^L bits;
attend:  domain = the rotated space: decode runs the inverse polar transform from the
         radii down (children = rho (cos psi, sin psi)), giving y ~ R x, so scores are
         (R q) . y and the value sum is un-rotated once per query with R^T.

Angle codebooks. After a random rotation the direction of y is uniform, so the angles
are independent, theta is uniform on [0, 2 pi) and level-l angles have density
p_l(psi) ~ sin^(2^(l-1) - 1)(2 psi) on [0, pi/2] (paper, Lemma 2). The relative error
is then exactly (in expectation)

    E||x - x^||^2 / ||x||^2 = 2 (1 - prod_l E[cos(psi_l - psi^_l)])        (*)

(the reconstruction is a tree of 2-D rotations; expand <u, u^> level by level), so the
codebooks are Lloyd-Max under the distortion 1 - cos(psi - c): cells are nearest-angle
intervals and each centroid is the circular mean of its cell. Level 1 is the uniform
quantizer (optimal for a uniform angle). A 0-bit level stores nothing and uses pi/4.

Bit allocation. `bits` is a budget per coordinate: the fp16 radii cost 16 / 2^L and the
per-level widths b_l (0..8, b_1 >= 1) maximise prod_l E[cos] under
sum_l b_l / 2^l + 16 / 2^L <= bits (a small knapsack, solved exactly per head dim, the
stream padded to whole 32-bit words). With L = 4: bits 2 -> (2,0,0,0), 3 -> (3,1,1,2),
4 -> (4,2,3,2) (the paper's 3.875-bit (4,2,2,2) plus the spare 1/8 bit on level 3),
all at exactly `bits` per coordinate for head dims divisible by 32.
Deeper trees spend less on radii and do better at the same budget: `levels=0` means the
deepest tree the head dim allows (L = log2(d) for a power of two, keeping only the norm
in fp16); otherwise the head dim must be divisible by 2^L. Measured on Gaussian vectors,
d = 128, relative error at bits 2, 3, 4: 0.379, 0.108, 0.0277 with L = 4 and 0.159,
0.048, 0.0135 with L = 7, all at exactly `bits` per coordinate and within 1% of (*); the
paper's (4,2,2,2) gives 0.032. TurboQuant_mse reaches 0.116, 0.034, 0.0093 at the same
bits: coding angles costs more than coding rotated coordinates directly.

Values are TurboQuant_mse codes (turboquant_mse.MSECodec) at value_bits.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Tuple

import mlx.core as mx
import numpy as np

from ..packing import pack, packed_words
from ..rotations import random_rotation, rotation_from_params, rotation_params
from ..formats import Format, packed
from .base import Codec, Method, register_method
from .turboquant_mse import MSECodec

DEFAULT_LEVELS = 4
MAX_LEVEL_BITS = 8
_GRID_POINTS = 1 << 16
# Lloyd converges slowly at 7-8 bits; 1000 sweeps from the Panter-Dite start are within
# 1e-4 (relative) of the converged distortion and keep construction well under a second.
_MAX_ITERATIONS = 1000
_TOLERANCE = 1e-12


def _cumulative(x: np.ndarray, f: np.ndarray) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum(0.5 * (f[1:] + f[:-1]) * np.diff(x))])


def angle_density(level: int) -> Tuple[np.ndarray, np.ndarray]:
    """Grid on [0, pi/2] and the normalised density of a level >= 2 angle (Lemma 2)."""
    psi = np.linspace(0.0, math.pi / 2, _GRID_POINTS + 1)
    power = 2 ** (level - 1) - 1
    with np.errstate(divide="ignore"):
        log_p = power * np.log(np.sin(2 * psi)) if power else np.zeros_like(psi)
    p = np.exp(log_p - log_p[np.isfinite(log_p)].max())
    p[~np.isfinite(log_p)] = 0.0
    return psi, p / np.trapezoid(p, psi)


@lru_cache(maxsize=None)
def angle_codebook(level: int, bits: int) -> Tuple[Tuple[float, ...], float]:
    """(centroids, E[cos(angle - nearest centroid)]) for one level at `bits` bits."""
    n = 1 << bits
    if level == 1:
        step = 2 * math.pi / n
        centroids = (np.arange(n) + 0.5) * step
        return tuple(centroids), math.sin(step / 2) / (step / 2)  # E cos of a uniform error
    psi, p = angle_density(level)
    mass_cos, mass_sin = _cumulative(psi, p * np.cos(psi)), _cumulative(psi, p * np.sin(psi))
    # Panter-Dite start (point density ~ p^(1/3)), then Lloyd iterations whose centroid
    # step is the circular mean of the cell (the minimiser of E[1 - cos(psi - c)]).
    companded = _cumulative(psi, np.cbrt(p))
    centroids = np.interp((np.arange(n) + 0.5) / n * companded[-1], companded, psi)
    for _ in range(_MAX_ITERATIONS):
        edges = np.concatenate([[0.0], 0.5 * (centroids[1:] + centroids[:-1]), [math.pi / 2]])
        updated = np.arctan2(np.diff(np.interp(edges, psi, mass_sin)), np.diff(np.interp(edges, psi, mass_cos)))
        updated = 0.5 * (updated + (math.pi / 2 - updated[::-1]))  # p_l is symmetric about pi/4
        change = np.max(np.abs(updated - centroids))
        centroids = updated
        if change < _TOLERANCE:
            break
    error = psi - centroids[np.searchsorted(0.5 * (centroids[1:] + centroids[:-1]), psi)]
    return tuple(centroids), float(np.trapezoid(np.cos(error) * p, psi))


@lru_cache(maxsize=None)
def level_bits(bits: int, levels: int, dim: int) -> Tuple[int, ...]:
    """Per-level widths maximising prod_l E[cos] (hence minimising (*)) within `bits`/coord.

    Per token: level l at b bits costs b * dim / 2^l bits, the radii 16 * dim / 2^L; the
    stream is stored in 32-bit words, so the budget is bits * dim rounded down to whole
    words and the stored size never exceeds it. Exact DP over (level, bits spent).
    """
    budget = (bits * dim) // 32 * 32 - 16 * (dim >> levels)
    best = {0: (0.0, ())}  # code bits spent -> (sum log E[cos], widths so far)
    for level in range(1, levels + 1):
        unit_cost = dim >> level
        step = {}
        for spent, (score, widths) in best.items():
            for b in range(1 if level == 1 else 0, MAX_LEVEL_BITS + 1):
                total = spent + b * unit_cost
                if total > budget:
                    break
                candidate = (score + math.log(angle_codebook(level, b)[1]), widths + (b,))
                if total not in step or candidate[0] > step[total][0]:
                    step[total] = candidate
        best = step
    if not best:
        raise ValueError(
            f"polarquant with levels={levels} needs bits >= {16 / (1 << levels) + 0.5:g} "
            f"(fp16 radii cost {16 / (1 << levels):g} bits/coordinate, level-1 angles at least 0.5)"
        )
    return max(best.values())[1]


class PolarCodec(Codec):
    """Recursive polar transform in the rotated domain with per-level angle codebooks."""

    def __init__(self, dim: int, bits: int, seed: int, levels: int = DEFAULT_LEVELS, params=None):
        self.dim = self.domain_dim = dim
        if params:
            self.rotation = rotation_from_params(params)
            levels = sum(1 for k in params if k.startswith("angles"))
            self.centroids = [params[f"angles{l}"] for l in range(1, levels + 1)]
        else:
            if levels == 0:
                levels = (dim & -dim).bit_length() - 1  # 2-adic valuation: the deepest tree
            if levels < 1 or dim % (1 << levels):
                raise ValueError(
                    f"polarquant with levels={levels} needs a head dim divisible by {1 << levels}, "
                    f"got {dim}; set options={{'levels': L}} with {dim} divisible by 2^L"
                )
            self.rotation = random_rotation(dim, seed)
            self.centroids = [
                mx.array(np.array(angle_codebook(l, b)[0], dtype=np.float32))
                for l, b in enumerate(level_bits(bits, levels, dim), start=1)
            ]
        self.levels = levels
        self.bits = [c.shape[0].bit_length() - 1 for c in self.centroids]
        self.counts = [dim >> l for l in range(1, levels + 1)]  # angles per level
        self.boundaries = [(c[1:] + c[:-1]) / 2 for c in self.centroids]
        self.cos = [mx.cos(c) for c in self.centroids]
        self.sin = [mx.sin(c) for c in self.centroids]
        self.code_bits = sum(n * b for n, b in zip(self.counts, self.bits))
        self.radii = dim >> levels
        self._stream_tables()
        self.format = Format("polarquant", dim, dim, (packed("codes", self.code_bits + 16 * self.radii, 1),))

    def _stream_tables(self):
        """Constant gather tables that read every code of the stream straight from its
        words: code i of width w_i starts at bit s_i, so it is
        (word[s_i // 32] >> s_i % 32 | word[s_i // 32 + 1] << (32 - s_i % 32)) & (2^w_i - 1)."""
        widths = np.concatenate(
            [np.full(n, b) for n, b in zip(self.counts, self.bits) if b] + [np.full(self.radii, 16)]
        ).astype(np.int64)
        start = np.concatenate([[0], np.cumsum(widths)[:-1]])
        words = packed_words(int(widths.sum()), 1)
        self._word = mx.array((start // 32).astype(np.uint32))
        self._next_word = mx.array(np.minimum(start // 32 + 1, words - 1).astype(np.uint32))
        self._shift = mx.array((start % 32).astype(np.uint32))
        self._complement = mx.array((31 - start % 32).astype(np.uint32))  # two shifts: no shift by 32
        self._mask = mx.array(((1 << widths) - 1).astype(np.uint32))

    def kernel_encode(self, e):
        """The encode kernel (`kernels/encode.py`): thread i takes pair i of each level in turn (the
        radii of the level below in shared memory) and writes its code's bit planes, then the
        fp16 radii's, at their places in the stream (`encode`'s order)."""
        stream = e.stream("codes")
        radii = e.shared(e.rotated(self.rotation))
        position = 0
        for level, (count, bits) in enumerate(zip(self.counts, self.bits)):
            first = level == 0
            e.emit(f"{{ float a_ = 0.0f, r_ = 0.0f; uint32_t c_ = 0u;")
            e.emit(f"  if (t < {count}) {{ const float p_ = {radii}[2 * t], q_ = {radii}[2 * t + 1];")
            e.emit("    a_ = VQ_ATAN2(q_, p_); r_ = VQ_SQRT(p_ * p_ + q_ * q_);")
            if first:  # level 1 angles on [0, 2 pi)
                e.emit("    if (a_ < 0.0f) a_ = a_ + 6.2831855f;")
            if bits:
                bnd = e.table(self.boundaries[level])
                e.emit(f"    for (int k_ = 0; k_ < {(1 << bits) - 1}; ++k_) c_ += (a_ > {bnd}[k_]) ? 1u : 0u;")
                e.emit(f"    for (int k_ = 0; k_ < {bits}; ++k_) vq_codes[{stream} + {position} + t * {bits} + k_] ="
                       " (c_ >> k_) & 1u;")
            e.emit("  }")
            e.emit("  VQ_SYNC();")
            e.emit(f"  if (t < {count}) {radii}[t] = r_;")
            e.emit("  VQ_SYNC(); }")
            position += count * bits
        e.emit(f"if (t < {self.radii}) {{ const uint32_t w_ = vq_half_word({radii}[t]);")
        e.emit(f"  for (int k_ = 0; k_ < 16; ++k_) vq_codes[{stream} + {position} + t * 16 + k_] = (w_ >> k_) & 1u; }}")

    def encode(self, x):
        y = self.rotation.apply(x.astype(mx.float32))
        *lead, _ = y.shape
        radius, planes = y, []
        for level in range(self.levels):
            pairs = radius.reshape(*lead, -1, 2)
            angle = mx.arctan2(pairs[..., 1], pairs[..., 0])
            if level == 0:
                angle = mx.where(angle < 0, angle + 2 * math.pi, angle)  # [0, 2 pi)
            radius = mx.sqrt(mx.sum(pairs * pairs, axis=-1))
            b = self.bits[level]
            if b:
                codes = (angle[..., None] > self.boundaries[level]).sum(axis=-1).astype(mx.uint8)
                # Bit planes: one stream for all levels, whatever their widths.
                shifts = mx.arange(b, dtype=mx.uint8)
                planes.append(((codes[..., None] >> shifts) & 1).reshape(*lead, -1))
        # The fp16 radii go into the same stream as 16 bit planes each, so padding to
        # whole words is paid once per token.
        radius_bits = mx.view(radius.astype(mx.float16), mx.uint16)[..., None] >> mx.arange(16, dtype=mx.uint16)
        planes.append((radius_bits & 1).astype(mx.uint8).reshape(*lead, -1))
        return {"codes": pack(mx.concatenate(planes, axis=-1), 1)}

    def decode(self, fields):
        words = fields["codes"]
        low = mx.take(words, self._word, axis=-1) >> self._shift
        high = (mx.take(words, self._next_word, axis=-1) << 1) << self._complement
        codes = (low | high) & self._mask
        *lead, _ = codes.shape
        offsets = np.cumsum([0] + [n if b else 0 for n, b in zip(self.counts, self.bits)])
        radius = mx.view(codes[..., int(offsets[-1]) :].astype(mx.uint16), mx.float16).astype(mx.float32)
        for level in reversed(range(self.levels)):
            b = self.bits[level]
            if b:
                here = codes[..., int(offsets[level]) : int(offsets[level + 1])]
                cos, sin = mx.take(self.cos[level], here), mx.take(self.sin[level], here)
            else:
                cos, sin = self.cos[level][0], self.sin[level][0]
            # Inverse polar step: each radius splits into rho cos(angle), rho sin(angle).
            radius = mx.stack([radius * cos, radius * sin], axis=-1).reshape(*lead, -1)
        return radius

    def kernel_decode(self, a):
        """The kernels' element j (`kernels/dequant.py`): the inverse polar transform along j's path,
        radius[j >> L] times, level L down to 1, cos or sin (bit l - 1 of j) of the level-l angle
        j >> l, multiplied in `decode`'s order so the result is the same float."""
        offsets = np.cumsum([0] + [n * b for n, b in zip(self.counts, self.bits)])
        radius = a.bits_at("codes", f"{self.code_bits} + (j >> {self.levels}) * 16", 16)
        lines = [f"v = vq_half_bits({radius});"]
        for level in reversed(range(self.levels)):
            b = self.bits[level]
            cos, sin = a.table(np.array(self.cos[level])), a.table(np.array(self.sin[level]))
            code = a.bits_at("codes", f"{int(offsets[level])} + (j >> {level + 1}) * {b}", b) if b else "0"
            lines.append(f"v *= ((j >> {level}) & 1) ? {sin}[{code}] : {cos}[{code}];")
        return " ".join(lines)

    def to_domain(self, x):
        return self.rotation.apply(x)

    def from_domain(self, y):
        return self.rotation.invert(y)

    domain = "rotation"  # from_domain is self.rotation.invert (base Codec.domain)

    def params(self):
        state = rotation_params(self.rotation)
        return {**state, **{f"angles{l}": c for l, c in enumerate(self.centroids, start=1)}}


@register_method("polarquant")
class PolarQuant(Method):
    key_bits = range(1, 9)
    value_bits = range(1, 9)
    options = {"levels": int}
    summary = "rotation + recursive polar transform, per-level angle codebooks, fp16 final radii"
    status = "experimental"
    status_note = "several times turboquant_mse's error at the same bits"
    values_summary = "turboquant_mse codes at value_bits"

    @classmethod
    def validate(cls, config):
        super().validate(config)
        levels = cls._levels(config)
        if not 0 <= levels <= 12:
            raise ValueError(f"polarquant option levels must be in 0..12 (0: deepest), got {levels}")
        radii = 16 / (1 << levels)
        if levels and config.bits < radii + 0.5:
            raise ValueError(
                f"polarquant with levels={levels} needs bits >= {radii + 0.5:g} (fp16 radii cost "
                f"{radii:g} bits/coordinate, level-1 angles at least 0.5); got bits={config.bits}"
            )

    @classmethod
    def _levels(cls, config):
        return config.options.get("levels", DEFAULT_LEVELS)

    @classmethod
    def key_codec(cls, config, dim, params=None):
        return PolarCodec(dim, config.bits, config.seed, cls._levels(config), params)

    @classmethod
    def value_codec(cls, config, dim, params=None):
        return MSECodec(dim, config.value_bits, config.seed + 1, params)
