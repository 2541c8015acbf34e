"""Check the LUT matmul kernel on a back end against the tiled matmul and float64 numpy.

    python -m veloxquant_mlx.weights.selftest                     # the GPU back end MLX has (cuda / metal)
    python -m veloxquant_mlx.weights.selftest --backend emulator  # the same kernel text in C++, on the CPU

Every case draws its weights and inputs from `numpy.random.default_rng(seed)`, quantizes
them with `QuantizedLinear.from_weight` and compares `kernel.lut_matmul` with

* ``tiled``:  the layer's tiled matmul (MLX ops on the same codes),
* ``numpy``:  x_rot @ W_hat^T in float64, W_hat decoded from the codes in numpy,
* on a GPU also ``route`` and ``compiled``: the layer's own forward on the rotated input
  (`QuantizedLinear(input_rotated=True)`: the launch arguments it keeps per input shape, the
  input as (1, rows, in)), without and with mx.compile around the launch (`kernel.COMPILE_ROUTES`),

as max |out - ref| / max |ref|. Tolerance: 1e-4 for float32 inputs (float32 sums in another
order), 4e-3 for float16. On a CUDA GPU MLX runs float32 matmuls at TF32 unless
MLX_ENABLE_TF32=0, which only affects the ``tiled`` reference: run with MLX_ENABLE_TF32=0.
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
from .linear import QuantizedLinear
from . import kernel

TOLERANCES = {"float32": 1e-4, "float16": 4e-3}


@dataclass
class Case:
    name: str
    out_features: int
    in_features: int
    bits: int
    rows: int
    group_size: Optional[int] = None
    dtype: str = "float32"
    seed: int = 0


CASES = [
    Case("4bit-llama-qproj-m1", 4096, 4096, 4, 1),
    Case("3bit-odd-dim-m3", 300, 576, 3, 3),
    Case("2bit-groups-m8", 256, 1536, 2, 8, group_size=64),
    Case("3bit-ragged-m5", 37, 176, 3, 5),
    Case("4bit-fp16-m2", 512, 4864, 4, 2, dtype="float16"),
    Case("3bit-groups128-fp16-m4", 1024, 1024, 3, 4, group_size=128, dtype="float16"),
]
EMULATOR_CASES = ["3bit-odd-dim-m3", "2bit-groups-m8", "3bit-ragged-m5"]


def _numpy_reference(layer: QuantizedLinear, x_rot: np.ndarray) -> np.ndarray:
    codes = np.array(unpack(layer.codes, layer.bits, layer.in_features)).astype(np.int64)
    w = np.array(layer.codebook).astype(np.float64)[codes]
    scales = np.array(layer.scales.astype(mx.float32)).astype(np.float64)
    groups = scales.shape[1]
    w = (w.reshape(len(w), groups, -1) * scales[..., None]).reshape(len(w), -1)
    return x_rot.astype(np.float64) @ w.T


def run_case(case: Case, backend: str) -> dict:
    rng = np.random.default_rng(case.seed)
    weight = mx.array(rng.standard_normal((case.out_features, case.in_features)).astype(np.float32))
    layer = QuantizedLinear.from_weight(weight, case.bits, seed=case.seed, group_size=case.group_size)
    dtype = getattr(mx, case.dtype)
    x = mx.array(rng.standard_normal((case.rows, case.in_features)).astype(np.float32))
    x_rot = layer.rotation.apply(x).astype(dtype)
    got = np.array(kernel.lut_matmul(x_rot, layer, backend).astype(mx.float32))
    tiled = np.array(layer.tiled_matmul(x_rot).astype(mx.float32))
    exact = _numpy_reference(layer, np.array(x_rot.astype(mx.float32)))
    scale = np.abs(exact).max()
    errors = {"tiled": float(np.abs(got - tiled).max() / scale), "numpy": float(np.abs(got - exact).max() / scale)}
    if backend != "emulator":
        for name, compiled in (("route", False), ("compiled", True)):
            kernel.COMPILE_ROUTES, before = compiled, kernel.COMPILE_ROUTES
            try:
                routed = layer.with_rotated_input()(x_rot[None])
                errors[name] = float(np.abs(np.array(routed.astype(mx.float32))[0] - exact).max() / scale)
                if routed.shape != (1, case.rows, case.out_features):
                    errors[name] = float("inf")
            except Exception as exc:  # noqa: BLE001 - a failing launch is a failed case, reported as such
                print(f"{case.name} {name}: {type(exc).__name__}: {exc}", file=sys.stderr)
                errors[name] = float("inf")
            finally:
                kernel.COMPILE_ROUTES = before
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
    names = args.cases.split(",") if args.cases else (EMULATOR_CASES if backend == "emulator" else [c.name for c in CASES])
    results = []
    for case in CASES:
        if case.name not in names:
            continue
        r = run_case(case, backend)
        results.append(r)
        errors = "  ".join(f"{k} {v:.2e}" for k, v in r["errors"].items())
        print(f"{'ok  ' if r['ok'] else 'FAIL'} {case.name:28s} {errors}  (tol {r['tolerance']:.0e})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    failed = [r["name"] for r in results if not r["ok"]]
    print(f"{len(results) - len(failed)}/{len(results)} cases passed on {backend}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
