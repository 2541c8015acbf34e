"""First-use checks of the weights' optional GPU kernels (`rotation_kernel`, `rotating_matmul`):
each module keeps its own verdicts (a dict keyed by dialect first); a failed case warns once, naming
the kernel, the case and the error, and the caller keeps its slower route (never silently)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Optional

import mlx.core as mx
import numpy as np

# The weight layer class the checks quantize their test weights with: `linear.py` registers
# `QuantizedLinear` (`register_layer`), so that the kernels the layer calls never import it.
_LAYER: Optional[type] = None


def register_layer(cls: type) -> None:
    global _LAYER
    _LAYER = cls


def layer_class() -> type:
    if _LAYER is None:
        raise RuntimeError("no weight layer class is registered: import veloxquant_mlx.weights.linear")
    return _LAYER


# The LUT matmul's cases: the self-test (`selftest.py`) runs them all, the first-use check
# (`kernel.usable`) the small ones.


def run(dialect: str, cases: Iterable[tuple], check_case: Callable[..., dict], describe: Callable[[tuple], str],
        kernel: str, source: str, instead: str) -> bool:
    """`check_case(dialect, *case)` (a record with "ok", "vs_ops", "tolerance") for every case;
    True if all pass, else a RuntimeWarning: "`kernel` (`source`) failed ...; `instead`"."""
    failures = []
    for case in cases:
        try:
            record = check_case(dialect, *case)
        except Exception as error:  # noqa: BLE001 - any failure turns the kernel off, loudly
            failures.append(f"{describe(case)}: {error!r}"[:500])
            continue
        if not record["ok"]:
            failures.append(f"{describe(case)}: error {record['vs_ops']:.2e} against the MLX ops "
                            f"(tolerance {record['tolerance']:.0e})")
    if failures:
        warnings.warn(f"veloxquant_mlx: the {dialect} kernel {kernel} ({source}) failed its first-use check and "
                      f"is off for this process; {instead} " + "; ".join(failures), RuntimeWarning, stacklevel=4)
    return not failures


def checked(verdicts: Dict[tuple, bool], dialect: str) -> Optional[bool]:
    """Whether every check run on `dialect` passed (None: none ran)."""
    found = [v for k, v in verdicts.items() if k[0] == dialect]
    return all(found) if found else None


TOLERANCES = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 2e-2}


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


def case_arrays(case: Case):
    """(layer, input, rotated input) of a case: what the self-test and the LUT matmul's first-use
    check (`kernel.usable`) run."""
    rng = np.random.default_rng(case.seed)
    weight = mx.array(rng.standard_normal((case.out_features, case.in_features)).astype(np.float32))
    layer = layer_class().from_weight(weight, case.bits, seed=case.seed, group_size=case.group_size)
    x = mx.array(rng.standard_normal((case.rows, case.in_features)).astype(np.float32))
    return layer, x, layer.rotation.apply(x).astype(getattr(mx, case.dtype))
