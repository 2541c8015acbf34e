"""First-use checks of the weights' optional GPU kernels (`rotation_kernel`, `rotating_matmul`):
each module keeps its own verdicts (a dict keyed by dialect first); a failed case warns once, naming
the kernel, the case and the error, and the caller keeps its slower route (never silently)."""

from __future__ import annotations

import warnings
from typing import Callable, Dict, Iterable, Optional


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
