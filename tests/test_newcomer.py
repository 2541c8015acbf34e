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


def _helps(parser, path):
    """(where, help text) for every action of `parser` and every subcommand, walking into their parsers."""
    for action in parser._actions:
        if not isinstance(action, argparse._HelpAction):
            yield f"{' '.join(path)} {'/'.join(action.option_strings) or action.dest}", action.help
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                yield " ".join(path + [name]) + " (the command)", helps.get(name)
                yield from _helps(sub, path + [name])


def test_every_command_flag_and_positional_has_help():
    helps = list(_helps(build_parser(), ["veloxquant"]))
    assert len(helps) > 100 and any(where.startswith("veloxquant eval ppl --methods") for where, _ in helps)
    missing = [where for where, text in helps if not (text or "").strip()]
    assert not missing, f"no help text: {missing}"


def test_version(capsys):
    import re

    from veloxquant_mlx.cli import package_version

    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert re.fullmatch(r"veloxquant-mlx \d+\.\d+\.\d+\S* \(mlx \S+, mlx-lm \S+\)\n", out), out
    assert out.split()[1] == package_version() and package_version().split(".")[0] == __version__.split(".")[0]


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


def _tiny_chat():
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from test_serving import _Tokenizer

    from conftest import config_for, tiny_llama
    from veloxquant_mlx.chat import ChatSession

    return ChatSession(tiny_llama(), TokenizerWrapper(_Tokenizer()), config_for("turboquant_mse", 4), model_name="tiny")


def test_chat_reports_an_unknown_command_instead_of_sending_it():
    import io

    from veloxquant_mlx.chat import run_chat

    chat = _tiny_chat()
    out = io.StringIO()
    turns = run_chat(chat, max_tokens=3, sampler=None, stdin=io.StringIO("/sve x\n/usr/bin is a path\n"), stdout=out)
    assert "error: unknown command /sve" in out.getvalue()
    assert turns == 1 and [m["content"] for m in chat.messages if m["role"] == "user"] == ["/usr/bin is a path"]


def test_ctrl_c_stops_the_chat_reply_and_the_chat_goes_on():
    import io
    import signal

    from veloxquant_mlx.chat import run_chat

    class Terminal(io.StringIO):
        """Presses Ctrl-C once the first reply has shown two pieces of text."""

        def __init__(self):
            super().__init__()
            self.pieces, self.pressed = 0, False

        def write(self, text):
            if text and not text.startswith((">>", "[", "chat with", "\n")) and not self.pressed:
                self.pieces += 1
                if self.pieces == 2:
                    self.pressed = True
                    signal.raise_signal(signal.SIGINT)
            return super().write(text)

    chat = _tiny_chat()
    out = Terminal()
    before = signal.getsignal(signal.SIGINT)
    turns = run_chat(chat, max_tokens=40, sampler=None, stdin=io.StringIO("tell me\nand then\n"), stdout=out)
    assert signal.getsignal(signal.SIGINT) is before  # the chat's handler is gone after each reply
    text = out.getvalue()
    assert turns == 2 and text.count("stopped by Ctrl-C") == 1, text
    first = chat.messages[1]
    assert first["role"] == "assistant" and 0 < len(first["content"]) and chat.messages[2]["content"] == "and then"
    # the stopped reply's tokens are all in the cache and in step with the chat's token list
    assert chat.cache_tokens == len(chat.cached_tokens)
    assert {c.offset for c in chat.caches} == {chat.cache_tokens}


def test_ctrl_c_ends_a_command_with_130_and_no_traceback(monkeypatch, capsys):
    from veloxquant_mlx import models

    def pressed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "load_model", pressed)
    assert main(["generate", "--prompt", "hi"]) == 130
    captured = capsys.readouterr()
    assert captured.err.strip() == "interrupted" and "Traceback" not in captured.err


@pytest.mark.model
def test_sigint_ends_generate_cleanly_in_a_process():
    """A real Ctrl-C to `veloxquant generate` mid-reply (the CLI's own OpenBLAS restart included): exit 130,
    no traceback, and the process ends (OpenBLAS's threads do not hold the exit)."""
    import signal
    import time

    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    env.pop("LD_PRELOAD", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "veloxquant_mlx.cli", "generate", "--max-tokens", "100000", "--kv", "vq4",
         "--ignore-chat-template", "--prompt", "Once upon a time"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # as a terminal's foreground process gets it, also when this test runs in a background job (SIGINT ignored)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert process.stdout.read(1), process.stderr.read()  # the reply has started
        time.sleep(0.5)
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 130, err
    assert "Traceback" not in err and err.rstrip().endswith("interrupted")


def _bits_and_smaller(line):
    """(bits per coordinate, times smaller) from a `memory_report` line."""
    import re

    found = re.search(r"([\d.]+) bits/coord; fp16 [\d.]+ MB: ([\d.]+)x smaller", line)
    return float(found.group(1)), float(found.group(2))


def _filled(model, spec, tokens):
    import mlx.core as mx

    from veloxquant_mlx.evaluation.specs import parse_method_spec

    caches = parse_method_spec(spec).make_caches(model)
    model(mx.arange(tokens)[None] % 500, cache=caches)
    return caches


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_fp16_is_16_bits_and_1x_and_quantized_bits_follow_their_layout(dtype):
    import mlx.core as mx

    from conftest import tiny_llama
    from veloxquant_mlx.footprint import footprint

    model = tiny_llama()
    model.set_dtype(getattr(mx, dtype))  # on the CPU mlx-lm's cache holds float32: still 16 bits
    for tokens in (1, 100, 256, 300):
        fp16 = footprint(_filled(model, "fp16", tokens))
        assert (fp16.bits, fp16.smaller, fp16.tokens) == (16.0, 1.0, tokens)
        assert fp16.allocated >= fp16.held  # 256-token steps
        q4 = footprint(_filled(model, "mlx-q4:group=32", tokens))
        assert q4.bits == pytest.approx(4 + 2 * 16 / 32)  # codes and a scale and a bias per 32
        assert q4.smaller == pytest.approx(16 / q4.bits)


def test_every_command_reports_the_same_bits_and_smaller(tmp_path):
    """eval ppl (and the demo, which prints its records), benchmark, needle's records, generate/chat/cache-prompt's
    memory line: for the same caches at the same tokens, the same bits per coordinate and "x smaller"."""
    import io
    import json

    import mlx.core as mx

    from conftest import tiny_llama
    from veloxquant_mlx.chat import run_chat
    from veloxquant_mlx.cli import memory_report
    from veloxquant_mlx.evaluation.perplexity import evaluate_perplexity
    from veloxquant_mlx.evaluation.results import kv_fields
    from veloxquant_mlx.evaluation.specs import parse_method_spec
    from veloxquant_mlx.footprint import footprint

    model = tiny_llama()

    def by_hand(spec, tokens):
        return _bits_and_smaller(memory_report(_filled(model, spec, tokens)))

    # eval ppl and the demo
    windows = mx.arange(200)[None] % 500
    records = evaluate_perplexity(model, windows, [parse_method_spec(s) for s in ("fp16", "vq4")], chunk=64,
                                  progress=False)
    for record in records:
        assert record["kv_tokens"] == 200
        expected = by_hand(record["spec"], 200)
        assert (round(record["bits_per_coord"], 2), round(record["compression_vs_fp16"], 2)) == expected
    assert (records[0]["bits_per_coord"], records[0]["compression_vs_fp16"]) == (16.0, 1.0)
    assert records[1]["kv_bytes"] * records[1]["compression_vs_fp16"] == pytest.approx(records[1]["fp16_kv_bytes"])
    # benchmark, one command through the CLI (two sequences of a batch count both)
    out = tmp_path / "bench"
    assert main(["benchmark", "--shape", "tiny", "--contexts", "96", "--decode-tokens", "3", "--repeats", "1",
                 "--warmup", "0", "--batch", "2", "--methods", "fp16,vq4", "--min-free-gb", "0", "--no-figures",
                 "--no-progress", "--out", str(out)]) == 0
    bench = json.loads((out / "results.json").read_text())["records"]
    shape_model = __import__("veloxquant_mlx.evaluation.shapes", fromlist=["x"]).build_shape_model("tiny")
    for record in bench:
        caches = parse_method_spec(record["spec"]).make_caches(shape_model)
        shape_model(mx.zeros((2, record["kv_tokens"]), dtype=mx.int32), cache=caches)
        expected = _bits_and_smaller(memory_report(caches))
        assert (round(record["bits_per_coord"], 2), round(record["compression_vs_fp16"], 2)) == expected
    assert {r["label"]: r["bits_per_coord"] for r in bench}["fp16"] == 16.0
    # needle's records are `kv_fields` of the caches, as every record is
    caches = _filled(model, "vq4", 150)
    assert _bits_and_smaller(memory_report(caches)) == (round(kv_fields(footprint(caches))["bits_per_coord"], 2),
                                                        round(kv_fields(footprint(caches))["compression_vs_fp16"], 2))
    # chat's line after a turn
    chat = _tiny_chat()
    text = io.StringIO()
    run_chat(chat, max_tokens=4, sampler=None, stdin=io.StringIO("hello there\n"), stdout=text)
    stats = next(line for line in text.getvalue().splitlines() if line.startswith("[cache: "))
    assert _bits_and_smaller(stats) == _bits_and_smaller(memory_report(chat.caches))
    held, allocated = footprint(chat.caches).held, footprint(chat.caches).allocated
    assert f"{held / 1e6:.3f} MB held ({allocated / 1e6:.3f} MB allocated)" in stats


def test_without_openblas_the_command_prints_one_line_with_the_fix(monkeypatch, capsys):
    monkeypatch.setattr(blas, "applies", lambda: True)
    monkeypatch.setattr(blas, "find_openblas", lambda: None)
    monkeypatch.setattr(blas.os, "execve", lambda *args: pytest.fail("restarted without an OpenBLAS"))
    assert blas.preload_openblas() is False
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"`{blas.INSTALL}`" in err and blas.NO_PRELOAD in err
