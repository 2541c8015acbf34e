"""Writing a command's output without losing data: `--out` is checked before any long work,
an existing file or non-empty folder is replaced only when asked (`--force`), nothing is
written through a symbolic link, and the output appears whole or not at all (written beside
its destination, then renamed over it; removed on an error, Ctrl-C or SIGTERM)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path
from typing import Iterator, Optional


class OutputError(ValueError):
    """A user's output path that cannot be written as asked (reported in one line)."""


def _check_parent(path: Path, what: str) -> None:
    parent = path.parent
    if not parent.is_dir():
        raise OutputError(f"{what} {path}: the folder {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"{what} {path}: the folder {parent} is not writable")
    if path.is_symlink():
        raise OutputError(f"{what} {path} is a symbolic link (to {os.readlink(path)}); give the real path")


def check_out_file(path, force: bool = False, what: str = "--out", suffix: Optional[str] = None,
                   append_suffix: bool = False) -> Path:
    """The file to write for `path`, refused when its folder is missing or read-only, when it is a
    link or a folder, or when it exists and `force` is off. A `path` without `suffix` (MLX reads
    files by their suffix) is refused, or with `append_suffix` gets it appended."""
    path = Path(path).expanduser()
    if suffix and path.suffix != suffix:
        if not append_suffix:
            raise OutputError(f"{what} {path}: the name must end in {suffix} (MLX reads files by their suffix)")
        path = path.with_name(path.name + suffix)
    _check_parent(path, what)
    if path.is_dir():
        raise OutputError(f"{what} {path} is a folder; give a file name")
    if path.exists() and not force:
        raise OutputError(f"{what} {path} exists; pass --force to replace it")
    return path


def check_out_dir(path, force: bool = False, what: str = "--out", not_into: Optional[Path] = None) -> Path:
    """The folder to write, refused when its parent is missing or read-only, when it is a link or
    a file, when it is (or holds, or lies in) `not_into`, or when it holds files and `force` is off."""
    path = Path(path).expanduser()
    _check_parent(path, what)
    if path.exists() and not path.is_dir():
        raise OutputError(f"{what} {path} is a file; give a folder")
    if not_into is not None:
        mine, theirs = path.resolve(), Path(not_into).expanduser().resolve()
        if mine == theirs or theirs in mine.parents or mine in theirs.parents:
            raise OutputError(f"{what} {path} would write into the model's own folder {theirs}; give another folder")
    if path.is_dir() and any(path.iterdir()) and not force:
        raise OutputError(f"{what} {path} is not empty; pass --force to replace what it holds")
    return path


def check_results_dir(path, what: str = "--out") -> Path:
    """A results folder that runs add to (resumed, so no --force): its parent must exist, and it
    must be neither a file nor a symbolic link."""
    path = Path(path).expanduser()
    _check_parent(path, what)
    if path.exists() and not path.is_dir():
        raise OutputError(f"{what} {path} is a file; give a folder for the results")
    return path


_LIVE: set = set()  # temporary outputs being written: removed on SIGTERM
_LOCK = threading.Lock()


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


@contextlib.contextmanager
def _removed_on_sigterm(temp: Path):
    """SIGTERM's default kills the process without running `finally`: while `temp` is written,
    SIGTERM raises SystemExit instead (in the main thread), so that it is removed."""
    with _LOCK:
        _LIVE.add(temp)
    previous = None
    if threading.current_thread() is threading.main_thread():
        def terminate(signum, frame):
            raise SystemExit(128 + signum)

        previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        with _LOCK:
            _LIVE.discard(temp)


def _clear_stale(folder: Path, name: str) -> None:
    """Remove temporaries that a killed run (SIGKILL: nothing runs) left for `name`."""
    for stale in folder.glob(f".{name}.*.partial*"):
        try:
            pid = int(stale.name[len(name) + 2:].split(".")[0])
        except ValueError:
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            _remove(stale)
        except PermissionError:
            pass


@contextlib.contextmanager
def replacing_file(path, force: bool = False) -> Iterator[Path]:
    """Yields a temporary path beside `path` (same suffix) to write; on success it replaces
    `path` (refused if `path` appeared meanwhile and `force` is off), else it is removed."""
    path = Path(path)
    _clear_stale(path.parent, path.name)
    temp = path.with_name(f".{path.name}.{os.getpid()}.partial{path.suffix}")
    try:
        with _removed_on_sigterm(temp):
            yield temp
            if path.is_symlink() or (path.exists() and not force):
                raise OutputError(f"{path} appeared while it was written; pass --force to replace it")
            os.replace(temp, path)
    finally:
        if temp.exists():
            _remove(temp)


@contextlib.contextmanager
def replacing_dir(path, force: bool = False) -> Iterator[Path]:
    """Yields a temporary folder beside `path` to fill; on success it takes `path`'s place (an
    existing `path` is removed only then, and only with `force`), else it is removed."""
    path = Path(path)
    _clear_stale(path.parent, path.name)
    temp = Path(tempfile.mkdtemp(prefix=f".{path.name}.{os.getpid()}.partial", dir=path.parent))
    try:
        with _removed_on_sigterm(temp):
            yield temp
            if path.is_symlink():
                raise OutputError(f"{path} became a symbolic link while it was written")
            if path.exists():
                if path.is_dir() and (force or not any(path.iterdir())):
                    old = path.with_name(f".{path.name}.{os.getpid()}.partial-old")
                    os.replace(path, old)
                    os.replace(temp, path)
                    _remove(old)
                else:
                    raise OutputError(f"{path} appeared while it was written; pass --force to replace it")
            else:
                os.replace(temp, path)
    finally:
        if temp.exists():
            _remove(temp)
