"""RateQuant (arXiv 2605.06675): bit widths per layer from fitted rate-distortion curves.

base:    the TurboQuant-MSE codec (seeded random rotation, Lloyd-Max codes of the unit
         vector, fp16 norm), at a width w per layer and role that may be fractional: the
         first n_hi = (w - floor w) * D rotated coordinates get floor(w) + 1 bits, the rest
         floor(w) (after the rotation every coordinate has the same law, so which ones get
         the extra bit does not matter). n_hi is a multiple of 32, so both code fields fill
         whole words: widths lie on a grid of 32 / D bits (0.5 at D = 64).
         With `base=kivi` the base is KIVI (keys per channel over group_size tokens,
         values per token) at whole bits per layer: fractional budgets then come from
         mixing layers' widths.
probe:   `veloxquant calibrate` encodes each layer's captured keys and values at b = 1..6
         and measures, per head, D(b): for keys the mean squared error of the attention
         score, E[(q . (k - k^) / sqrt(D))^2] with the layer's real queries; for values
         E||v - v^||^2. It fits log D(b) = log a - b log beta by least squares (the paper's
         D(b) = a beta^-b), per head and for the layer's heads summed.
allocate: reverse water-filling (Cover & Thomas, Thm 10.3.3, for exponential curves):
         minimise sum_l D_l(b_l) subject to sum_l w_l b_l = B sum_l w_l (w_l = heads x dim),
         b_l = clip(log(a_l ln beta_l / (lambda w_l)) / ln beta_l, 1, 8), lambda by
         bisection; then widths round down to the grid and the budget left goes, one grid
         step at a time, to the layer whose fitted D falls most per stored bit. Keys and
         values have separate budgets (`kbudget`, `vbudget`, code bits per coordinate,
         fractional allowed; default: `bits`, `value_bits`). `objective=relative` divides
         each layer's curve by its signal (E[(q.k)^2 / D] or E||v||^2) first.

The widths live in the artifact dir; each layer's cache gets its own format.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

import mlx.core as mx
import numpy as np

from ..codebooks import dequantize, lloyd_max, quantize
from ..formats import Format, fp16, packed
from ..packing import pack, unpack
from ..rotations import random_rotation, rotation_from_params, rotation_params
from .base import Codec, Method, register_method, split_width_centroid
from .outliers import calibration_needed

PROBE_BITS = tuple(range(1, 7))
MIN_BITS, MAX_BITS = 1, 8
GRID_CODES = 32  # coordinates per extra-bit step: whole uint32 words for any width


def width_grid(dim: int) -> float:
    return GRID_CODES / dim if dim % GRID_CODES == 0 else 1.0


def split_width(width: float, dim: int):
    """(low bits, coordinates at low + 1 bits) of a width on the grid."""
    low = int(math.floor(width + 1e-9))
    high = int(round((width - low) * dim))
    if low >= MAX_BITS:
        return MAX_BITS, 0
    if high % GRID_CODES and high != 0:
        raise ValueError(f"width {width} at head dim {dim} is off the grid of {width_grid(dim)} bits")
    return low, high


class RateCodec(Codec):
    def __init__(self, dim: int, width: float, seed: int, params=None, renorm: bool = False):
        self.dim = self.domain_dim = dim
        self.width = float(width)
        self.low, self.high = split_width(self.width, dim)
        if self.low < MIN_BITS:
            raise ValueError(f"ratequant widths start at {MIN_BITS} bit, got {width}")
        self.renorm = renorm
        params = params or {}
        self.rotation = rotation_from_params(params) if "rotation.hadamard_signs" in params or \
            "rotation.dense_matrix" in params else random_rotation(dim, seed)
        self.books = {b: lloyd_max("sphere", b, dim) for b in {self.low, self.low + 1} if b <= MAX_BITS}
        self.params_in = {k: v for k, v in params.items() if not k.startswith("rotation.")}
        fields = []
        if self.high:
            fields.append(packed("codes_hi", self.high, self.low + 1))
        fields.append(packed("codes", dim - self.high, self.low))
        fields.append(fp16("norm"))
        self.format = Format(f"ratequant_{self.width:g}", dim, dim, tuple(fields))

    def _parts(self):
        parts = [("codes_hi", 0, self.high, self.low + 1)] if self.high else []
        return parts + [("codes", self.high, self.dim, self.low)]

    def encode(self, x):
        x = x.astype(mx.float32)
        norm = mx.sqrt(mx.sum(x * x, axis=-1, keepdims=True))
        unit = self.rotation.apply(x) / mx.maximum(norm, 1e-30)
        fields, decoded = {}, []
        for name, a, b, bits in self._parts():
            book = self.books[bits]
            codes = quantize(unit[..., a:b], book.boundaries)
            fields[name] = pack(codes, bits)
            if self.renorm:
                decoded.append(dequantize(codes, book.centroids))
        if self.renorm:
            d = mx.concatenate(decoded, axis=-1) if len(decoded) > 1 else decoded[0]
            norm = norm / mx.maximum(mx.sqrt(mx.sum(d * d, axis=-1, keepdims=True)), 1e-30)
        fields["norm"] = norm.astype(mx.float16)
        return fields

    def decode(self, fields):
        parts = [dequantize(unpack(fields[name], bits, b - a), self.books[bits].centroids)
                 for name, a, b, bits in self._parts()]
        unit = mx.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]
        return unit * fields["norm"].astype(mx.float32)

    def kernel_decode(self, a):
        """The kernels' element j (`kernels/dequant.py`): norm * c[code_j], from the wider codes for
        j < high and the narrower ones after."""
        value = split_width_centroid(a, self._parts(), self.books)
        return f"v = {value} * {a.half('norm', '0')};"

    def kernel_encode(self, e):
        """The encode kernel's element t (`kernels/encode.py`): `encode`'s steps, element t coded
        at the width of its part."""
        from .turboquant_mse import kernel_rotated_unit

        norm, unit = kernel_rotated_unit(e, self.rotation)
        decoded = []
        for name, start, stop, bits in self._parts():
            book = self.books[bits]
            code = e.nearest(unit, book.boundaries)
            e.code(name, code, index=f"t - {start}")
            decoded.append((start, f"{e.table(book.centroids)}[{code}]"))
        if self.renorm:
            c = decoded[0][1] if len(decoded) == 1 else f"(t < {decoded[1][0]} ? {decoded[0][1]} : {decoded[1][1]})"
            sq = e.sum(f"{c} * {c}")
            e.emit(f"{norm} = {norm} / VQ_MAXF(VQ_SQRT({sq}), 1e-30f);")
        e.half("norm", norm)

    def to_domain(self, x):
        return self.rotation.apply(x)

    def from_domain(self, y):
        return self.rotation.invert(y)

    domain = "rotation"  # from_domain is self.rotation.invert (base Codec.domain)

    def params(self):
        return {**self.params_in, **rotation_params(self.rotation), "width": mx.array([self.width], mx.float32)}


# ---- the probe and the allocation ----------------------------------------------------------------

def probe(codec_at, role: str, x: mx.array, queries: Optional[mx.array]) -> np.ndarray:
    """Distortion (H, len(PROBE_BITS)) of the codec at each probe width (see the module docstring)."""
    heads, _, dim = x.shape
    if role == "keys":
        rep = queries.shape[0] // heads
        q = queries.reshape(heads, rep * queries.shape[1], dim) / math.sqrt(dim)
        cov = q.swapaxes(-1, -2) @ q / q.shape[1]  # (H, D, D): E[q q^T] per kv head
    out = []
    for bits in PROBE_BITS:
        codec = codec_at(bits)
        err = x - codec.reconstruct(codec.encode(x[None]))[0]
        if role == "keys":
            d = mx.mean(mx.sum((err @ cov) * err, axis=-1), axis=-1)
        else:
            d = mx.mean(mx.sum(err * err, axis=-1), axis=-1)
        out.append(d)
    return np.array(mx.stack(out, axis=-1)).astype(np.float64)


def signal(role: str, x: mx.array, queries: Optional[mx.array]) -> float:
    """The scale errors are read against: E[(q . k / sqrt(D))^2] for keys, E||v||^2 for values."""
    heads, _, dim = x.shape
    if role == "keys":
        rep = queries.shape[0] // heads
        q = queries.reshape(heads, rep * queries.shape[1], dim) / math.sqrt(dim)
        cov = q.swapaxes(-1, -2) @ q / q.shape[1]
        return float(mx.sum(mx.mean(mx.sum((x @ cov) * x, axis=-1), axis=-1)).item())
    return float(mx.sum(mx.mean(mx.sum(x * x, axis=-1), axis=-1)).item())


def fit_curve(distortion: np.ndarray):
    """Least-squares fit of log D(b) = log a - b log beta over the probe widths -> (a, beta)."""
    b = np.array(PROBE_BITS, dtype=np.float64)
    logd = np.log(np.maximum(distortion, 1e-30))
    slope, intercept = np.polyfit(b, logd, 1)
    return float(np.exp(intercept)), float(np.exp(-slope))


def allocate(a: Sequence, beta: Sequence, weights: Sequence, budget: float, grid: float,
             low: float = MIN_BITS, high: float = MAX_BITS) -> List[float]:
    """Widths on `grid` minimising sum a_l beta_l^-b_l with sum w_l b_l <= budget sum w_l
    (reverse water-filling, then grid rounding; module docstring)."""
    a, beta, w = (np.asarray(v, dtype=np.float64) for v in (a, beta, weights))
    if not low <= budget <= high:
        raise ValueError(f"a budget of {budget} bits is outside the widths ratequant stores ({low}..{high})")
    log_beta = np.log(np.maximum(beta, 1.0 + 1e-9))
    total = budget * w.sum()

    def widths(log_lambda):
        return np.clip((np.log(a * log_beta / w) - log_lambda) / log_beta, low, high)

    lo, hi = -200.0, 200.0  # log lambda: widths fall as lambda grows
    for _ in range(200):
        mid = (lo + hi) / 2
        if (w * widths(mid)).sum() > total:
            lo = mid
        else:
            hi = mid
    b = np.floor(widths(hi) / grid + 1e-9) * grid
    b = np.clip(b, low, high)
    while True:
        gain = a * (beta ** -b - beta ** -(b + grid)) / w
        gain[b + grid > high + 1e-9] = -np.inf
        gain[(w * b).sum() + w * grid > total + 1e-9] = -np.inf
        best = int(np.argmax(gain))
        if not np.isfinite(gain[best]):
            break
        b[best] += grid
    return [float(x) for x in b]


@register_method("ratequant")
class RateQuant(Method):
    key_bits = range(1, 9)
    value_bits = range(1, 9)
    options = {"kbudget": float, "vbudget": float, "renorm": bool, "base": str, "objective": str}
    width_options = frozenset({"kbudget", "vbudget"})
    bases = ("mse", "kivi")
    calibrated = True
    status = "experimental"
    status_note = "worse than uniform turboquant_mse/kivi at equal bits (docs/methods.md)"
    summary = "TurboQuant-MSE at calibrated widths per layer (fitted D(b), reverse water-filling)"
    values_summary = "same, value budget vbudget"

    @classmethod
    def budget(cls, config, role: str) -> float:
        return float(config.options.get("kbudget" if role == "keys" else "vbudget",
                                        config.bits if role == "keys" else config.value_bits))

    @classmethod
    def widths_label(cls, config) -> str:
        """The budgets, not `bits`/`value_bits`, which only default them: the widths per layer
        come from the artifact."""
        return f"budgets K{cls.budget(config, 'keys'):g}/V{cls.budget(config, 'values'):g}"

    @classmethod
    def validate(cls, config) -> None:
        super().validate(config)
        if config.options.get("objective", "absolute") not in ("absolute", "relative"):
            raise ValueError(f"ratequant option objective must be absolute or relative, "
                             f"got {config.options['objective']!r}")
        if config.options.get("base", "mse") not in cls.bases:
            raise ValueError(f"ratequant option base must be one of {', '.join(cls.bases)}, "
                             f"got {config.options['base']!r}")

    @classmethod
    def base_codec(cls, role, config, dim, width, params=None):
        """The base quantizer at `width`: TurboQuant-MSE (fractional widths on the 32-code grid)
        or KIVI (`base=kivi`: whole bits, keys per channel over group_size tokens)."""
        if config.options.get("base", "mse") == "kivi":
            from .kivi import ChannelGroupAffineCodec, GroupAffineCodec

            if width != int(width):
                raise ValueError(f"ratequant base=kivi takes whole bits per layer, got {width}")
            if role == "keys":
                return ChannelGroupAffineCodec(dim, int(width), config.group_size)
            return GroupAffineCodec(dim, int(width), config.group_size)
        seed = config.seed if role == "keys" else config.seed + 1
        return RateCodec(dim, width, seed, params, config.options.get("renorm", False))

    @classmethod
    def _codec(cls, role, config, dim, params):
        if not params or "width" not in params:
            raise calibration_needed(f"ratequant ({role})")
        return cls.base_codec(role, config, dim, float(params["width"][0].item()), params)

    @classmethod
    def key_codec(cls, config, dim, params=None):
        return cls._codec("keys", config, dim, params)

    @classmethod
    def value_codec(cls, config, dim, params=None):
        return cls._codec("values", config, dim, params)

    @classmethod
    def fit(cls, config, layers, progress: bool = True):
        """Per layer and role: probe distortions (H, n), per-head fits, the layer's fit, signal."""
        from tqdm import tqdm

        fits = []
        for layer in tqdm(layers, desc="probe", unit="layer", disable=not progress):
            if layer is None:
                fits.append(None)
                continue
            entry = {}
            for role in ("keys", "values"):
                x = layer[role]
                dim = x.shape[-1]
                seed = config.seed if role == "keys" else config.seed + 1
                rotation = random_rotation(dim, seed)
                state = rotation_params(rotation)
                d = probe(lambda b: cls.base_codec(role, config, dim, b, state), role, x, layer["queries"])
                heads = [fit_curve(row) for row in d]
                entry[role] = {"probe": d, "heads": heads, "layer": fit_curve(d.sum(axis=0)),
                               "signal": signal(role, x, layer["queries"]), "dim": dim,
                               "kv_heads": x.shape[0], "rotation": state,
                               "grid": 1.0 if config.options.get("base") == "kivi" else width_grid(dim)}
            fits.append(entry)
        return fits

    @classmethod
    def allocation(cls, fits, role: str, budget: float, objective: str = "absolute",
                   tokens: Optional[Sequence[int]] = None) -> List[Optional[float]]:
        """Widths per layer; `objective="relative"` divides each layer's curve by its signal
        (water-filling on distortion / signal, every layer's error counted relative to its size).
        `tokens`: the tokens each calibrated layer holds (a sliding-window layer fewer), which
        weigh what its bits cost; `budget` is then per held coordinate (default: per coordinate)."""
        used = [f[role] for f in fits if f is not None]
        grid = max(f["grid"] for f in used)
        norm = [f["signal"] if objective == "relative" else 1.0 for f in used]
        held = [1] * len(used) if tokens is None else list(tokens)
        if len(held) != len(used):
            raise ValueError(f"{len(held)} token counts for {len(used)} calibrated layers")
        widths = iter(allocate([f["layer"][0] / n for f, n in zip(used, norm)], [f["layer"][1] for f in used],
                               [f["kv_heads"] * f["dim"] * t for f, t in zip(used, held)], budget, grid))
        return [None if f is None else next(widths) for f in fits]

    @classmethod
    def calibrate(cls, config, layers, progress=None):
        fits = cls.fit(config, layers, progress=bool(progress))
        objective = config.options.get("objective", "absolute")
        widths = {role: cls.allocation(fits, role, cls.budget(config, role), objective) for role in ("keys", "values")}
        out = []
        for i, entry in enumerate(fits):
            if entry is None:
                out.append(None)
                continue
            out.append({role: params_of(entry[role], widths[role][i]) for role in ("keys", "values")})
        return out

    @staticmethod
    def calibration_summary(learned) -> dict:
        summary = {}
        for role in ("keys", "values"):
            rows = [entry[role] for entry in learned if entry]
            summary[f"{role}_widths"] = [float(r["width"][0].item()) for r in rows]
            summary[f"{role}_mean_width"] = float(np.mean(summary[f"{role}_widths"]))
            summary[f"{role}_expected_nsr"] = expected_nsr(rows)
        return summary


def params_of(fit: dict, width: float) -> dict:
    probe_bits = mx.array(np.array(PROBE_BITS, dtype=np.float32))
    return {
        **fit["rotation"],
        "width": mx.array([width], mx.float32),
        "heads.probe": mx.array(fit["probe"].astype(np.float32)),
        "heads.fit": mx.array(np.array(fit["heads"], dtype=np.float32)),  # (H, 2): a, beta
        "fit": mx.array(np.array(fit["layer"], dtype=np.float32)),
        "signal": mx.array([fit["signal"]], mx.float32),
        "probe_bits": probe_bits,
    }


def predicted(fit_pair, width: float) -> float:
    a, beta = fit_pair
    return a * beta ** -width


def expected_nsr(rows) -> float:
    """Predicted distortion over signal, summed over layers (`fit` at each layer's width):
    the expected quality a plan prints (lower is better; 0 = lossless)."""
    noise = sum(predicted([float(v) for v in r["fit"].tolist()], float(r["width"][0].item())) for r in rows)
    sig = sum(float(r["signal"][0].item()) for r in rows)
    return noise / sig
