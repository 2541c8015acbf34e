"""What a new user meets first: `--version`, help for every flag, the fast CPU BLAS, Ctrl-C, and one
definition of bits per coordinate and of "smaller" across the commands."""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from veloxquant_mlx import __version__, blas
from veloxquant_mlx.cli import build_parser, main

ROOT = Path(__file__).resolve().parent.parent


def _walk(parser, path):
    """(command path, action) for every action of `parser` and its subcommands' parsers."""
    for action in parser._actions:
        yield path, action
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                yield path + [name], helps.get(name)
                yield from _walk(sub, path + [name])


def test_every_command_flag_and_positional_has_help():
    missing, seen = [], 0
    for path, action in _walk(build_parser(), ["veloxquant"]):
        seen += 1
        if action is None:
            missing.append(" ".join(path) + " (the command itself)")
        elif isinstance(action, argparse.Action) and not (action.help or "").strip():
            missing.append(f"{' '.join(path)} {'/'.join(action.option_strings) or action.dest}")
    assert seen > 100  # the walk reached the subcommands' flags
    assert not missing, f"no help text: {missing}"


def test_version(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("veloxquant-mlx ") and "mlx " in out and "mlx-lm " in out
    assert __version__ in out or "0." in out.split()[1]


def _python(tmp_path, code, env_changes, timeout=180):
    """Run `code` as a script file in a fresh python (so that a restart runs it again), no preload set."""
    script = tmp_path / "script.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for name in ("LD_PRELOAD", blas.PRELOADED, blas.NO_PRELOAD):
        env.pop(name, None)
    env.update(env_changes)
    return subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=timeout)


LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the preload is Linux's")
_RESTARTS = """
import os, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from veloxquant_mlx import blas
import mlx.core as mx
warned = [str(w.message) for w in caught if "reference BLAS" in str(w.message)]
fix = "LD_PRELOAD=" + str(blas.find_openblas()) if blas.find_openblas() else blas.INSTALL
print("warned", len(warned), all(fix in m for m in warned), "loaded", blas.openblas_loaded(),
      "marker", os.environ.get(blas.PRELOADED), flush=True)
blas.preload_openblas()
print("product", (mx.ones((300, 200)) @ mx.ones((200, 100))).sum().item(), flush=True)
"""
PRODUCT = f"product {300 * 200 * 100:.1f}"


@LINUX
def test_preload_restarts_once_with_openblas_and_exits(tmp_path):
    """The command's restart, the library's import warning (once, with the fix) and the off switch."""
    import mlx.core as mx

    if mx.default_device() != mx.cpu:
        pytest.skip("MLX does not run on the CPU here")
    run = _python(tmp_path, _RESTARTS, {})  # the timeout fails the test if an exit hangs
    assert run.returncode == 0, run.stderr
    if blas.find_openblas() is None:
        assert run.stdout.splitlines() == ["warned 1 True loaded False marker None", PRODUCT]
        assert run.stderr.count("reference BLAS") == 2 and blas.INSTALL in run.stderr  # the warning and the line
        return
    # first start: warns on import, not loaded, restarts; second start: loaded, marked, no warning, runs on
    assert run.stdout.splitlines() == ["warned 1 True loaded False marker None",
                                       "warned 0 True loaded True marker 1", PRODUCT], run.stdout
    off = _python(tmp_path, _RESTARTS, {blas.NO_PRELOAD: "1"})
    assert off.returncode == 0, off.stderr
    assert off.stdout.splitlines() == ["warned 0 True loaded False marker None", PRODUCT]
    assert "reference BLAS" not in off.stderr


def test_benchmark_shape_says_up_front_that_it_is_sized_for_a_gpu(monkeypatch, capsys):
    import mlx.core as mx

    from veloxquant_mlx.evaluation import shapes

    if mx.default_device() != mx.cpu:
        pytest.skip("the notice is for the CPU")
    assert shapes.cpu_shape_notice("tiny", "float32", 1024, 3) is None
    parameters = shapes.shape_parameters("llama-3.1-8b")
    assert 7.9e9 < parameters < 8.1e9
    monkeypatch.setattr(shapes.os, "sysconf", lambda name: 1 << 20 if name == "SC_PHYS_PAGES" else 1 << 20)  # 1 TB
    notice = shapes.cpu_shape_notice("llama-3.1-8b", "float32", 1024, 4)
    assert "sized for a GPU" in notice and f"{4 * parameters / 1e9:.1f} GB of float32" in notice
    assert f"{2 * parameters * 1024 * 4 / 1e15:.0f} PFLOP" in notice
    monkeypatch.setattr(shapes.os, "sysconf", lambda name: 1 << 12 if name == "SC_PAGE_SIZE" else 1 << 20)  # 4 GB
    # through the command: one line on stderr, exit 2, before any weight is built
    assert main(["benchmark", "--shape", "llama-3.1-8b", "--methods", "fp16", "--out", "unused"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "sized for a GPU" in err and "4.3 GB of memory" in err
