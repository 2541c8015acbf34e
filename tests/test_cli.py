"""The `veloxquant` command line: methods, precompute, generate, demo."""

import json

import pytest

from veloxquant_mlx import available_methods
from veloxquant_mlx.cli import main


def test_methods_table_lists_every_method(capsys):
    assert main(["methods", "--bits", "3", "--head-dim", "64", "--group-size", "32"]) == 0
    out = capsys.readouterr().out
    for name in available_methods():
        assert name in out
    row = next(line.split() for line in out.splitlines() if line.startswith("turboquant_mse "))
    assert row[1:4] == ["208", "208", "3.250"]  # key bits, value bits per token; bits per coordinate


def test_bad_method_is_a_clear_error(capsys):
    assert main(["methods"]) == 0
    with pytest.raises(SystemExit):
        main(["generate", "--method"])
    assert main(["precompute", "--out", "x", "--method", "nope"]) == 2
    assert "unknown KV cache method 'nope'" in capsys.readouterr().err


@pytest.mark.model
def test_precompute_writes_artifacts(tmp_path, cli_shares_smollm2):
    out = tmp_path / "art"
    assert main(["precompute", "--out", str(out), "--method", "turboquant_mse", "--bits", "3"]) == 0
    meta = json.loads((out / "artifacts.json").read_text())
    assert meta["config"]["bits"] == 3 and meta["fingerprint"]["num_layers"] == 30
    assert {(c["role"], c["dim"]) for c in meta["codecs"]} == {("keys", 64), ("values", 64)}


@pytest.mark.model
def test_generate_reports_speed_and_kv_memory(capsys, cli_shares_smollm2):
    code = main(["generate", "--prompt", "What is the capital of France?", "--max-tokens", "12",
                 "--method", "turboquant_mse", "--bits", "4", "--sink-tokens", "4", "--center"])
    out = capsys.readouterr().out
    assert code == 0
    assert "tokens-per-sec" in out and "KV cache (turboquant_mse K4/V4 sinks=4 centered)" in out
    assert "x smaller" in out


def test_methods_give_each_method_its_measured_status(capsys):
    # every method used to print "stable", qjl included, although qjl is far worse than turboquant_mse
    assert main(["methods", "--bits", "4", "--head-dim", "64", "--group-size", "32"]) == 0
    out = capsys.readouterr().out
    statuses = ("recommended", "reference", "baseline", "experimental", "stable")
    status = {name: next(word for line in out.splitlines() if line.startswith(f"{name} ")
                         for word in line.split() if word in statuses)
              for name in available_methods()}
    assert status["turboquant_mse"] == "recommended" and status["fp16"] == "reference"
    assert status["kivi"] == "baseline"
    for name in ("qjl", "turboquant_prod", "turboquant_rvq", "polarquant", "rabitq", "vecinfer", "commvq"):
        assert status[name] == "experimental"
    assert "stable" not in status.values()
    assert "qjl (experimental): far too noisy" in out
