"""Starting two or more ranks with `mlx.launch` from a benchmark or a test, without the launcher taking a core.

`mlx.launch` (MLX 0.32) watches each rank in a loop that `select()`s the rank's output and, always, the rank's stdin
for writing, with a 1 s timeout. A pipe is almost always writable, so the select returns at once and the loop spins,
taking a core from the ranks (docs/distributed.md). Its main loop also spins when its own stdin is at end of file
(/dev/null, as pytest and `nohup` give). `command(ARGS)` (or `python -m veloxquant_mlx.evaluation.launcher ARGS`)
runs `mlx.launch ARGS` with a select that first waits for output alone, and a /dev/null stdin replaced by an empty
pipe; `idle_stdin` gives it such a stdin from the caller's side."""

from __future__ import annotations

import contextlib
import os
import select
import stat
import sys
import warnings

# The longest a rank's stdin waits to be forwarded: the watch loop writes it only after this wait.
STDIN_LATENCY_S = 0.05


def patient_select(rlist, wlist, xlist, timeout=None):
    """`select.select`, except that with write targets and a timeout it first waits on the readers alone."""
    if wlist and timeout:
        select.select(rlist, [], xlist, min(timeout, STDIN_LATENCY_S))
        return select.select(rlist, wlist, xlist, 0)
    return select.select(rlist, wlist, xlist, timeout)


@contextlib.contextmanager
def idle_stdin():
    """A file descriptor to pass as the launcher's stdin: a pipe that stays open and empty."""
    read, write = os.pipe()
    try:
        yield read
    finally:
        os.close(read)
        os.close(write)


def command(*arguments) -> list:
    """The command line that runs `mlx.launch arguments` through this file, run as a script: it imports no more
    than the launcher does."""
    return [sys.executable, os.path.abspath(__file__), *map(str, arguments)]


def _stdin_is_devnull() -> bool:
    try:
        stdin, null = os.fstat(0), os.stat(os.devnull)
    except OSError:
        return False
    return stat.S_ISCHR(stdin.st_mode) and stdin.st_rdev == null.st_rdev


def main():
    from mlx._distributed_utils import launch

    if _stdin_is_devnull():  # the ranks read nothing from it either way
        idle, _ = os.pipe()  # the write end stays open, unused, until the launcher exits
        os.dup2(idle, 0)

    if getattr(launch, "select", None) is select.select:
        launch.select = patient_select
    else:
        warnings.warn("veloxquant_mlx: this MLX's mlx.launch does not select() as MLX 0.32's does; running it "
                      "unchanged (it may take a core while the ranks run)")
    return launch.main()


if __name__ == "__main__":
    sys.exit(main())
