"""`QuantizedLinear`: rows normalised, rotated and coded with a Lloyd-Max codebook.

Quantisation (HIGGS, arXiv 2411.17525, Alg. 1, with a per-row instead of a
per-group scale by default): every row w of W is rotated, u = R w / ||w||; after
a random rotation the coordinates of u are close to N(0, 1/n), so one Gaussian
Lloyd-Max codebook c (Lloyd 1982; Max 1960) scaled per group to unit RMS codes
them all. The stored scale of a group is the least-squares one,
||w|| <u_g, c_g> / <c_g, c_g>, which minimises ||u_g ||w|| - s c_g||^2 for the
chosen codes (it is ||w|| times the RMS factor when the codes are exact).

Forward: x W^T = (x R^T)(W R^T)^T, so the input is rotated once and multiplied
against the codes. Up to `kernel.MAX_ROWS` batch rows (decode) go through a LUT
matmul kernel that reads the packed codes directly: on CUDA/Metal the one of
`kernel.py`, on the CPU the C++ one of csrc/lut_matmul.cpp (when built). Larger
batches (prefill) decode the codes a tile of rows at a time and use float matmuls.
"""

from __future__ import annotations

import os
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from ..codebooks import lloyd_max
from ..packing import pack, packed_words, unpack
from . import first_use, kernel, rotating_matmul, rotation_kernel
from .rotation import StructuredRotation

SUPPORTED_BITS = (2, 3, 4)
# Weights decoded at once by the tiled forward (rows = this // in_features): small on the
# CPU (a tile stays in cache), larger on a GPU (fewer launches for prefill-sized batches).
CPU_TILE_ELEMENTS = 1 << 18
GPU_TILE_ELEMENTS = 1 << 22


def tile_elements() -> int:
    env = os.environ.get("VELOXQUANT_WEIGHT_TILE")
    if env:
        return int(env)
    return CPU_TILE_ELEMENTS if mx.default_device() == mx.cpu else GPU_TILE_ELEMENTS
# Batch rows up to which a call goes to a LUT kernel.
MAX_KERNEL_ROWS = kernel.MAX_ROWS
# Rows quantised at once (bounds the working set of quantize_weight).
QUANTIZE_CHUNK_ELEMENTS = 1 << 18


def unit_codebook(bits: int) -> mx.array:
    """Centroids of the Lloyd-Max quantizer of N(0, 1) at `bits` bits."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")
    return lloyd_max("gaussian", bits).centroids


def _group_count(in_features: int, group_size: Optional[int]) -> int:
    if group_size is None or group_size == in_features:
        return 1
    if group_size < 1 or in_features % group_size:
        raise ValueError(f"group_size {group_size} must divide in_features {in_features}")
    return in_features // group_size


def _codes_of(x: mx.array, centroids: mx.array) -> mx.array:
    """Nearest-centroid index of every element: the count of midpoints it exceeds."""
    midpoints = (centroids[1:] + centroids[:-1]) * 0.5
    codes = mx.zeros(x.shape, dtype=mx.uint8)
    for k in range(midpoints.shape[0]):
        codes = codes + (x > midpoints[k]).astype(mx.uint8)
    return codes


def column_scales(weight: mx.array, alpha: float) -> mx.array:
    """c_j = (rms of column j / mean rms)^alpha, fp16 (`QuantizedLinear.from_weight`)."""
    w = weight.astype(mx.float32)
    rms = mx.sqrt((w * w).mean(axis=0))
    return mx.power(mx.maximum(rms, 1e-8) / mx.maximum(rms.mean(), 1e-8), alpha).astype(mx.float16)


def quantize_rows(weight: mx.array, rotation: StructuredRotation, centroids: mx.array, bits: int,
                  groups: int) -> tuple[mx.array, mx.array]:
    """Packed codes (out, words) uint32 and scales (out, groups) float16 of `weight` rows."""
    out_features, in_features = weight.shape
    w = weight.astype(mx.float32)
    norms = mx.sqrt((w * w).sum(axis=-1, keepdims=True))
    u = rotation.apply(w) / mx.maximum(norms, 1e-30)
    u = u.reshape(out_features, groups, in_features // groups)
    rms = mx.sqrt((u * u).mean(axis=-1, keepdims=True))
    codes = _codes_of(u / mx.maximum(rms, 1e-30), centroids)
    c = mx.take(centroids, codes)
    scales = (u * c).sum(axis=-1) / mx.maximum((c * c).sum(axis=-1), 1e-30) * norms
    return pack(codes.reshape(out_features, in_features), bits), scales.astype(mx.float16)


class QuantizedLinear(nn.Module):
    """y = x W^T + b with W stored as `bits`-bit codes of rotated, normalised rows."""

    def __init__(self, in_features: int, out_features: int, bits: int, *, codes: mx.array, scales: mx.array,
                 codebook: mx.array, rotation: StructuredRotation, bias: Optional[mx.array] = None,
                 input_scales: Optional[mx.array] = None, input_rotated: bool = False):
        """`input_rotated`: the layer is called with R (c * x) already formed, by the norm
        before it (`shared.RotatingRMSNorm`), which owns the rotation and the input scales
        (kept here as plain attributes, not parameters, so they are stored once)."""
        super().__init__()
        if bits not in SUPPORTED_BITS:
            raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")
        words = packed_words(in_features, bits)
        if codes.shape != (out_features, words) or codes.dtype != mx.uint32:
            raise ValueError(f"codes must be uint32 of shape ({out_features}, {words}), got {codes.dtype} {codes.shape}")
        if scales.ndim != 2 or scales.shape[0] != out_features or in_features % scales.shape[1]:
            raise ValueError(f"scales of shape {scales.shape} do not fit ({out_features}, {in_features})")
        if codebook.shape != (1 << bits,):
            raise ValueError(f"a {bits}-bit codebook has {1 << bits} entries, got {codebook.shape}")
        if rotation.dim != in_features:
            raise ValueError(f"rotation of dim {rotation.dim} for {in_features} input features")
        self.in_features, self.out_features, self.bits = in_features, out_features, bits
        self.codes = codes
        self.scales = scales
        self.codebook = codebook.astype(mx.float32)
        self.input_rotated = bool(input_rotated)
        self._rotation = rotation  # a plain attribute: its arrays are the parameters below
        if input_scales is not None and input_scales.shape != (in_features,):
            raise ValueError(f"input_scales must have shape ({in_features},), got {input_scales.shape}")
        # plain attribute (an array assigned to a Module would become a parameter)
        self.__dict__["_shared_input_scales"] = input_scales if input_rotated else None
        if not input_rotated:
            self.rotation_signs = rotation.signs
            if rotation.perms is not None:
                self.rotation_perms = rotation.perms
            if input_scales is not None:
                self.input_scales = input_scales
        if bias is not None:
            self.bias = bias
        self.__dict__["_routes"] = {}  # (input shape, dtype) -> the call for it (`_route_for`)
        self.freeze()

    # ---- construction ------------------------------------------------------

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int, seed: int = 0, group_size: Optional[int] = None,
                    stages: int = 2) -> "QuantizedLinear":
        weight = linear.weight
        return cls.from_weight(weight, bits, seed=seed, group_size=group_size, stages=stages,
                               bias=linear.get("bias"))

    @classmethod
    def from_weight(cls, weight: mx.array, bits: int, seed: int = 0, group_size: Optional[int] = None,
                    stages: int = 2, bias: Optional[mx.array] = None,
                    rotation: Optional[StructuredRotation] = None,
                    column_alpha: float = 0.0, calibration_inputs: Optional[mx.array] = None,
                    input_scales: Optional[mx.array] = None) -> "QuantizedLinear":
        """`rotation` overrides the seeded one (benchmarks compare others through it).
        `column_alpha` > 0 divides column j by c_j = rms(W[:, j])^alpha before rotating and
        multiplies the input by c once per call, so that columns of small weights (the input
        channels of large activations, typically) keep proportionally small errors.
        `input_scales` gives c directly instead (layers sharing one input share it:
        `shared.shared_input_scales`); `column_alpha` is then unused.
        `calibration_inputs` (tokens, in), inputs the layer sees, select GPTQ codes (`gptq.py`)
        instead of nearest-centroid ones; the stored format is the same."""
        out_features, in_features = weight.shape
        if input_scales is None and column_alpha:
            input_scales = column_scales(weight, column_alpha)
        if input_scales is not None:
            weight = weight.astype(mx.float32) / input_scales.astype(mx.float32)
            mx.eval(weight, input_scales)
        groups = _group_count(in_features, group_size)
        if rotation is None:
            rotation = StructuredRotation.seeded(in_features, seed, stages)
        centroids = unit_codebook(bits)
        if calibration_inputs is not None:
            return cls._from_inputs(weight, bits, calibration_inputs, rotation, centroids, bias, input_scales,
                                    groups)
        chunk = max(1, QUANTIZE_CHUNK_ELEMENTS // in_features)
        codes, scales = [], []
        for r0 in range(0, out_features, chunk):
            c, s = quantize_rows(weight[r0:r0 + chunk], rotation, centroids, bits, groups)
            mx.eval(c, s)
            codes.append(c)
            scales.append(s)
        codes = codes[0] if len(codes) == 1 else mx.concatenate(codes)
        scales = scales[0] if len(scales) == 1 else mx.concatenate(scales)
        return cls(in_features, out_features, bits, codes=codes, scales=scales, codebook=centroids,
                   rotation=rotation, bias=bias, input_scales=input_scales)

    @classmethod
    def _from_inputs(cls, weight, bits, inputs, rotation, centroids, bias, input_scales,
                     groups) -> "QuantizedLinear":
        import numpy as np

        from .gptq import gptq_codes, rotated_hessian

        out_features, in_features = weight.shape
        if groups != 1:
            raise ValueError("GPTQ codes (calibration_inputs) support one scale per row only (group_size=None)")
        if inputs.ndim != 2 or inputs.shape[1] != in_features:
            raise ValueError(f"calibration_inputs must have shape (tokens, {in_features}), got {inputs.shape}")
        rotated = np.array(rotation.apply(weight.astype(mx.float32)), dtype=np.float64)
        hessian = rotated_hessian(inputs, rotation, input_scales)
        codes, scales = gptq_codes(rotated, hessian, np.array(centroids, dtype=np.float64))
        return cls(in_features, out_features, bits, codes=pack(mx.array(codes), bits),
                   scales=mx.array(scales[:, None].astype(np.float16)), codebook=centroids, rotation=rotation,
                   bias=bias, input_scales=input_scales)

    # ---- views ---------------------------------------------------------------

    @property
    def rotation(self) -> StructuredRotation:
        return self._rotation

    @property
    def column_scales(self) -> Optional[mx.array]:
        """c of the input (None without column scaling), shared or the layer's own."""
        return self._shared_input_scales if self.input_rotated else self.get("input_scales")

    def with_rotated_input(self) -> "QuantizedLinear":
        """The same layer taking R (c * x) as input (its rotation and scales then live in the norm before it)."""
        return type(self)(self.in_features, self.out_features, self.bits, codes=self.codes, scales=self.scales,
                          codebook=self.codebook, rotation=self.rotation, bias=self.get("bias"),
                          input_scales=self.column_scales, input_rotated=True)

    @property
    def group_size(self) -> int:
        return self.in_features // self.scales.shape[1]

    def storage_nbytes(self) -> int:
        """Bytes the weight matrix costs: codes, scales, codebook and rotation (not the bias,
        which every format keeps alike)."""
        arrays = [self.codes, self.scales, self.codebook]
        if not self.input_rotated:  # else the norm that rotates the input stores them, once
            arrays += list(self.rotation.state().values())
            if "input_scales" in self:
                arrays.append(self.input_scales)
        return sum(a.nbytes for a in arrays)

    def bits_per_weight(self) -> float:
        return 8.0 * self.storage_nbytes() / (self.in_features * self.out_features)

    def rotated_weight(self, rows: slice = slice(None), dtype=mx.float32) -> mx.array:
        """Decoded rows in the rotated domain, W R^T (tests and the tiled forward)."""
        codes = unpack(self.codes[rows], self.bits, self.in_features)
        w = mx.take(self.codebook, codes)
        scales = self.scales[rows].astype(mx.float32)
        groups = scales.shape[1]
        n = w.shape[0]
        w = (w.reshape(n, groups, self.in_features // groups) * scales[..., None]).reshape(n, self.in_features)
        return w.astype(dtype)

    # ---- forward ---------------------------------------------------------------

    def __call__(self, x: mx.array) -> mx.array:
        route = self._routes.get((x.shape, x.dtype))
        y = route(x) if route is not None else self._route_for(x)(x)
        if "bias" in self:
            y = y + self["bias"]
        return y

    def _route_for(self, x: mx.array):
        """x -> (x R^T)(W R^T)^T for inputs of x's shape and dtype: the rotation (unless the
        input comes rotated; on a GPU back end, one `rotation_kernel` launch where it takes the
        dimension) and the matmul, the LUT kernel of the device for up to MAX_KERNEL_ROWS rows,
        else the tiled one. Decode-sized routes are kept, so that a
        call costs a dict lookup and the ops themselves: a decode step calls every layer once
        and its Python path is host time the GPU may wait on."""

        rows = x.size // x.shape[-1]
        decode = rows <= MAX_KERNEL_ROWS
        dialect = kernel.dialect_for(x) if decode else None
        # the first stage's signs times the input scale, in x's dtype, as `rotation.apply` forms them
        signs = None if self.input_rotated else self._rotation._signs(0, x.dtype, self.get("input_scales"))
        # on a GPU back end, one batch row: the rotation inside the matmul's launch, where the kernel
        # takes it; one launch for this layer and its siblings where they have been linked
        siblings = self.__dict__.get("_siblings") if dialect else None
        fused = siblings[0].route(siblings[1], x, dialect) if siblings is not None else None
        if fused is None and dialect:
            fused = rotating_matmul.route(self, x, signs, dialect)
        if fused is not None:
            self._routes[(x.shape, x.dtype)] = fused
            return fused
        # on a GPU back end the multiply and the transform in one launch, where the kernel takes them
        rotate = (rotation_kernel.route(x, self._rotation, signs) if decode and not self.input_rotated
                  else None)
        launch = (kernel.launch_function(self, x) if decode and rotate is None and not self.input_rotated
                  else None)
        if launch is None:
            matmul = kernel.route(self, x) if decode else self.tiled_matmul
        if self.input_rotated:
            route = matmul
        elif launch is not None:
            # the rotation's ops and the matmul's launch as one function: one compiled call a step
            apply_signed, run = self._rotation.apply_signed, launch[0]
            rotated_matmul = kernel.compiled(
                lambda x, signs, codes, scales, codebook: run(apply_signed(x * signs), codes, scales, codebook))

            def route(x: mx.array) -> mx.array:
                return rotated_matmul(x, signs, self["codes"], self["scales"], self["codebook"])
        else:
            if rotate is None:
                apply_signed = self._rotation.apply_signed

                def rotate(x: mx.array, signs: mx.array) -> mx.array:
                    return apply_signed(x * signs)
                if decode:  # not prefill shapes: a compiled function traces again for every new shape
                    rotate = kernel.compiled(rotate)

            def route(x: mx.array) -> mx.array:
                return matmul(rotate(x, signs))
        if decode:
            self._routes[(x.shape, x.dtype)] = route
        return route

    def tiled_matmul(self, rotated: mx.array) -> mx.array:
        """(x R^T) (W R^T)^T with the codes decoded `tile_elements()` weights at a time."""
        rows = max(1, tile_elements() // self.in_features)
        parts = []
        for r0 in range(0, self.out_features, rows):
            tile = self.rotated_weight(slice(r0, r0 + rows), rotated.dtype)
            parts.append(rotated @ tile.T)
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)

    def _extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, bias={'bias' in self}")


first_use.register_layer(QuantizedLinear)
