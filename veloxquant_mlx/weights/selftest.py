"""Check the weights' kernels on a back end: the LUT matmul against the tiled matmul and float64
numpy, the fused input rotation against the MLX ops and float64 numpy.

    python -m veloxquant_mlx.weights.selftest                     # the GPU back end MLX has (cuda / metal)
    python -m veloxquant_mlx.weights.selftest --backend emulator  # the same kernel text in C++, on the CPU

Every case draws its weights and inputs from `numpy.random.default_rng(seed)`, quantizes
them with `QuantizedLinear.from_weight` and compares `kernel.lut_matmul` with

* ``tiled``:  the layer's tiled matmul (MLX ops on the same codes),
* ``numpy``:  x_rot @ W_hat^T in float64, W_hat decoded from the codes in numpy,
* on a GPU also ``route`` and ``compiled``: the layer's own forward on the rotated input
  (`QuantizedLinear(input_rotated=True)`: the launch arguments it keeps per input shape, the
  input as (1, rows, in)), without and with mx.compile around the launch (`kernel.COMPILE_ROUTES`),

as max |out - ref| / max |ref|; on a GPU also ``layer``: the layer's forward on the unrotated
input (its own rotation route: on CUDA/Metal the fused `rotation_kernel` launch where it takes
the dimension). Tolerance: 1e-4 for float32 inputs (float32 sums in another
order), 4e-3 for float16, 2e-2 for bfloat16. On a CUDA GPU MLX runs float32 matmuls at TF32 unless
MLX_ENABLE_TF32=0, which only affects the ``tiled`` reference: run with MLX_ENABLE_TF32=0.

The ``rotate-*`` / ``rmsnorm-rotate-*`` cases check the fused input-rotation kernel
(`rotation_kernel.rotate`: x * signs * column scale, or the shared norm's rms_norm times its
folded weight, then the Hadamard transform, in one launch) against

* ``ops``:    the MLX ops it replaces (`StructuredRotation.apply`, `RotatingRMSNorm`'s ops),
* ``numpy``:  the same in float64 (x as an (m, 2^k) matrix: B^T X H / sqrt(2^k)),
* on a GPU also ``route`` and ``compiled``: the launch a layer keeps (`rotation_kernel.route`),
  without and with mx.compile around it.

The ``rotating-*`` cases check the LUT matmul with the rotation in its prologue
(`rotating_matmul.py`, one batch row) against the two-step MLX forward (``ops``), and on a GPU
the layer's own forward through the route it keeps (``layer``, ``compiled``). The ``siblings-*``
cases check the grouped form (q/k/v or gate/up in one launch) the same way (``ops``; on a GPU
``layers`` and ``compiled`` through linked layers, `siblings.py`).

Exit status 1 if any case fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from typing import Optional

import mlx.core as mx
import numpy as np

from ..packing import unpack
from ..rotations import hadamard_base
from .linear import QuantizedLinear
from .rotation import StructuredRotation
from .shared import RotatingRMSNorm
from . import kernel, rotating_matmul, rotation_kernel
from .first_use import CASES, EMULATOR_CASES, TOLERANCES, Case, case_arrays  # noqa: F401  (shared with the first-use check)

@dataclass
class RotationCase:
    name: str
    dim: int
    rows: int
    norm: bool = False  # the shared norm's form: rms_norm(x) times its folded weight
    scaled: bool = True  # a column scale times the signs (per-layer form)
    dtype: str = "float32"
    threads: int = rotation_kernel.MAX_THREADS
    buffer: int = rotation_kernel.BUFFER_FLOATS
    seed: int = 0


ROTATION_CASES = [
    RotationCase("rotate-4096-fp16-m1", 4096, 1, dtype="float16"),
    RotationCase("rotate-14336-fp16-m8", 14336, 8, dtype="float16"),
    RotationCase("rotate-4096-m3", 4096, 3),
    RotationCase("rotate-14336-noscale-m2", 14336, 2, scaled=False),
    RotationCase("rotate-1536-bf16-m2", 1536, 2, dtype="bfloat16"),
    RotationCase("rmsnorm-rotate-4096-fp16-m4", 4096, 4, norm=True, dtype="float16"),
    RotationCase("rmsnorm-rotate-4096-bf16-m1", 4096, 1, norm=True, dtype="bfloat16"),
    RotationCase("rotate-224-fp16-m2", 28 * 8, 2, dtype="float16"),
    RotationCase("rotate-64-threads16-m2", 64, 2, threads=16, buffer=64),
    RotationCase("rmsnorm-rotate-448-buffer64-m3", 28 * 16, 3, norm=True, threads=16, buffer=64),
]
EMULATOR_ROTATION_CASES = ["rotate-224-fp16-m2", "rotate-64-threads16-m2", "rmsnorm-rotate-448-buffer64-m3"]


@dataclass
class RotatingCase:
    """The LUT matmul with the input rotation in its prologue (`rotating_matmul.py`), one batch row."""
    name: str
    in_features: int
    out_features: int
    bits: int
    group_size: Optional[int] = None
    dtype: str = "float32"
    threads: int = rotating_matmul.THREADS
    rpw: Optional[int] = None  # rows per warp; None: the plan's choice


ROTATING_CASES = [
    RotatingCase("rotating-4096x4096-fp16-b4", 4096, 4096, 4, dtype="float16"),
    RotatingCase("rotating-4096x14336-fp16-b4", 4096, 14336, 4, dtype="float16"),
    RotatingCase("rotating-4096x1024-bf16-b3", 4096, 1024, 3, dtype="bfloat16"),
    RotatingCase("rotating-4096x512-b2-groups128", 4096, 512, 2, group_size=128),
    RotatingCase("rotating-128x72-b3-groups32-threads32-rpw4", 128, 72, 3, group_size=32, threads=32, rpw=4),
    RotatingCase("rotating-64x40-fp16-threads32-rpw2", 64, 40, 4, dtype="float16", threads=32, rpw=2),
]
EMULATOR_ROTATING_CASES = ["rotating-128x72-b3-groups32-threads32-rpw4", "rotating-64x40-fp16-threads32-rpw2"]


def run_rotating_case(case: RotatingCase, backend: str) -> dict:
    """``ops``: the kernel against the two-step MLX forward; on a GPU also ``layer`` and ``compiled``:
    the layer's own forward on one row (the route it keeps), without and with mx.compile."""
    record = rotating_matmul.check_case(backend, case.in_features, case.out_features, case.bits, case.group_size,
                                        case.dtype, case.threads, case.rpw)
    errors = {"ops": record["vs_ops"]}
    if backend != "emulator" and case.threads == rotating_matmul.THREADS and case.rpw is None:
        rng = np.random.default_rng([1, case.in_features, case.out_features])
        weight = mx.array(rng.standard_normal((case.out_features, case.in_features)).astype(np.float32))
        x = mx.array(rng.standard_normal((1, 1, case.in_features)).astype(np.float32)).astype(getattr(mx, case.dtype))

        def through_layer():
            layer = QuantizedLinear.from_weight(weight, case.bits, group_size=case.group_size, column_alpha=0.5)
            if rotating_matmul.route(layer, x, layer.rotation._signs(0, x.dtype, layer.input_scales), backend) is None:
                return float("inf")
            ref = layer.tiled_matmul(layer.rotation.apply(x, layer.input_scales).astype(mx.float32))
            return float(mx.max(mx.abs(layer(x).astype(mx.float32) - ref)) / mx.max(mx.abs(ref)))
        for name, compiled in (("layer", False), ("compiled", True)):
            errors[name] = _route_error(case.name, name, compiled, through_layer)
    tolerance = TOLERANCES[case.dtype]
    return {**asdict(case), "kernel": rotating_matmul.KERNEL_NAME, "backend": backend, "errors": errors,
            "tolerance": tolerance, "ok": all(e <= tolerance for e in errors.values())}


@dataclass
class SiblingCase(RotatingCase):
    """Sibling layers reading one input in one launch (`rotating_matmul.group_matmul`), one batch
    row: `out_features` holds each layer's rows."""
    out_features: tuple


SIBLING_CASES = [
    SiblingCase("siblings-qkv-4096-fp16-b4", 4096, (4096, 1024, 1024), 4, dtype="float16"),
    SiblingCase("siblings-gate-up-4096-fp16-b4", 4096, (14336, 14336), 4, dtype="float16"),
    SiblingCase("siblings-qkv-4096-bf16-b3-groups128", 4096, (4096, 1024, 1024), 3, group_size=128,
                dtype="bfloat16"),
    SiblingCase("siblings-128x72x16x16-b3-groups32-threads32", 128, (72, 16, 16), 3, group_size=32, threads=32,
                rpw=1),
    SiblingCase("siblings-64x40x24-fp16-threads32-rpw2", 64, (40, 24), 4, dtype="float16", threads=32, rpw=2),
]
EMULATOR_SIBLING_CASES = ["siblings-128x72x16x16-b3-groups32-threads32", "siblings-64x40x24-fp16-threads32-rpw2"]


def run_sibling_case(case: SiblingCase, backend: str) -> dict:
    """``ops``: the launch against each layer's two-step MLX forward; on a GPU also ``layers`` and
    ``compiled``: the linked layers' own forwards on one row (`siblings.SiblingLaunch`), without
    and with mx.compile."""
    from .siblings import SiblingLaunch

    record = rotating_matmul.check_group_case(backend, case.in_features, case.out_features, case.bits,
                                              case.group_size, case.dtype, case.threads, case.rpw)
    errors = {"ops": record["vs_ops"]}
    if backend != "emulator" and case.threads == rotating_matmul.THREADS and case.rpw is None:
        rng = np.random.default_rng([2, case.in_features, *case.out_features])
        weights = [mx.array(rng.standard_normal((n, case.in_features)).astype(np.float32))
                   for n in case.out_features]
        x = mx.array(rng.standard_normal((1, 1, case.in_features)).astype(np.float32)).astype(getattr(mx, case.dtype))

        def through_layers():
            layers = [QuantizedLinear.from_weight(w, case.bits, seed=i, group_size=case.group_size, column_alpha=0.5)
                      for i, w in enumerate(weights)]
            group = SiblingLaunch(layers)
            if group.route(0, x, backend) is None:
                return float("inf")
            for index, layer in enumerate(layers):
                layer.__dict__["_siblings"] = (group, index)
            error = 0.0
            for layer, out in [(layer, layer(x)) for layer in layers]:
                ref = layer.tiled_matmul(layer.rotation.apply(x, layer.input_scales).astype(mx.float32))
                error = max(error, float(mx.max(mx.abs(out.astype(mx.float32) - ref)) / mx.max(mx.abs(ref))))
            return error
        for name, compiled in (("layers", False), ("compiled", True)):
            errors[name] = _route_error(case.name, name, compiled, through_layers)
    tolerance = TOLERANCES[case.dtype]
    return {**asdict(case), "kernel": record["kernel"], "backend": backend, "errors": errors,
            "tolerance": tolerance, "ok": all(e <= tolerance for e in errors.values())}


def _numpy_rotation(x: np.ndarray, dim: int) -> np.ndarray:
    """mx.hadamard_transform in float64: rows of x as (m, 2^k) matrices X, B^T X H / sqrt(2^k)."""
    m = hadamard_base(dim)
    p = dim // m
    y = x.reshape(len(x), m, p).copy()
    h = 1
    while h < p:
        y = y.reshape(len(x), m, p // (2 * h), 2, h)
        y = np.stack([y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]], axis=-2)
        h *= 2
    y = y.reshape(len(x), m, p) / np.sqrt(p)
    base = np.array(rotation_kernel.base_matrix(dim)).astype(np.float64)
    return np.einsum("ab,rap->rbp", base, y).reshape(len(x), dim)


def _route_error(case_name: str, name: str, compiled: bool, run) -> float:
    """`run()`'s error with the layers' routes compiled or not; a failing launch is a failed case (inf),
    reported as such."""
    kernel.COMPILE_ROUTES, before = compiled, kernel.COMPILE_ROUTES
    try:
        return run()
    except Exception as exc:  # noqa: BLE001
        print(f"{case_name} {name}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return float("inf")
    finally:
        kernel.COMPILE_ROUTES = before


def run_rotation_case(case: RotationCase, backend: str) -> dict:
    rng = np.random.default_rng([case.seed, case.dim, case.rows])
    dtype = getattr(mx, case.dtype)
    rotation = StructuredRotation.seeded(case.dim, case.seed)
    scales = mx.array(rng.uniform(0.3, 3.0, case.dim).astype(np.float16)) if case.scaled else None
    x = mx.array(rng.standard_normal((case.rows, case.dim)).astype(np.float32) * 3.0).astype(dtype)
    x64 = np.array(x.astype(mx.float32)).astype(np.float64)
    if case.norm:
        gain = mx.array(rng.uniform(0.5, 1.5, case.dim).astype(np.float32)).astype(dtype)
        norm = RotatingRMSNorm(gain, 1e-5, rotation, scales)
        weight, eps = norm.folded_weight, norm.eps
        ops = rotation.apply_signed(mx.fast.rms_norm(x, weight, eps))
        x64 = x64 / np.sqrt((x64 * x64).mean(axis=-1, keepdims=True) + eps)
    else:
        weight, eps = rotation._signs(0, dtype, scales), None
        ops = rotation.apply(x, scales)
    exact = _numpy_rotation(x64 * np.array(weight.astype(mx.float32)).astype(np.float64), case.dim)
    got = rotation_kernel.rotate(x, weight, backend, eps, case.threads, case.buffer)
    scale = np.abs(exact).max()

    def error(out: mx.array) -> float:
        if out.shape != x.shape or out.dtype != ops.dtype:
            return float("inf")
        return float(np.abs(np.array(out.astype(mx.float32)) - exact).max() / scale)
    errors = {"ops": float(np.abs(np.array(got.astype(mx.float32)) - np.array(ops.astype(mx.float32))).max() / scale),
              "numpy": error(got)}
    if backend != "emulator" and case.threads == rotation_kernel.MAX_THREADS:
        def through_route():
            # the route as a layer keeps it when the kernel is on (it is opt-in: FUSED_ROTATION)
            rotation_kernel.FUSED_ROTATION, before = True, rotation_kernel.FUSED_ROTATION
            try:
                route = rotation_kernel.route(x, rotation, weight, eps)
            finally:
                rotation_kernel.FUSED_ROTATION = before
            return float("inf") if route is None else error(route(x, weight))
        for name, compiled in (("route", False), ("compiled", True)):
            errors[name] = _route_error(case.name, name, compiled, through_route)
    tolerance = TOLERANCES[case.dtype]
    return {**asdict(case), "kernel": rotation_kernel.KERNEL_NAME, "backend": backend, "errors": errors,
            "tolerance": tolerance, "ok": all(e <= tolerance for e in errors.values())}


def _numpy_reference(layer: QuantizedLinear, x_rot: np.ndarray) -> np.ndarray:
    codes = np.array(unpack(layer.codes, layer.bits, layer.in_features)).astype(np.int64)
    w = np.array(layer.codebook).astype(np.float64)[codes]
    scales = np.array(layer.scales.astype(mx.float32)).astype(np.float64)
    groups = scales.shape[1]
    w = (w.reshape(len(w), groups, -1) * scales[..., None]).reshape(len(w), -1)
    return x_rot.astype(np.float64) @ w.T


def run_case(case: Case, backend: str) -> dict:
    layer, x, x_rot = case_arrays(case)
    dtype = getattr(mx, case.dtype)
    got = np.array(kernel.lut_matmul(x_rot, layer, backend).astype(mx.float32))
    tiled = np.array(layer.tiled_matmul(x_rot).astype(mx.float32))
    exact = _numpy_reference(layer, np.array(x_rot.astype(mx.float32)))
    scale = np.abs(exact).max()
    errors = {"tiled": float(np.abs(got - tiled).max() / scale), "numpy": float(np.abs(got - exact).max() / scale)}
    if backend != "emulator":
        def through(name):
            def run():
                if name == "layer":  # the layer's own rotation route on x
                    routed = layer(x.astype(dtype)[None])
                else:
                    routed = layer.with_rotated_input()(x_rot[None])
                if routed.shape != (1, case.rows, case.out_features):
                    return float("inf")
                return float(np.abs(np.array(routed.astype(mx.float32))[0] - exact).max() / scale)
            return run
        for name, compiled in (("route", False), ("compiled", True), ("layer", False)):
            errors[name] = _route_error(case.name, name, compiled, through(name))
    tolerance = TOLERANCES[case.dtype]
    return {**asdict(case), "backend": backend, "errors": errors, "tolerance": tolerance,
            "ok": all(e <= tolerance for e in errors.values())}


def default_backend() -> str:
    dialect = kernel._gpu_dialect()
    if dialect is None:
        raise SystemExit("no GPU back end (cuda/metal) here: pass --backend emulator to check the kernel text on the CPU")
    return dialect


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("cuda", "metal", "emulator"), default=None)
    parser.add_argument("--cases", default=None, help="comma-separated case names (default: all; emulator: small ones)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    backend = args.backend or default_backend()
    every = CASES + ROTATION_CASES + ROTATING_CASES + SIBLING_CASES
    if args.cases:
        names = args.cases.split(",")
    elif backend == "emulator":
        names = EMULATOR_CASES + EMULATOR_ROTATION_CASES + EMULATOR_ROTATING_CASES + EMULATOR_SIBLING_CASES
    else:
        names = [c.name for c in every]
    unknown = set(names) - {c.name for c in every}
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}")
    runners = {Case: run_case, RotationCase: run_rotation_case, RotatingCase: run_rotating_case,
               SiblingCase: run_sibling_case}
    results = []
    for case in every:
        if case.name not in names:
            continue
        r = runners[type(case)](case, backend)
        results.append(r)
        errors = "  ".join(f"{k} {v:.2e}" for k, v in r["errors"].items())
        print(f"{'ok  ' if r['ok'] else 'FAIL'} {case.name:32s} {errors}  (tol {r['tolerance']:.0e})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    failed = [r["name"] for r in results if not r["ok"]]
    print(f"{len(results) - len(failed)}/{len(results)} cases passed on {backend}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
