"""The measurement harness: method specs, ppl / needle / benchmark runs, watchdog, reports."""

import json
import math
from pathlib import Path

import pytest
from conftest import WIKITEXT

from veloxquant_mlx import available_methods
from veloxquant_mlx.evaluation.cli import main
from veloxquant_mlx.evaluation.report import render_markdown, replace_section
from veloxquant_mlx.evaluation.specs import MethodSpecError, parse_method_list, parse_method_spec
from veloxquant_mlx.evaluation.watchdog import MemoryGuard, MemoryGuardTriggered, available_memory_bytes


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    """A small slice of WikiText-2 test (or, where it is absent, of mlx-lm's own docs)."""
    if WIKITEXT.is_file():
        text = WIKITEXT.read_text()[:40_000]
    else:
        import mlx_lm

        text = (Path(mlx_lm.__file__).parent / "LORA.md").read_text()
    path = tmp_path_factory.mktemp("text") / "slice.txt"
    path.write_text(text)
    return path


def run_cli(*argv):
    assert main([*map(str, argv), "--no-progress"]) == 0


def load(out):
    results = json.loads((Path(out) / "results.json").read_text())
    assert results["schema_version"] == 1
    assert results["complete"] is True
    assert {"mlx", "mlx_lm", "backend", "device"} <= set(results["environment"])
    assert (Path(out) / "results.md").is_file()
    for name in results["figures"]:
        assert (Path(out) / name).is_file()
    return results


# ---- specs ------------------------------------------------------------------


def test_baseline_specs():
    fp16 = parse_method_spec("fp16")
    assert fp16.is_baseline and fp16.label == "fp16" and fp16.bits == 16
    q8 = parse_method_spec("mlx-q8")
    assert (q8.label, q8.bits, q8.group_size, q8.kind) == ("mlx-q8", 8, 64, "baseline")
    q4 = parse_method_spec("mlx-q4:group=32")
    assert (q4.label, q4.bits, q4.group_size) == ("mlx-q4:group=32", 4, 32)


def test_veloxquant_specs():
    spec = parse_method_spec("turboquant_mse:3:vbits=4,sinks=4,window=64")
    assert spec.kind == "veloxquant" and spec.label == "turboquant_mse:3:vbits=4,sinks=4,window=64"
    config = spec.config
    assert (config.method, config.bits, config.value_bits) == ("turboquant_mse", 3, 4)
    assert (config.sink_tokens, config.residual_length) == (4, 64)
    assert parse_method_spec("turboquant_mse:2:residual=16,seed=7").config.seed == 7


@pytest.mark.skipif("kivi" not in available_methods(), reason="kivi not registered")
def test_kivi_spec_with_group():
    spec = parse_method_spec("kivi:2:group=32,residual=32")
    assert (spec.config.bits, spec.config.group_size, spec.config.residual_length) == (2, 32, 32)


def test_method_list_keeps_settings_together():
    specs = parse_method_list("fp16,mlx-q4:group=32,turboquant_mse:3:vbits=4,sinks=4,mlx-q8")
    assert [s.label for s in specs] == ["fp16", "mlx-q4:group=32", "turboquant_mse:3:vbits=4,sinks=4", "mlx-q8"]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("", "empty"),
        ("nosuch:4", "unknown method 'nosuch'"),
        ("mlx-q7", "supports bits"),
        ("mlx-q4:4", "part of the name"),
        ("mlx-q4:vbits=2", "only group"),
        ("mlx-q4:group=48", "group must be"),
        ("fp16:8", "no bits"),
        ("turboquant_mse:x", "bits must be an integer"),
        ("turboquant_mse:4:window", "key=value"),
        ("turboquant_mse:4:sinks=many", "sinks must be an integer"),
        ("turboquant_mse:99", "supports key bits"),
        ("turboquant_mse:4:frobnicate=1", "no option 'frobnicate'"),
        ("a:1:b=2:c", r"name\[:bits"),
    ],
)
def test_bad_specs(spec, message):
    with pytest.raises(MethodSpecError, match=message):
        parse_method_spec(spec)


def test_unknown_method_lists_known_ones():
    with pytest.raises(MethodSpecError, match="mlx-q4.*turboquant_mse"):
        parse_method_spec("nosuch")


def test_duplicate_methods_refused():
    with pytest.raises(MethodSpecError, match="twice"):
        parse_method_list("fp16,mlx-q4,mlx-q4:group=64")


def test_cli_reports_bad_spec(tmp_path, capsys):
    code = main(["benchmark", "--shape", "tiny", "--methods", "mlx-q9", "--out", str(tmp_path), "--no-progress"])
    assert code == 2
    assert "mlx-q9" in capsys.readouterr().err


# ---- watchdog, report -----------------------------------------------------


def test_memory_guard():
    assert available_memory_bytes() > 0
    MemoryGuard(0).check()
    with pytest.raises(MemoryGuardTriggered, match="free memory"):
        MemoryGuard(1e6).check("here")


def test_readme_markers():
    readme = "intro\n<!-- results:ppl:start -->\nold\n<!-- results:ppl:end -->\nend\n"
    updated = replace_section(readme, "ppl", "| new |")
    assert "old" not in updated and "| new |" in updated and updated.endswith("end\n")
    assert replace_section(updated, "ppl", "again").count("<!-- results:ppl:start -->") == 1
    with pytest.raises(ValueError, match="not found"):
        replace_section(readme, "needle", "x")


def test_cli_is_wired_into_veloxquant():
    from veloxquant_mlx.cli import build_parser

    args = build_parser().parse_args(["eval", "ppl", "--ctx", "64", "--methods", "fp16"])
    assert args.ctx == 64 and callable(args.func)


# ---- runs -------------------------------------------------------------------


def test_benchmark_tiny_shape(tmp_path):
    out = tmp_path / "bench"
    run_cli("benchmark", "--shape", "tiny", "--contexts", "128,256", "--decode-tokens", "4",
            "--repeats", "2", "--methods", "fp16,mlx-q4,turboquant_mse:4", "--min-free-gb", "0",
            "--out", out)
    results = load(out)
    records = results["records"]
    assert [(r["context"], r["label"]) for r in records] == [
        (c, m) for c in (128, 256) for m in ("fp16", "mlx-q4", "turboquant_mse:4")
    ]
    for r in records:
        if r["kind"] == "baseline" and "No implementation for problem shape" in (r["error"] or ""):
            continue  # mlx-lm's QuantizedKVCache on MLX's CUDA backend: recorded, sweep goes on
        assert r["status"] == "ok", r["error"]
        assert r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0
        assert r["peak_memory_bytes"] > 0 and r["kv_bytes"] > 0
        assert r["kv_tokens"] == r["context"] + 4
        assert 1 <= r["repeats_done"] <= 2
        for run in r["runs"]:  # one interval per decoded token, together the decode time
            assert len(run["decode_token_intervals_s"]) == 4 and min(run["decode_token_intervals_s"]) > 0
            assert sum(run["decode_token_intervals_s"]) <= run["decode_s"] + 1e-5
            # the host's part of each step after the first: building the next step, then launching it
            assert len(run["decode_build_s"]) == len(run["decode_dispatch_s"]) == 3
            assert min(run["decode_build_s"]) > 0 and min(run["decode_dispatch_s"]) >= 0
            assert sum(run["decode_build_s"]) + sum(run["decode_dispatch_s"]) <= run["decode_s"]
    # The methods of a context take turns: round 1 of every method, then round 2.
    for context in (128, 256):
        starts = [(run["start_s"], i, r["label"]) for r in records if r["context"] == context and r["status"] == "ok"
                  for i, run in enumerate(r["runs"])]
        rounds = [i for _, i, _ in sorted(starts)]
        assert rounds == sorted(rounds), starts
    by_label = {r["label"]: r for r in records if r["context"] == 256}
    assert by_label["turboquant_mse:4"]["kv_bytes"] < by_label["fp16"]["kv_bytes"]
    assert {"speed_vs_context.png", "memory_vs_context.png"} <= set(results["figures"])

    readme = tmp_path / "README.md"
    readme.write_text("# x\n<!-- results:benchmark:start -->\n<!-- results:benchmark:end -->\n")
    run_report = main(["report", str(out), "--readme", str(readme)])
    assert run_report == 0
    text = readme.read_text()
    assert "turboquant_mse:4" in text and "](bench/speed_vs_context.png)" in text
    assert "| per round |" in text  # two rounds each


def test_benchmark_shape_calibrates_first_use_specs_on_random_tokens_outside_the_cache(tmp_path, monkeypatch):
    # A random-weight shape has no tokenizer, and its artifacts must not land in the first-use cache,
    # which is keyed by the architecture alone: a real model of that shape would load them.
    monkeypatch.setenv("VELOXQUANT_CACHE_DIR", str(tmp_path / "first-use"))
    out = tmp_path / "bench"
    run_cli("benchmark", "--shape", "tiny", "--contexts", "128", "--decode-tokens", "2", "--repeats", "1",
            "--methods", "fp16,turboquant_mse:3:outliers=4,artifacts=auto", "--min-free-gb", "0",
            "--no-figures", "--out", out)
    results = load(out)
    label = "turboquant_mse:3:outliers=4,artifacts=auto"
    assert [r["status"] for r in results["records"]] == ["ok", "ok"]
    assert results["settings"]["calibration"][label]["tokens"] == 4 * 512
    assert results["settings"]["calibration"][label]["seconds"] > 0
    assert not (tmp_path / "first-use").exists()


def test_benchmark_report_gives_the_spread_of_the_rounds_ratios():
    def record(label, decode_s, kind="veloxquant"):
        return {"label": label, "kind": kind, "context": 4096, "status": "ok", "decode_tokens_per_s": 1.0,
                "prefill_tokens_per_s": 1.0, "repeats_done": len(decode_s),
                "runs": [{"decode_s": t, "prefill_s": 1.0} for t in decode_s]}

    results = {"command": "benchmark", "settings": {"repeats": 3}, "records": [
        record("fp16", [1.0, 1.0, 2.0], kind="baseline"), record("a", [2.0, 1.25, 2.0]), record("b", [1.0])]}
    rows = {line.split(" | ")[0]: line.split(" | ") for line in render_markdown(results).splitlines()
            if line.startswith("| `")}
    header = next(line for line in render_markdown(results).splitlines() if line.startswith("| method"))
    column = header.split(" | ").index("per round")
    # round by round, fp16's time over a's: 1/2, 1/1.25, 2/2
    assert rows["| `a`"][column] == "0.50-1.00x"
    assert rows["| `fp16` (mlx-lm)"][column] == "1.00-1.00x"
    assert rows["| `b`"][column] == "—"  # one run, and not fp16's number of rounds


def test_benchmark_report_gives_the_step_and_its_host_time():
    def run(intervals, build, dispatch):
        return {"decode_s": sum(intervals), "prefill_s": 1.0, "decode_token_intervals_s": intervals,
                "decode_build_s": build, "decode_dispatch_s": dispatch}

    runs = [run([0.05, 0.010, 0.012, 0.011], [0.002, 0.003, 0.002], [0.004, 0.004, 0.005]),
            run([0.05, 0.009, 0.010, 0.013], [0.003, 0.003, 0.002], [0.005, 0.004, 0.004])]
    results = {"command": "benchmark", "settings": {"repeats": 2}, "records": [
        {"label": "fp16", "kind": "baseline", "context": 4096, "status": "ok", "decode_tokens_per_s": 1.0,
         "prefill_tokens_per_s": 1.0, "repeats_done": 2, "runs": runs},
        {"label": "old", "kind": "veloxquant", "context": 4096, "status": "ok", "decode_tokens_per_s": 1.0,
         "prefill_tokens_per_s": 1.0, "repeats_done": 1, "runs": [{"decode_s": 1.0, "prefill_s": 1.0}]}]}
    lines = render_markdown(results).splitlines()
    header = next(line for line in lines if line.startswith("| method")).split(" | ")
    rows = {line.split(" | ")[0]: line.split(" | ") for line in lines if line.startswith("| `")}
    column = header.index("step / host ms")
    # steps after the first of each run: median of 10, 12, 11, 9, 10, 13 ms; host: of 6, 7, 7, 8, 7, 6 ms
    assert rows["| `fp16` (mlx-lm)"][column] == "10.50 / 7.00"
    assert rows["| `old`"][column] == "—"  # a run recorded before host times were


def test_benchmark_bits_per_coordinate_count_every_sequence_of_a_batch(tmp_path):
    bits = {}
    for batch in (1, 3):
        out = tmp_path / f"batch{batch}"
        run_cli("benchmark", "--shape", "tiny", "--contexts", "128", "--decode-tokens", "2", "--repeats", "1",
                "--warmup", "0", "--batch", str(batch), "--methods", "fp16,turboquant_mse:4", "--min-free-gb", "0",
                "--no-figures", "--out", out)
        bits[batch] = {r["label"]: r["bits_per_coord"] for r in load(out)["records"]}
    # bytes per coordinate do not depend on the batch (counting one sequence's tokens gave 3x)
    for label, value in bits[1].items():
        assert bits[3][label] == pytest.approx(value, rel=0.05), (label, bits)


def test_benchmark_with_compiled_blocks(tmp_path):
    out = tmp_path / "compiled"
    run_cli("benchmark", "--shape", "tiny", "--contexts", "64", "--decode-tokens", "3", "--repeats", "1",
            "--warmup", "0", "--methods", "fp16,kivi:4", "--compile-blocks", "--min-free-gb", "0",
            "--no-figures", "--out", out)
    results = load(out)
    assert results["settings"]["compiled_blocks"] == 2  # the tiny shape's two llama blocks
    assert [r["status"] for r in results["records"]] == ["ok", "ok"]


def test_watchdog_stops_configurations(tmp_path):
    out = tmp_path / "guarded"
    run_cli("benchmark", "--shape", "tiny", "--contexts", "64,128", "--decode-tokens", "2",
            "--repeats", "1", "--methods", "fp16,turboquant_mse:4", "--min-free-gb", "1e6",
            "--no-figures", "--out", out)
    records = load(out)["records"]
    assert [r["status"] for r in records] == ["stopped_by_guard"] * 2 + ["skipped"] * 2
    assert "free memory" in records[0]["error"]


@pytest.mark.model
def test_ppl_smollm2(tmp_path, text_file, cli_shares_smollm2):
    out = tmp_path / "ppl"
    run_cli("eval", "ppl", "--text", text_file, "--ctx", "256", "--windows", "1", "--chunk", "64",
            "--methods", "fp16,mlx-q8,turboquant_mse:4", "--out", out)
    results = load(out)
    assert results["settings"]["scored_tokens"] == 127
    records = {r["label"]: r for r in results["records"]}
    assert list(records) == ["fp16", "mlx-q8", "turboquant_mse:4"]
    for r in records.values():
        assert r["status"] == "ok", r["error"]
        assert r["scored_tokens"] == 127 and r["kv_tokens"] == 256
        assert math.isfinite(r["perplexity"]) and r["perplexity"] > 1
        assert r["fp16_kv_bytes"] == 2 * 256 * 30 * 3 * 128
    fp16 = records["fp16"]
    assert fp16["kl_mean"] == 0 and fp16["kl_p99"] == 0 and fp16["top1_agreement"] == 1
    assert abs(records["mlx-q8"]["perplexity"] / fp16["perplexity"] - 1) < 0.02
    assert records["mlx-q8"]["kl_mean"] > 0
    assert 4 < records["turboquant_mse:4"]["bits_per_coord"] < 5
    assert results["figures"] == ["ppl_pareto.png"]


@pytest.mark.model
def test_needle_smollm2(tmp_path, text_file, cli_shares_smollm2):
    out = tmp_path / "needle"
    run_cli("eval", "needle", "--text", text_file, "--lengths", "200", "--depths", "0.5",
            "--max-tokens", "6", "--methods", "fp16,turboquant_mse:4", "--out", out)
    results = load(out)
    for r in results["records"]:
        assert r["status"] == "ok", r["error"]
        assert r["grid"]["lengths"] == [200] and r["grid"]["depths"] == [0.5]
        assert 0 <= r["accuracy"] <= 1
        (cell,) = r["cells"]
        assert abs(cell["prompt_tokens"] - 200) <= 8 and cell["passcode"].isdigit()
        assert isinstance(cell["correct"], bool)
        assert not cell["correct"] or cell["passcode"] in cell["answer"]
    assert len(results["figures"]) == 2
