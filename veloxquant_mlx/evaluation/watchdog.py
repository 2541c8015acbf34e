"""Stop a configuration before the machine runs out of memory.

Sweeps call `guard.check()` between chunks and decode steps; it raises
`MemoryGuardTriggered` when free system memory falls under the threshold, and
the sweep records the configuration as "stopped_by_guard" and moves on.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time
from typing import Optional

import mlx.core as mx

STOPPED_BY_GUARD = "stopped_by_guard"


class MemoryGuardTriggered(RuntimeError):
    pass


def _meminfo_available() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _macos_available() -> Optional[int]:
    # free + inactive + purgeable + speculative pages, as Activity Monitor counts "available"
    try:
        text = subprocess.run(["vm_stat"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    page = 4096
    pages = {}
    for line in text.splitlines():
        if "page size of" in line:
            page = int(line.split("page size of")[1].split()[0])
        key, sep, value = line.partition(":")
        if sep:
            try:
                pages[key.strip()] = int(value.strip().rstrip("."))
            except ValueError:
                pass
    names = ("Pages free", "Pages inactive", "Pages purgeable", "Pages speculative")
    if not any(n in pages for n in names):
        return None
    return page * sum(pages.get(n, 0) for n in names)


def available_memory_bytes() -> Optional[int]:
    """Memory the system can still hand out, or None when it cannot be read."""
    if sys.platform.startswith("linux"):
        available = _meminfo_available()
        if available is not None:
            return available
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:
        pass
    if sys.platform == "darwin":
        return _macos_available()
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


class MemoryGuard:
    """Raises `MemoryGuardTriggered` from `check()` when free memory < `min_free_gb`.

    Reads are spaced by at least `interval_s` so per-token checks stay cheap.
    """

    def __init__(self, min_free_gb: float = 2.0, interval_s: float = 0.2):
        self.min_free_bytes = int(min_free_gb * 1024**3)
        self.min_free_gb = min_free_gb
        self.interval_s = interval_s
        self._last_read = -float("inf")

    def check(self, where: str = "") -> None:
        if self.min_free_bytes <= 0:
            return
        now = time.monotonic()
        if now - self._last_read < self.interval_s:
            return
        self._last_read = now
        available = available_memory_bytes()
        if available is not None and available < self.min_free_bytes:
            self._last_read = -float("inf")  # the next configuration checks at once
            raise MemoryGuardTriggered(
                f"free memory {available / 1024**3:.2f} GiB < {self.min_free_gb:g} GiB"
                + (f" ({where})" if where else "")
            )


def release_memory() -> None:
    """Give back what a stopped configuration held (call after dropping its caches)."""
    gc.collect()
    mx.clear_cache()
