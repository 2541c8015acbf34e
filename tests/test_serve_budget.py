"""`veloxquant serve --kv none` (mlx-lm's own caches) and `--kv-memory-gb` admission control."""

import json
import threading
import urllib.request

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from conftest import serve_in_thread, tiny_llama_dir
from veloxquant_mlx.evaluation.serving import fp16_budget_bytes, make_prompts
from veloxquant_mlx.models import load_model
from veloxquant_mlx.server import STATS_PATH


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory.mktemp("tiny-budget"), 1024)


def _post(port, body):
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _get(port, path):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as reply:
        return json.loads(reply.read())


def _serving(argv):
    httpd, generator = serve_in_thread(["--port", "0", "--served-model-name", "tiny", "--prompt-cache-size", "0",
                                        "--log-level", "WARNING", *argv])
    return httpd, generator


def _stop(httpd, generator):
    httpd.shutdown()
    httpd.server_close()
    generator.stop_and_join()


def test_kv_none_serves_the_tokens_mlx_lm_generates(tiny_dir):
    from veloxquant_mlx.models import load_model

    model, tokenizer = load_model(str(tiny_dir))
    prompt = "Once upon a time there was"
    expected = [int(t) for t, _ in zip((tok for tok, _ in generate_step(mx.array(tokenizer.encode(prompt)), model)),
                                       range(10))]
    httpd, generator = _serving(["--model", str(tiny_dir), "--kv", "none"])
    try:
        assert generator.model_provider.kv_config is None
        status, body = _post(httpd.server_address[1], {"model": "tiny", "prompt": prompt, "max_tokens": 10,
                                                       "temperature": 0.0, "logprobs": True})
        assert status == 200, body
        served = [entry["id"] for entry in body["choices"][0]["logprobs"]["content"]]
        assert served == expected[: len(served)] and len(served) >= 1
        assert body["choices"][0]["finish_reason"] == "stop" or len(served) == 10
    finally:
        _stop(httpd, generator)


def test_kv_none_takes_no_cache_flags():
    from veloxquant_mlx.cli import build_parser, config_from_args

    with pytest.raises(ValueError, match="--kv none"):
        config_from_args(build_parser().parse_args(["serve", "--kv", "none", "--bits", "3"]))
    assert config_from_args(build_parser().parse_args(["serve", "--kv", "none"])) is None


def test_a_budget_of_n_fp16_sequences_holds_exactly_n_of_the_benchmarks_requests_as_the_server_sizes_them(tiny_dir):
    model, tokenizer = load_model(str(tiny_dir))
    prompts = make_prompts(tokenizer, "The quick brown fox jumps over the lazy dog. " * 200, 240, 4)
    longest = max(len(tokenizer.encode(prompt)) for prompt in prompts)
    max_tokens = 768 - longest  # a request then fills whole 256-token steps: no slack in the budget may add a step
    budget = fp16_budget_bytes(model, tokenizer, prompts, max_tokens, 4)
    httpd, generator = _serving(["--model", str(tiny_dir), "--kv", "none", "--kv-memory-gb", str(budget / 1e9)])
    try:
        assert _post(httpd.server_address[1], {"model": "tiny", "prompt": "warm up", "max_tokens": 2,
                                               "temperature": 0.0})[0] == 200  # the server sizes caches once loaded
        need = generator.kv_budget.cache_bytes(longest + max_tokens)
        assert 4 * need <= generator.kv_budget.limit < 5 * need
    finally:
        _stop(httpd, generator)


@pytest.mark.parametrize("cache_flags,budget_gb", [(["--kv", "none"], "0.0002"),
                                                   (["--method", "turboquant_mse", "--bits", "4"], "0.00003")])
def test_budget_queues_requests_that_do_not_fit_and_refuses_one_that_never_can(tiny_dir, cache_flags, budget_gb):
    # one 256-token step of the tiny model's caches fits in the budget, two do not
    httpd, generator = _serving(["--model", str(tiny_dir), *cache_flags, "--kv-memory-gb", budget_gb])
    port = httpd.server_address[1]
    try:
        assert _post(port, {"model": "tiny", "prompt": "warm up", "max_tokens": 2, "temperature": 0.0})[0] == 200
        one_step = generator.kv_budget.cache_bytes(1)
        assert one_step <= generator.kv_budget.limit < 2 * one_step
        replies = []
        threads = [threading.Thread(target=lambda i=i: replies.append(_post(port, {
            "model": "tiny", "prompt": f"Request number {i} says", "max_tokens": 12, "temperature": 0.0})))
            for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(180)
        assert [status for status, _ in replies] == [200, 200, 200], replies
        stats = _get(port, STATS_PATH)["admission"]
        assert stats["most_live"] == 1 and stats["queued"] >= 1 and stats["live"] == 0
        assert stats["most_reserved_bytes"] <= generator.kv_budget.limit
        status, body = _post(port, {"model": "tiny", "prompt": "too long", "max_tokens": 700, "temperature": 0.0})
        assert status == 400 and "--kv-memory-gb" in body["error"]["message"]
    finally:
        _stop(httpd, generator)


def test_round_summary_separates_decode_throughput_from_prefill():
    from veloxquant_mlx.evaluation.serving import round_summary

    # Two streams: one answered at 1.0 s then every 0.5 s (5 tokens), one at 2.75 s then every 0.5 s (3 tokens).
    streams = [{"start": 0.0, "arrivals": [1.0, 1.5, 2.0, 2.5, 3.0], "tokens": 5, "end": 3.0},
               {"start": 0.0, "arrivals": [2.75, 3.25, 3.75], "tokens": 3, "end": 4.0},
               {"start": 0.0, "arrivals": [], "tokens": 0, "end": 4.0}]
    summary = round_summary(streams, seconds=4.0)
    assert summary["completion_tokens"] == 8 and summary["tok_per_s"] == pytest.approx(2.0)
    assert summary["decode_tokens"] == 6 and summary["decode_seconds"] == pytest.approx(2.75)
    assert summary["decode_tok_per_s"] == pytest.approx(6 / 2.75)
    assert summary["ttft_p50_s"] in (1.0, 2.75) and summary["itl_p50_s"] == pytest.approx(0.5)
    assert summary["most_decoding_at_once"] == 2
    assert round_summary([streams[2]], seconds=1.0)["decode_tok_per_s"] is None


@pytest.mark.parametrize("ending", [b'data: {"error": {"message": "out of memory", "code": 500}}\n\n',
                                    b'data: {"error": "out of memory"}\n\n', b""])
def test_a_stream_that_ends_in_an_error_or_before_done_counts_as_failed(ending):
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from veloxquant_mlx.evaluation.serving import StreamFailed, run_round, stream_completion

    class Failing(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.write(b'data: {"choices": [{"text": "a"}]}\n\n' + ending)
            self.close_connection = True

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Failing)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        port = httpd.server_address[1]
        with pytest.raises(StreamFailed, match="out of memory" if ending else "without"):
            stream_completion(port, "prompt", 4)
        round_result = run_round(port, ["prompt"], clients=3, requests=1, max_tokens=4)
        assert round_result["failed"] == 3 and round_result["completion_tokens"] == 0
    finally:
        httpd.shutdown()
        httpd.server_close()
