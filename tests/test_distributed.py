"""Compressed caches under mlx-lm's sharded inference: two CPU ranks over the ring back end
(`mlx.launch --backend ring -n 2`), against the single-process compressed run in this process.

Each launch runs tests/distributed_worker.py on both ranks. SmolLM2 has 3 KV heads, which two
tensor-parallel ranks cannot split, and llama has no pipeline: so a tiny random llama (tensor
parallel) and a tiny random qwen2 (pipeline), their weights scaled so that greedy decoding
does not repeat one token. Each runs `vq4`, `kivi:4` and a calibrated method whose artifact dir, calibrated
once on the whole model, every rank slices (`distributed_worker.CALIBRATED`).
"""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.cache import CacheFormatError
from veloxquant_mlx.calibration import calibrate
from veloxquant_mlx.config import KVCacheConfig
from veloxquant_mlx.evaluation import launcher
from veloxquant_mlx.evaluation.launcher import idle_stdin
from veloxquant_mlx.evaluation.shapes import write_random_model_folder
from veloxquant_mlx.models import load_model

sys.path.insert(0, str(Path(__file__).parent))
import distributed_worker  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).parent / "distributed_worker.py"
LAUNCH = Path(sys.executable).parent / "mlx.launch"
SPECS = ("vq4", "kivi:4", distributed_worker.CALIBRATED)
# Tensor parallelism sums the output projection's partial products across ranks in another order
# than one matmul does; the log-probabilities then differ by float32 rounding, amplified where a
# coordinate lands on the other side of a quantization boundary.
LOGPROB_TOLERANCE = 2e-3
LAUNCH_TIMEOUT = 240
GREEDY_TOKENS = 12  # make test's launch; test_sharded_greedy_decoding_holds_for_64_tokens runs 64


def ring_launch(*args):
    """(command, environment) that run `args` (a script and its arguments, or `-m module ...`) on two ring ranks."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OPENBLAS_NUM_THREADS": "1", "VELOXQUANT_NO_PRELOAD": "1"}
    return launcher.command("--backend", "ring", "-n", "2", "--python", sys.executable, *args), env


def launch(*args, timeout=LAUNCH_TIMEOUT, on_timeout=pytest.fail):
    """`mlx.launch` two ranks; on a timeout its whole process group (the ranks too) is killed and the test fails."""
    command, env = ring_launch(*args)
    with idle_stdin() as stdin:
        process = subprocess.Popen(command, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env=env, start_new_session=True)
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            on_timeout(f"two ranks did not finish in {timeout} s (a hang):\n{stdout[-2000:]}\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def ring(tmp_path_factory):
    """Skips unless `mlx.launch` starts two ranks that can all_sum over the ring back end."""
    if not LAUNCH.is_file():
        pytest.skip(f"mlx.launch not found next to {sys.executable}")
    probe = tmp_path_factory.mktemp("ring") / "probe.py"
    probe.write_text("import mlx.core as mx\ng = mx.distributed.init()\n"
                     "print('sum', mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu).item())\n")
    result = launch(probe, timeout=60, on_timeout=pytest.skip)
    if result.stdout.count("sum 2.0") != 2:
        pytest.skip(f"the ring back end does not run two ranks here: {result.stderr[-400:]}")


def tiny_model_dir(target: Path, model_type: str) -> Path:
    """A 4-layer random `model_type` with SmolLM2's tokenizer and a weight index (pipeline loading reads it), and
    the whole model's calibrated artifact dir for `distributed_worker.CALIBRATED`, which every rank loads."""
    folder = write_random_model_folder(target, dict(
        model_type=model_type, hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=4096, tie_word_embeddings=True,
        rope_theta=10000.0), scale=3, weight_index=True)
    model, _ = load_model(folder)
    method, bits = distributed_worker.CALIBRATED.split(":")
    sequences = [mx.random.randint(0, distributed_worker.VOCAB_USED, (128,), key=mx.random.key(s)) for s in (1, 2)]
    calibrate(model, KVCacheConfig(method=method, bits=int(bits)), sequences, folder / distributed_worker.ARTIFACTS,
              progress=False)
    return folder


def single_process(model_dir: Path, max_tokens: int = GREEDY_TOKENS, specs=SPECS) -> dict:
    model, _ = load_model(model_dir)
    args = type("Args", (), {"prompt_tokens": 40, "max_tokens": max_tokens, "die_after": None, "roundtrip": None})
    return {spec: distributed_worker.run_spec(model, spec, args, 0, model_dir) for spec in specs}


def ranks(out: Path, result) -> list:
    files = [out / f"rank{r}.json" for r in (0, 1)]
    assert all(f.is_file() for f in files), f"a rank wrote no result:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return [json.loads(f.read_text()) for f in files]


@pytest.fixture(scope="module")
def launched(ring, tmp_path_factory):
    """One launch of two ranks: the tiny llama tensor-parallel, then the tiny qwen2 pipelined."""
    root = tmp_path_factory.mktemp("sharded")
    models = {"tensor": tiny_model_dir(root / "llama", "llama"), "pipeline": tiny_model_dir(root / "qwen2", "qwen2")}
    result = launch(WORKER, *(f"--run={parallel}={path}" for parallel, path in models.items()),
                    "--specs", ",".join(SPECS), "--max-tokens", str(GREEDY_TOKENS), "--out", root / "out",
                    "--roundtrip", root / "saved")
    return ranks(root / "out", result), models, root / "saved"


@pytest.fixture(scope="module", params=["tensor", "pipeline"])
def sharded_run(request, launched):
    shards, models, saved = launched
    parallel = request.param
    runs = [{"rank": shard["rank"], "specs": shard["runs"][parallel]} for shard in shards]
    return parallel, runs, single_process(models[parallel]), saved / parallel, models[parallel]


def assert_same_greedy_run(got: dict, reference: dict, label: str):
    """A rank's greedy tokens equal the single process's, its log-probabilities within the tolerance."""
    assert got["tokens"] == reference["tokens"], label
    difference = np.abs(np.array(got["logprobs"]) - np.array(reference["logprobs"])).max()
    assert difference <= LOGPROB_TOLERANCE, f"{label}: {difference}"


@pytest.mark.parametrize("spec", SPECS)
def test_sharded_greedy_decoding_matches_the_single_process_compressed_run(sharded_run, spec):
    parallel, shards, whole, _, _ = sharded_run
    for shard in shards:
        assert_same_greedy_run(shard["specs"][spec], whole[spec], f"{parallel} rank {shard['rank']} {spec}")


@pytest.mark.slow  # a launch of its own (make test-all): half a minute each on 2 cores
@pytest.mark.parametrize("parallel,model_type", [("tensor", "llama"), ("pipeline", "qwen2")])
def test_sharded_greedy_decoding_holds_for_64_tokens(ring, tmp_path, parallel, model_type):
    model_dir = tiny_model_dir(tmp_path / model_type, model_type)
    result = launch(WORKER, f"--run={parallel}={model_dir}", "--specs", ",".join(SPECS), "--max-tokens", "64",
                    "--out", tmp_path / "out")
    whole = single_process(model_dir, 64)
    assert all(len(whole[spec]["tokens"]) == 64 for spec in SPECS)
    for shard in ranks(tmp_path / "out", result):
        for spec in SPECS:
            assert_same_greedy_run(shard["runs"][parallel][spec], whole[spec], f"{parallel} rank {shard['rank']} {spec}")


@pytest.mark.parametrize("spec", SPECS)
def test_each_rank_holds_its_share_of_the_cache(sharded_run, spec):
    parallel, shards, whole, _, _ = sharded_run
    reference = whole[spec]
    for shard in shards:
        got = shard["specs"][spec]
        if parallel == "tensor":
            assert got["layers"] == reference["layers"]
            assert got["kv_heads"] == [h // 2 for h in reference["kv_heads"]]
            share = 0.5
        else:
            assert got["kv_heads"] == reference["kv_heads"][: got["layers"]]
            share = got["layers"] / reference["layers"]
        assert abs(got["nbytes"] - share * reference["nbytes"]) <= 0.01 * share * reference["nbytes"]
    assert sum(s["specs"][spec]["layers"] for s in shards) == (
        2 * reference["layers"] if parallel == "tensor" else reference["layers"])


@pytest.mark.parametrize("spec", SPECS)
def test_a_sharded_prompt_cache_file_round_trips(sharded_run, spec):
    parallel, shards, _, saved, _ = sharded_run
    directory = saved / spec.replace(":", "-")
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["sharding"] == parallel
    assert sorted(f["file"] for f in manifest["files"]) == ["rank0-of-2.safetensors", "rank1-of-2.safetensors"]
    for shard in shards:
        got = shard["specs"][spec]
        assert got["roundtrip"]["metadata"] == {"spec": spec}
        assert_same_greedy_run(got["roundtrip"], got, f"{parallel} rank {shard['rank']} {spec} reloaded")


def test_a_sharded_prompt_cache_is_refused_at_another_world_size(sharded_run):
    from veloxquant_mlx.sharded_files import load_sharded_prompt_cache

    parallel, _, _, saved, model_dir = sharded_run
    model, _ = load_model(model_dir)
    with pytest.raises(CacheFormatError, match=r"saved by 2 rank\(s\).*this run has 1.*mlx.launch -n 2"):
        load_sharded_prompt_cache(saved / "vq4", model, distributed_worker.spec_config("vq4"))


def test_a_sharded_rank_file_that_fails_the_manifest_is_refused(sharded_run, tmp_path):
    from veloxquant_mlx.sharded_files import MANIFEST, load_sharded_prompt_cache, save_sharded_prompt_cache

    *_, model_dir = sharded_run
    model, _ = load_model(model_dir)
    config = distributed_worker.spec_config("kivi:4")
    caches = distributed_worker.KVCacheBuilder(config).for_model(model).build()
    distributed_worker.prefill(model, caches, list(range(20)))
    save_sharded_prompt_cache(tmp_path, caches, model)
    assert load_sharded_prompt_cache(tmp_path, model, config)[0][0].offset == 20
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    manifest["files"][0]["sha256"] = "0" * 64
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CacheFormatError, match="fails the manifest's SHA-256"):
        load_sharded_prompt_cache(tmp_path, model, config)


def test_a_rank_that_dies_mid_generation_stops_the_other_with_a_clear_error(launched, tmp_path):
    _, models, _ = launched
    result = launch(WORKER, f"--run=tensor={models['tensor']}", "--specs", "vq4", "--max-tokens", "12",
                    "--die-after", "3", "--out", tmp_path / "out", timeout=120)
    assert not (tmp_path / "out" / "rank0.json").exists()
    # Rank 0 either meets the lost connection first and says so (`RankLostError`), or is stopped by
    # mlx.launch, which terminates every rank once one exits with an error and names that one.
    assert ("rank 0 of 2: another rank stopped (exited or crashed), so this one stops too" in result.stderr
            or re.search(r"Node with rank 1 exited with code 3.*Node with rank 0 exited with code -15",
                         result.stderr, re.S)), result.stderr[-3000:]


@pytest.mark.parametrize("parallel,model_type", [pytest.param("tensor", "llama", marks=pytest.mark.slow),
                                                 ("pipeline", "qwen2")])
def test_serve_under_mlx_launch_answers_as_the_single_process_server(ring, tmp_path, parallel, model_type):
    """`veloxquant serve` on two ranks (rank 0 serves HTTP, rank 1 follows its requests) gives the greedy
    tokens the same server gives in one process, for tensor and pipeline parallelism. The pipelined server
    batches its rows, and mlx-lm's pipelined models tie the send to the next rank onto the last layer's
    batch cache (`sharding._PipelineTail.merge`)."""
    from conftest import serve_in_thread
    from veloxquant_mlx.evaluation.serving import POOL_SYSTEM, free_port, greedy_chat_answer, wait_for_health

    model_dir = tiny_model_dir(tmp_path / model_type, model_type)
    port = free_port()
    flags = ["--model", str(model_dir), "--kv", "vq4", "--log-level", "ERROR"]
    command, env = ring_launch("-m", "veloxquant_mlx.cli", "serve", *flags, "--port", port,  # docs/distributed.md
                               *(["--pipeline"] if parallel == "pipeline" else []))
    with idle_stdin() as stdin:
        process = subprocess.Popen(command, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   env=env, start_new_session=True)
        try:
            try:
                wait_for_health(port, process, LAUNCH_TIMEOUT, "two ranks of veloxquant serve")
            except RuntimeError as error:
                pytest.fail(f"{error}: {process.stdout.read()[-3000:]}")
            sharded = greedy_chat_answer(port, "bees", GREEDY_TOKENS, POOL_SYSTEM, timeout=LAUNCH_TIMEOUT)[0]
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    httpd, generator = serve_in_thread([*flags, "--port", "0"])
    try:
        generator.request_limits()
        single = greedy_chat_answer(httpd.server_address[1], "bees", GREEDY_TOKENS, POOL_SYSTEM)[0]
    finally:
        httpd.shutdown()
        httpd.server_close()
        generator.stop_and_join()
    assert len(single) == GREEDY_TOKENS
    assert sharded == single


@pytest.mark.slow
def test_chat_saves_and_loads_a_folder_per_rank_under_mlx_launch(ring, tmp_path):
    """`veloxquant chat` pipelined on two ranks: `/save DIR` writes a rank file each and the manifest (a second
    `/save` to it is refused on both ranks alike), and the turn after `/load DIR` replies as the same turn
    with no save and load between."""
    model_dir = tiny_model_dir(tmp_path / "qwen2", "qwen2")
    saved = tmp_path / "chat"

    def chat(lines):
        command, env = ring_launch("-m", "veloxquant_mlx.cli", "chat", "--model", model_dir, "--kv", "vq4",
                                   "--pipeline", "--max-tokens", "8")
        result = subprocess.run(command, input="\n".join([*lines, "/quit", ""]), capture_output=True, text=True,
                                env=env, timeout=LAUNCH_TIMEOUT)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout

    first, second = "Tell me about bees.", "And ants?"
    with_files = chat([first, f"/save {saved}", f"/save {saved}", f"/load {saved}", second])
    plain = chat([first, second])
    assert sorted(p.name for p in saved.iterdir()) == ["manifest.json", "rank0-of-2.safetensors",
                                                       "rank1-of-2.safetensors"]
    assert with_files.count("saved to") == 1 and with_files.count("exists") == 1
    assert "loaded from" in with_files
    reply = lambda out: out.split(f">> {second}")[1].split("[cache:")[0]  # noqa: E731
    assert reply(with_files) == reply(plain) and reply(plain).strip()


def test_the_launchers_select_returns_what_is_ready_after_waiting_on_readers_alone():
    read, write = os.pipe()
    try:
        assert launcher.patient_select([read], [write], [], 1.0) == ([], [write], [])
        os.write(write, b"x")
        assert launcher.patient_select([read], [write], [], 1.0) == ([read], [write], [])
        assert launcher.patient_select([read], [], [], 0) == ([read], [], [])
    finally:
        os.close(read)
        os.close(write)
