"""CommVQ: keys coded before RoPE by RoPE-commuting codebooks (Li et al., arXiv 2506.18879).

RoPE rotates each pair of a head vector (channels (j, j + D/2), or (2j, 2j + 1) for
"traditional" RoPE) by the angle t*w_j at position t: on pair j it is the 2x2 matrix
R(t w_j). A 2x2 matrix commutes with every rotation iff it is [[a, -b], [b, a]], i.e. a
complex number a + ib (paper Sec. 3.2, eq. 6-7). The codebooks here are built from such
blocks: each residual stage s codes a unit pre-RoPE key as

    c_s(A, B) = a_{s,A} + J b_{s,B}        A, B in 0..15 (4 bits each, 8 bits per stage)

where a and b hold one 2-vector per pair (the codeword block [[a_x, -a_y], [a_y, a_x]]
applied to the shared basis vector e_1) and J = [[0, -1], [1, 0]] on every pair: the
paper's product codebook of 2^8 codewords from 2 x 16 learned vectors (its matrix T).
Because every block commutes with R, R(t w) c = sum_s a_s R(t w) e_1 + J b_s R(t w) e_1,
so a key's RoPE is applied to its code at attention time, exactly:

    score(q, t) = q . R_t (||k|| sum_s c_s)          (R_t: RoPE at the key's position t)

encode:  k~ = R_t^T k (the key before RoPE: the cache holds post-RoPE keys, the codec takes
         RoPE's exact inverse off with the token's position, `position_free`), u = k~/||k~||,
         then greedy residual stages: (A_s, B_s) = argmin ||r_s - c_s(A, B)||, r_{s+1} = r_s - c_s;
store:   `codes` (2 x 4 bits per stage, bits*D/8 stages: `bits` per key coordinate) + fp16 norm;
decode:  R_t ||k|| sum_s c_s(A_s, B_s), with t from the positions the engine passes
         (`base.at_positions`): RoPE applied at attention time, never stored;
calibrate: per layer and kv head, each stage's a, b by EM on the pre-RoPE unit keys
         (soft assignments at a falling temperature, then hard; reference code's
         quantize_key_cache.py): the M step is the least-squares fit of a and b
         (block coordinate descent, exact per block since J is orthogonal). The E step
         factors over A and B (see "calibration" below).

Values use TurboQuant-MSE at `value_bits` (its seeded rotation, stored in the artifact).

Supported: llama-family models (mlx-lm's `llama` module), whose RoPE is a per-pair rotation
linear in the position, checked on the model's own RoPE module at calibration and cache
build; anything else is refused by name (`check_model`).
"""

from __future__ import annotations

from typing import List, Optional

import mlx.core as mx

from ..errors import UnsupportedModelError
from ..formats import Format, fp16, packed
from ..packing import pack, unpack
from .base import POSITIONS, Codec, Method, register_method
from .outliers import calibration_needed
from .turboquant_mse import MSECodec

HALF_BITS = 4  # bits of A and of B in one stage
HALF_CODES = 1 << HALF_BITS
STAGE_BITS = 2 * HALF_BITS
SUPPORTED_MODULES = ("mlx_lm.models.llama",)
EM_SOFT_STEPS = 3  # temperatures scale * 10^(-0.5 step): the later ones are as good as hard
EM_HARD_STEPS = 9  # at most: they stop once an error falls by less than EM_TOLERANCE
EM_TOLERANCE = 1e-3
EM_COORDINATE_STEPS = 2
SAFE_EXPONENT = 70.0  # exp(-70) is a normal float32: the factored E-step cannot underflow below it


# ---- RoPE on pairs ------------------------------------------------------------------------------

def _halves(x: mx.array, traditional: bool):
    """(x-coordinates, y-coordinates) of every RoPE pair, (..., D/2) each."""
    if traditional:
        return x[..., 0::2], x[..., 1::2]
    half = x.shape[-1] // 2
    return x[..., :half], x[..., half:]


def _join(re: mx.array, im: mx.array, traditional: bool) -> mx.array:
    if traditional:
        return mx.stack([re, im], axis=-1).reshape(*re.shape[:-1], 2 * re.shape[-1])
    return mx.concatenate([re, im], axis=-1)


def rotate(x: mx.array, angles: mx.array, traditional: bool) -> mx.array:
    """Each pair j of x (..., T, D) rotated by angles (T, D/2): RoPE's R(angle)."""
    cos, sin = mx.cos(angles), mx.sin(angles)
    re, im = _halves(x, traditional)
    return _join(re * cos - im * sin, re * sin + im * cos, traditional)


def quarter_turn(x: mx.array, traditional: bool) -> mx.array:
    """J x: every pair turned by 90 degrees ([[0, -1], [1, 0]], which commutes with RoPE)."""
    re, im = _halves(x, traditional)
    return _join(-im, re, traditional)


def rope_angles(positions: mx.array, inv_freq: mx.array) -> mx.array:
    return positions.astype(mx.float32)[:, None] * inv_freq[None, :]


# ---- the codec ----------------------------------------------------------------------------------

class CommVQKeyCodec(Codec):
    positional = True

    def __init__(self, dim: int, bits: int, params):
        self.dim = self.domain_dim = dim
        self.bits = bits
        self.books = params["heads.codebook"].astype(mx.float32)  # (H, S, 2, 16, D): a then b per stage
        self.inv_freq = params["rope.inv_freq"].astype(mx.float32)  # (D/2,)
        self.traditional = bool(int(params["rope.traditional"].item()))
        self.heads, self.stages = self.books.shape[0], self.books.shape[1]
        if self.stages * STAGE_BITS != bits * dim or self.books.shape[-1] != dim:
            raise ValueError(f"commvq codebook of {self.stages} stages for dim {self.books.shape[-1]} does not "
                             f"give {bits} bits per coordinate of dim {dim}")
        a, b = self.books[:, :, 0], self.books[:, :, 1]
        # rows k * 16 + v of the decode table: code k of a token (A of stage k/2, or B) at value v
        table = mx.stack([a, quarter_turn(b, self.traditional)], axis=2)  # (H, S, 2, 16, D)
        self.table = table.reshape(self.heads, -1, dim)
        # every codeword of every stage, for the encoder's nearest search: (H, S, 256, D)
        self.codewords = (a[:, :, :, None, :] + quarter_turn(b, self.traditional)[:, :, None, :, :]).reshape(
            self.heads, self.stages, HALF_CODES * HALF_CODES, dim)
        self.codeword_norms = mx.sum(self.codewords * self.codewords, axis=-1)  # (H, S, 256)
        self.format = Format(f"commvq_{bits}", dim, dim, (packed("codes", 2 * self.stages, HALF_BITS), fp16("norm")))
        self._params = params

    def position_free(self, x: mx.array, first: int) -> mx.array:
        """Keys (B, H, T, D) at positions first.. with RoPE taken off: R_t^T k (exact: R_t is orthogonal)."""
        positions = mx.arange(first, first + x.shape[2])
        return rotate(x.astype(mx.float32), -rope_angles(positions, self.inv_freq), self.traditional)

    def encode(self, x):
        if x.shape[1] != self.heads:
            raise ValueError(f"commvq was calibrated for {self.heads} kv heads, got {x.shape[1]}")
        x = x.astype(mx.float32)
        norm = mx.sqrt(mx.sum(x * x, axis=-1, keepdims=True))
        residual = x / mx.maximum(norm, 1e-30)
        codes = []
        for s in range(self.stages):
            words = self.codewords[:, s]  # (H, 256, D)
            distance = self.codeword_norms[None, :, None, s] - 2 * (residual @ words[None].swapaxes(-1, -2))
            index = mx.argmin(distance, axis=-1)  # (B, H, T)
            residual = residual - mx.take_along_axis(words[None], index[..., None].astype(mx.int32), axis=2)
            codes += [index // HALF_CODES, index % HALF_CODES]
        codes = mx.stack(codes, axis=-1).astype(mx.uint32)
        return {"codes": pack(codes, HALF_BITS), "norm": norm.astype(mx.float16)}

    def decode_position_free(self, fields) -> mx.array:
        """||k|| sum_s c_s: the key before RoPE, (B, H, T, D) float32."""
        codes = unpack(fields["codes"], HALF_BITS, 2 * self.stages)  # (B, H, T, 2S)
        onehot = (codes[..., None] == mx.arange(HALF_CODES)).astype(mx.float32)
        onehot = onehot.reshape(*codes.shape[:-1], 2 * self.stages * HALF_CODES)
        return (onehot @ self.table[None]) * fields["norm"].astype(mx.float32)

    def decode(self, fields):
        if POSITIONS not in fields:
            raise ValueError("commvq keys decode only at their positions (RoPE is applied at attention time): "
                             "pass the fields through methods.base.at_positions")
        keys = self.decode_position_free(fields)
        return rotate(keys, rope_angles(fields[POSITIONS], self.inv_freq), self.traditional)

    def params(self):
        return dict(self._params)


# ---- calibration: EM per stage ------------------------------------------------------------------
#
# ||r - a_A - J b_B||^2 = ||r||^2 + u_A + v_B + x_AB with u_A = ||a_A||^2 - 2 r.a_A,
# v_B = ||b_B||^2 - 2 r.J b_B and x_AB = 2 a_A.J b_B (||J b|| = ||b||): two (N, 16) matmuls and a
# (16, 16) table per head instead of a (N, 256, D) search. The soft E-step's weights factor the same
# way, exp(-(u_A + v_B + x_AB) / T) = exp(-u_A / T) exp(-v_B / T) exp(-x_AB / T), so its marginals
# and co-occurrences are (N, 16) x (16, 16) matmuls: 32 exponentials per token instead of 256.

def _stage_codewords(a: mx.array, b: mx.array, traditional: bool) -> mx.array:
    """(H, 16, D) a and b -> (H, 256, D) codewords a_A + J b_B (row A * 16 + B)."""
    return (a[:, :, None, :] + quarter_turn(b, traditional)[:, None, :, :]).reshape(a.shape[0], -1, a.shape[-1])


def pair_terms(r: mx.array, a: mx.array, b: mx.array, traditional: bool):
    """(u (H, N, 16), v (H, N, 16), x (H, 16, 16)): ||r_n - a_A - J b_B||^2 = ||r_n||^2 + u_nA + v_nB + x_AB."""
    turned = quarter_turn(b, traditional)
    u = mx.sum(a * a, axis=-1)[:, None, :] - 2 * (r @ a.swapaxes(-1, -2))
    v = mx.sum(b * b, axis=-1)[:, None, :] - 2 * (r @ turned.swapaxes(-1, -2))
    return u, v, 2 * (a @ turned.swapaxes(-1, -2))


def pair_distances(u: mx.array, v: mx.array, x: mx.array) -> mx.array:
    """(H, N, 16, 16): ||r_n - c(A, B)||^2 - ||r_n||^2."""
    return u[..., :, None] + v[..., None, :] + x[:, None]


def soft_weights(u, v, x, nearest, temperature):
    """The E-step at `temperature` (H, 1): p_nAB = softmax over (A, B) of -(u_A + v_B + x_AB) / T,
    returned as its marginals over B and A (H, N, 16) each and its sum over tokens (H, 16, 16).

    Factored (module comment): with each factor shifted to at most 1, the best pair's product
    is exp(-gap / T), gap = nearest - min u - min v - min x >= 0. Where gap / T could underflow
    float32 the weights come from the full (H, N, 16, 16) softmax instead."""
    low_u, low_v = mx.min(u, axis=-1, keepdims=True), mx.min(v, axis=-1, keepdims=True)
    low_x = mx.min(x, axis=(-2, -1), keepdims=True)
    gap = (nearest - low_u[..., 0] - low_v[..., 0] - low_x[..., 0]) / temperature
    if mx.max(gap).item() < SAFE_EXPONENT:
        t = temperature[..., None]
        alpha = mx.exp((low_u - u) / t)  # (H, N, 16)
        beta = mx.exp((low_v - v) / t)
        gamma = mx.exp((low_x - x) / t)  # (H, 16, 16)
        beta_gamma = beta @ gamma.swapaxes(-1, -2)  # sum_B beta_B gamma_AB
        alpha = alpha / mx.sum(alpha * beta_gamma, axis=-1, keepdims=True)
        return alpha * beta_gamma, beta * (alpha @ gamma), gamma * (alpha.swapaxes(-1, -2) @ beta)
    p = mx.exp((nearest[..., None, None] - pair_distances(u, v, x)) / temperature[..., None, None])
    p = p / mx.sum(p, axis=(-2, -1), keepdims=True)
    return mx.sum(p, axis=3), mx.sum(p, axis=2), mx.sum(p, axis=1)


def hard_weights(distances: mx.array):
    """The hard E-step: each token to its nearest codeword (the first on a tie); same outputs
    as `soft_weights`."""
    heads, count = distances.shape[:2]
    index = mx.argmin(distances.reshape(heads, count, -1), axis=-1)[..., None]
    codes = mx.arange(HALF_CODES)
    one_a = (index // HALF_CODES == codes).astype(mx.float32)
    one_b = (index % HALF_CODES == codes).astype(mx.float32)
    return one_a, one_b, one_a.swapaxes(-1, -2) @ one_b


def _m_step(r: mx.array, weight_a: mx.array, weight_b: mx.array, joint: mx.array, a: mx.array, b: mx.array,
            traditional: bool):
    """Least-squares a, b given assignments (their marginals weight_a, weight_b (H, N, 16) and
    co-occurrences joint (H, 16, 16)): sum_n sum_AB p ||r_n - a_A - J b_B||^2, by block
    coordinate descent (each block's minimiser is a weighted mean)."""
    sum_a = weight_a.swapaxes(1, 2) @ r  # (H, 16, D)
    sum_b = weight_b.swapaxes(1, 2) @ r
    mass_a = mx.sum(weight_a, axis=1)[..., None]
    mass_b = mx.sum(weight_b, axis=1)[..., None]
    for _ in range(EM_COORDINATE_STEPS):
        fitted = (sum_a - joint @ quarter_turn(b, traditional)) / mx.maximum(mass_a, 1e-9)
        a = mx.where(mass_a > 1e-6, fitted, a)
        turned = (sum_b - joint.swapaxes(1, 2) @ a) / mx.maximum(mass_b, 1e-9)  # J b
        fitted = -quarter_turn(turned, traditional)  # J^T = -J
        b = mx.where(mass_b > 1e-6, fitted, b)
    return a, b


def initial_books(r: mx.array, traditional: bool, key) -> tuple:
    """a: 16 random residuals; J b: the residuals of 16 other random ones after their nearest a.
    Every a_A + J b_B then differs: starting b at zeros would leave the 16 b's equal, and
    EM keeps equal b's equal (the same weights move them the same way)."""
    heads, count, _ = r.shape
    first, second = mx.random.split(key)
    a = mx.take_along_axis(r, mx.random.randint(0, count, (heads, HALF_CODES), key=first)[..., None], axis=1)
    points = mx.take_along_axis(r, mx.random.randint(0, count, (heads, HALF_CODES), key=second)[..., None], axis=1)
    nearest = mx.argmin(mx.sum(a * a, axis=-1)[:, None, :] - 2 * (points @ a.swapaxes(-1, -2)), axis=-1)
    turned = points - mx.take_along_axis(a, nearest[..., None], axis=1)
    return a, -quarter_turn(turned, traditional)


def learn_stage(r: mx.array, traditional: bool, key) -> tuple:
    """EM for one stage's (a, b) on residuals r (H, N, D): soft steps at a falling temperature,
    then hard ones until the error falls by less than EM_TOLERANCE (relative); the best (a, b)
    by hard error is kept."""
    a, b = initial_books(r, traditional, key)
    squares = mx.sum(r * r, axis=-1)  # (H, N)
    u, v, x = pair_terms(r, a, b, traditional)
    distances = pair_distances(u, v, x)
    nearest = mx.min(distances, axis=(-2, -1))  # (H, N), without ||r||^2
    # temperature relative to the typical distance to the nearest codeword, falling by 10^-0.5 per step
    scale = mx.mean(nearest + squares, axis=1, keepdims=True) + 1e-12  # (H, 1)
    best, best_error, previous = (a, b), None, None
    for step in range(EM_SOFT_STEPS + EM_HARD_STEPS):
        if step < EM_SOFT_STEPS:
            weights = soft_weights(u, v, x, nearest, scale * 10 ** (-0.5 * step))
        else:
            weights = hard_weights(distances)
        a, b = _m_step(r, *weights, a, b, traditional)
        u, v, x = pair_terms(r, a, b, traditional)
        distances = pair_distances(u, v, x)
        nearest = mx.min(distances, axis=(-2, -1))
        error = mx.mean(nearest + squares)
        mx.eval(a, b, distances, nearest, error)
        error = error.item()
        if best_error is None or error < best_error:
            best, best_error = (a, b), error
        if step >= EM_SOFT_STEPS and previous is not None and previous - error < EM_TOLERANCE * previous:
            break
        previous = error
    a, b = best
    words = _stage_codewords(a, b, traditional)
    index = mx.argmin(pair_distances(*pair_terms(r, a, b, traditional)).reshape(*r.shape[:2], -1), axis=-1)
    return a, b, r - mx.take_along_axis(words, index[..., None].astype(mx.int32), axis=1)


def learn_codebook(keys: mx.array, positions: mx.array, inv_freq: mx.array, traditional: bool, bits: int,
                   seed: int) -> dict:
    """keys (H, N, D) after RoPE at `positions` (N,) -> {"heads.codebook": (H, S, 2, 16, D)} and the
    residual error of the unit pre-RoPE keys after all stages."""
    heads, _, dim = keys.shape
    if (bits * dim) % STAGE_BITS:
        raise ValueError(f"commvq needs bits * head_dim divisible by {STAGE_BITS}, got {bits} x {dim}")
    pre = rotate(keys.astype(mx.float32), -rope_angles(positions, inv_freq), traditional)
    residual = pre / mx.maximum(mx.sqrt(mx.sum(pre * pre, axis=-1, keepdims=True)), 1e-30)
    stages = []
    key = mx.random.key(seed)
    for _ in range(bits * dim // STAGE_BITS):
        key, sub = mx.random.split(key)
        a, b, residual = learn_stage(residual, traditional, sub)
        stages.append(mx.stack([a, b], axis=1))  # (H, 2, 16, D)
        mx.eval(stages[-1], residual)
    error = mx.mean(mx.sum(residual * residual, axis=-1))
    return {"heads.codebook": mx.stack(stages, axis=1)}, float(error.item())


# ---- the model's RoPE ---------------------------------------------------------------------------

def _unsupported(message: str):
    return UnsupportedModelError(message)


def check_model(model) -> None:
    """Refuse, by name, a model whose keys commvq cannot code before RoPE."""
    module = type(model).__module__
    model_type = getattr(getattr(model, "args", None), "model_type", module)
    if module not in SUPPORTED_MODULES:
        raise _unsupported(
            f"commvq codes keys before RoPE and supports llama-family models ({', '.join(SUPPORTED_MODULES)}); "
            f"this model is {model_type} ({module}), which it does not support")


def rope_of(model, layer: int) -> dict:
    """{"rope.inv_freq": (D/2,), "rope.traditional": (1,)} of a layer's RoPE, checked against the
    module itself at a few positions (a per-pair rotation linear in the position, every channel)."""
    rope = model.layers[layer].self_attn.rope
    attention = model.layers[layer].self_attn
    dim = attention.head_dim
    dims = getattr(rope, "dims", dim)
    if dims != dim:
        raise _unsupported(f"commvq: layer {layer}'s RoPE rotates {dims} of {dim} channels (partial rotary)")
    traditional = bool(getattr(rope, "traditional", False))
    if hasattr(rope, "_freqs"):
        inv_freq = getattr(rope, "scale", 1.0) / rope._freqs.astype(mx.float32)
    elif hasattr(rope, "base") and rope.base is not None:
        inv_freq = getattr(rope, "scale", 1.0) * mx.power(mx.array(float(rope.base)),
                                                          -mx.arange(0, dim, 2, dtype=mx.float32) / dim)
    else:
        raise _unsupported(f"commvq: layer {layer}'s RoPE ({type(rope).__name__}) has no frequencies it can read")
    probe = mx.random.normal((1, 1, 3, dim), key=mx.random.key(layer))
    for offset in (1, 777, 4093):
        theirs = rope(probe, offset=offset)
        ours = rotate(probe, rope_angles(mx.arange(offset, offset + 3), inv_freq), traditional)
        if mx.max(mx.abs(theirs - ours)).item() > 1e-3:
            raise _unsupported(f"commvq: layer {layer}'s RoPE ({type(rope).__name__}) is not the per-pair "
                               f"rotation it applies (offset {offset})")
    return {"rope.inv_freq": inv_freq.astype(mx.float32), "rope.traditional": mx.array([int(traditional)], mx.int32)}


@register_method("commvq")
class CommVQ(Method):
    key_bits = range(1, 5)
    value_bits = range(1, 9)
    calibrated = True
    positional = True
    generic_options = {}  # outlier channels would split RoPE pairs: not offered
    status = "experimental"
    status_note = ("llama family only, calibrated; on SmolLM2 the best measured at 2.25-3.25 bits (K2/V2: KL 0.27 "
                   "vs 1.35 for turboquant_mse:2; K2/V4: 0.09 vs 0.29 for turboquant_mse:3), kivi:3:group=32 "
                   "better at 4 bits; with vq3's sinks and window (K2/V3) it finds the needle less often than vq3 "
                   "at 4K-8K tokens; no decode kernel: 0.04x fp16 decode on an H200 at 32K (docs/methods.md)")
    summary = "keys before RoPE, RoPE-commuting residual codebooks learned by EM (calibrated) + fp16 norm"
    values_summary = "turboquant_mse at value_bits"

    @classmethod
    def validate(cls, config) -> None:
        super().validate(config)
        if config.center:
            raise ValueError("commvq codes keys before RoPE: centering (a mean of keys after RoPE) is not offered")

    @classmethod
    def check_model(cls, model) -> None:
        check_model(model)

    @classmethod
    def key_codec(cls, config, dim, params=None):
        if not params or "heads.codebook" not in params:
            raise calibration_needed("commvq (keys)")
        return CommVQKeyCodec(dim, config.bits, params)

    @classmethod
    def value_codec(cls, config, dim, params=None):
        if not params:
            raise calibration_needed("commvq (values)")
        return MSECodec(dim, config.value_bits, config.seed + 1, params)

    @classmethod
    def calibration_inputs(cls, model) -> List[dict]:
        """Per layer: its RoPE's frequencies (what the codec applies at attention time)."""
        check_model(model)
        return [rope_of(model, i) for i in range(len(model.layers))]

    @classmethod
    def calibrate(cls, config, layers, progress=None) -> Optional[List[dict]]:
        from tqdm import tqdm

        out = []
        for index, layer in enumerate(tqdm(layers, desc="commvq EM", unit="layer", disable=not progress)):
            if layer is None:
                out.append(None)
                continue
            traditional = bool(int(layer["rope.traditional"].item()))
            book, error = learn_codebook(layer["keys"], layer["positions"], layer["rope.inv_freq"], traditional,
                                         config.bits, config.seed + 1000 * index)
            keys = {**book, "rope.inv_freq": layer["rope.inv_freq"], "rope.traditional": layer["rope.traditional"],
                    "error": mx.array([error], mx.float32)}
            values = MSECodec(layer["values"].shape[-1], config.value_bits, config.seed + 1).params()
            out.append({"keys": keys, "values": values})
        return out

    @classmethod
    def calibration_summary(cls, learned) -> dict:
        errors = [entry["keys"]["error"].item() for entry in learned if entry]
        return {"key_unit_mse_mean": round(sum(errors) / max(len(errors), 1), 5)}
