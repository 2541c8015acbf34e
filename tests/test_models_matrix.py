"""The architecture matrix (docs/models.md) against its committed table: every file listed as supported still
runs with KL under the committed threshold, and every refused one is still refused cleanly (or supported).

The committed table (`benchmarks/results/models-matrix/matrix.json`, written by `veloxquant models`) was
measured with a 300-token prefill and 20 decode steps; here, to stay cheap, each file prefills 128 tokens,
then compares the logits of 12 more: 10 fed in one call (each attends over the compressed prefill; the
matrix's 128-token sliding windows wrap) and 2 decode steps. The thresholds are calibrated as the table's, on
the llama family at these settings (k times its KL), and the llama family's KL itself must stay under the
table's threshold; as this short run is noisier than the table's (an MoE router flip weighs more), a file
fails past `MARGIN` times its threshold. mlx-lm's state-space caches (Jamba) take no multi-token call after
a prefill, so the hybrid group compares 4 decode steps instead, whose llama calibration is the noisiest
(its kivi:4 KL is the smallest, and moves most with float rounding), hence a margin of 3. One model is built per file; files are grouped by the caches mlx-lm makes for them, and a wrapper file whose language
model is another file's (Gemma 3 of gemma3_text, Mistral 3 of llama, ...) is checked through that file."""

import json
import os
from collections import defaultdict

import pytest

from veloxquant_mlx.evaluation import models_matrix as matrix

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLE = os.path.join(ROOT, "benchmarks", "results", "models-matrix", "matrix.json")
PREFILL = 128
RUNS = {"chunked": dict(decode=12, chunk=10), "decode": dict(decode=4, chunk=0)}  # decode: tokens compared
MARGIN = {"chunked": 2.0, "decode": 3.0}


def run_of(group: str) -> str:
    return "decode" if group == "hybrid" else "chunked"


with open(TABLE) as handle:
    COMMITTED = json.load(handle)
RECORDS = {r["file"]: r for r in COMMITTED["records"]}
GROUPS = defaultdict(list)
for _record in COMMITTED["records"]:
    _inner = RECORDS.get(matrix.wrapped_file(_record["file"]) or "")
    if _inner is not None and _inner["status"] == _record["status"]:
        continue  # a wrapper file (Gemma 3, Mistral 3, Qwen3-VL, ...) shares its language model's architecture
    if _record["status"] in (matrix.SUPPORTED, matrix.REFUSED):
        GROUPS[_record["group"]].append(_record["file"])


def same_mlx_lm() -> bool:
    return matrix.mlx_lm_version() == COMMITTED["settings"]["mlx_lm"]


@pytest.fixture(scope="module")
def thresholds():
    """Per run: k times the llama family's KL at the run's settings; that KL under the table's threshold."""
    out = {}
    for run, settings in RUNS.items():
        llama = matrix.check_file(matrix.CALIBRATION_FILE, PREFILL, **settings)
        for spec, kl in llama.kl.items():
            assert kl <= COMMITTED["thresholds"][spec], f"the llama family's {spec} KL {kl:.3g} regressed"
        k = COMMITTED["settings"]["k"]
        out[run] = {spec: MARGIN[run] * t for spec, t in matrix.thresholds_from(llama, k).items()}
    return out


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_no_supported_or_refused_file_regresses(group, thresholds):
    if not same_mlx_lm():
        pytest.skip(f"the table is of mlx-lm {COMMITTED['settings']['mlx_lm']}, not {matrix.mlx_lm_version()}")
    failures = []
    for name in GROUPS[group]:
        run = run_of(group)
        record = matrix.apply_thresholds(matrix.check_file(name, PREFILL, **RUNS[run]), thresholds[run])
        expected = RECORDS[name]["status"]
        if record.status == expected or (expected == matrix.REFUSED and record.status == matrix.SUPPORTED):
            continue
        failures.append(f"{name}: {expected} -> {record.status} ({record.reason}; KL {record.kl})")
    assert not failures, "\n".join(failures)


def test_table_lists_every_model_file_and_docs_match_it():
    if same_mlx_lm():
        assert sorted(RECORDS) == matrix.model_files()
    with open(os.path.join(ROOT, "docs", "models.md")) as handle:
        assert handle.read() == matrix.markdown(COMMITTED), \
            "docs/models.md is not the generator's (veloxquant models)"


def test_thresholds_are_k_times_the_llama_family():
    llama = RECORDS[matrix.CALIBRATION_FILE]
    assert llama["status"] == matrix.SUPPORTED
    for spec, threshold in COMMITTED["thresholds"].items():
        assert threshold == pytest.approx(COMMITTED["settings"]["k"] * llama["kl"][spec])


def test_a_kl_over_the_threshold_is_a_bug():
    record = matrix.Record(file="x", kl={"vq4": 0.5}, spec_status={"vq4": matrix.SUPPORTED})
    record = matrix.apply_thresholds(record, {"vq4": 0.1})
    assert record.status == matrix.BUG and "over the threshold" in record.reason


def test_a_replayed_router_decides_the_status_and_replaying_mlx_lms_own_run_flips_nothing():
    record = matrix.Record(file="x", kl={"vq4": 0.5}, kl_routing_replayed={"vq4": 0.01},
                           spec_status={"vq4": matrix.SUPPORTED})
    assert matrix.apply_thresholds(record, {"vq4": 0.1}).status == matrix.SUPPORTED
    record.kl_routing_replayed["vq4"], record.spec_status["vq4"] = 0.2, matrix.SUPPORTED
    judged = matrix.apply_thresholds(record, {"vq4": 0.1})
    assert judged.status == matrix.BUG and "with routing replayed" in judged.reason
    # mlx-lm's caches against themselves: no routing flips, and replaying gives the same logits.
    record = matrix.check_file("laguna", prefill=64, decode=4, specs=("fp16",))
    assert record.routings_flipped["fp16"] == "0/" + record.routings_flipped["fp16"].split("/")[1]
    assert record.kl["fp16"] == 0 and record.kl_routing_replayed["fp16"] == 0
