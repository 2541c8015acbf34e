"""A fast CPU BLAS on Linux.

MLX's Linux CPU wheels bundle the reference BLAS, whose `cblas_sgemm` is an order of magnitude slower
than OpenBLAS's. Preloading a system OpenBLAS (`LD_PRELOAD`) makes MLX's calls resolve to it. The dynamic
loader reads `LD_PRELOAD` only when a process starts, so the `veloxquant` command starts itself once more
with it set (`preload_openblas`); a program that imports the library can only be told how (`slow_blas_warning`).
`VELOXQUANT_NO_PRELOAD=1` turns both off.
"""

from __future__ import annotations

import ctypes.util
import os
import platform
import sys
import warnings
from typing import Optional, Sequence

NO_PRELOAD = "VELOXQUANT_NO_PRELOAD"
PRELOADED = "VELOXQUANT_OPENBLAS_PRELOADED"  # set in the restarted process, so that it restarts once at most
INSTALL = "sudo apt-get install libopenblas0-pthread"


def openblas_candidates() -> list:
    """Where distributions put OpenBLAS (Debian/Ubuntu's pthread build first, as the Makefile uses)."""
    arch = f"{platform.machine()}-linux-gnu"
    return [
        f"/usr/lib/{arch}/openblas-pthread/libblas.so.3",
        f"/usr/lib/{arch}/openblas-pthread/libopenblas.so.0",
        f"/usr/lib/{arch}/libopenblas.so.0",
        "/usr/lib64/libopenblasp.so.0",  # Fedora's pthread build
        "/usr/lib64/libopenblas.so.0",
        "/usr/lib/libopenblas.so.0",  # Arch
    ]


def find_openblas() -> Optional[str]:
    """A path (or loader-resolvable name) of a system OpenBLAS, or None."""
    for path in openblas_candidates():
        if os.path.exists(path):
            return path
    return ctypes.util.find_library("openblas")


def openblas_loaded() -> bool:
    """Whether MLX's BLAS calls resolve to an OpenBLAS: one in the process's global symbol scope, where a
    preload puts it. (Mapped is not enough: numpy maps its own OpenBLAS, whose symbols are renamed and local.)"""
    try:
        return hasattr(ctypes.CDLL(None), "openblas_get_config")
    except OSError:
        return False


def cpu_backend() -> bool:
    """Whether MLX computes on the CPU by default (no Metal or CUDA device)."""
    import mlx.core as mx

    return mx.default_device() == mx.cpu


def applies() -> bool:
    """Linux, MLX on the CPU, not turned off, and no OpenBLAS mapped yet."""
    return (sys.platform.startswith("linux") and not os.environ.get(NO_PRELOAD)
            and cpu_backend() and not openblas_loaded())


def slow_blas_message(library: bool = False) -> str:
    """The one line that tells how to get the fast BLAS."""
    found = find_openblas()
    if found is None:
        fix = f"install OpenBLAS: `{INSTALL}`"
    elif library:
        fix = f"start python with `LD_PRELOAD={found}`"
    else:
        fix = f"`LD_PRELOAD={found}` did not take"
    return (f"veloxquant: MLX is using its bundled reference BLAS on the CPU, about 10x slower than OpenBLAS; "
            f"{fix} (set {NO_PRELOAD}=1 to silence this)")


def preload_openblas(argv: Optional[Sequence[str]] = None) -> bool:
    """Restart this process with OpenBLAS preloaded, where that applies and one is found; never returns then.

    `argv` is the full command line to run again (default `sys.orig_argv`). Returns False when no restart
    applies; prints `slow_blas_message` (one line, stderr) where one would help but none is possible."""
    if not applies():
        return False
    found = find_openblas()
    if found is None or os.environ.get(PRELOADED):
        print(slow_blas_message(), file=sys.stderr, flush=True)
        return False
    env = dict(os.environ)
    env["LD_PRELOAD"] = " ".join(filter(None, [found, env.get("LD_PRELOAD")]))
    env[PRELOADED] = "1"
    argv = list(argv if argv is not None else sys.orig_argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, argv, env)
    return True  # not reached


def slow_blas_warning() -> None:
    """Warn once, at import, where MLX runs on the CPU with the reference BLAS (a program that imports
    the library cannot preload for itself)."""
    if os.path.basename(sys.argv[0] if sys.argv else "") in ("veloxquant", "-m"):
        return  # the `veloxquant` command (or `python -m veloxquant_mlx...`) preloads for itself in `main`
    if applies():
        warnings.warn(slow_blas_message(library=True), RuntimeWarning, stacklevel=2)
