"""`veloxquant serve` against hostile clients: malformed and fuzzed requests, drive-by
browser POSTs, URL-fetch attempts, missing API keys, bad Content-Lengths, clients that
leave mid-generation, a request that breaks the generation loop, and SIGINT.

One in-process server on 127.0.0.1 serves the file: a random-weight two-layer llama with
SmolLM2's tokenizer, so a request costs milliseconds. Only 127.0.0.1 is ever contacted.
"""

import http.client
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import serve_in_thread, tiny_llama_dir
from veloxquant_mlx.cli import build_parser
from veloxquant_mlx.server import server_arguments
from veloxquant_mlx.server_requests import RequestError, RequestLimits, parse_json, validate_body

CONTEXT = 131072
FUZZ_REQUESTS = 520
HANG_GUARD_SECONDS = 60  # a test waiting longer than this is a hang, not a slow machine
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory.mktemp("hostile-tiny"), CONTEXT)


@pytest.fixture(scope="module")
def server(model_dir):
    httpd, generator = serve_in_thread(["--model", str(model_dir), "--port", "0", "--max-tokens", "4",
                                        "--log-level", "CRITICAL", "--method", "turboquant_mse", "--bits", "4"])
    generator.request_limits()  # the model is loaded
    yield httpd.server_address[1], generator
    httpd.shutdown()
    httpd.server_close()
    generator.stop_and_join()


@pytest.fixture
def settings(server):
    """The running server's settings, restored after the test changes them."""
    namespace = server[1].cli_args
    saved = dict(vars(namespace))
    yield namespace
    vars(namespace).update(saved)


def send(port, method, path, body=None, headers=None, timeout=HANG_GUARD_SECONDS):
    """(status, headers, parsed JSON body or raw bytes) of one request."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **(headers or {})}
    connection.request(method, path, body=data, headers=headers)
    response = connection.getresponse()
    raw = response.read()
    connection.close()
    try:
        raw = json.loads(raw)
    except ValueError:
        pass
    return response.status, response.headers, raw


def send_raw(port, head: bytes, body: bytes = b"", close_write=True, timeout=HANG_GUARD_SECONDS):
    """The status of a hand-written request (None when the server closed without answering)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as connection:
        connection.sendall(head + body)
        if close_write:
            connection.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := connection.recv(65536):
            reply += chunk
    match = re.match(rb"HTTP/1\.[01] (\d{3})", reply)
    return int(match.group(1)) if match else None


def greedy_tokens(port, text="The lighthouse keeper said", max_tokens=8):
    status, _, body = send(port, "POST", CHAT, {"messages": [{"role": "user", "content": text}],
                                                "max_tokens": max_tokens, "temperature": 0, "logprobs": True})
    assert status == 200, body
    return [entry["id"] for entry in body["choices"][0]["logprobs"]["content"]]


# ---- the request checks, without a server --------------------------------------------------

LIMITS = RequestLimits(max_tokens=1000, vocab_size=500)
GOOD_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.mark.parametrize("change, field", [
    ({"stop": 5}, "stop"), ({"stop": [1, 2]}, "stop"), ({"stop": [""]}, "stop"), ({"stop": ["a"] * 17}, "stop"),
    ({"seed": -1}, "seed"), ({"seed": 2**70}, "seed"), ({"seed": 1.5}, "seed"), ({"seed": True}, "seed"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 10**9}, "max_tokens"), ({"max_tokens": True}, "max_tokens"),
    ({"max_completion_tokens": "5"}, "max_completion_tokens"), ({"temperature": "hot"}, "temperature"),
    ({"temperature": 2.5}, "temperature"), ({"top_p": 1.5}, "top_p"), ({"top_k": 501}, "top_k"),
    ({"min_p": -0.1}, "min_p"), ({"n": 2}, "n"), ({"stream": "yes"}, "stream"), ({"logprobs": 1}, "logprobs"),
    ({"top_logprobs": 50}, "top_logprobs"), ({"logit_bias": {"500": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"), ({"logit_bias": {"3": 1000}}, "logit_bias"),
    ({"xtc_threshold": 0.9}, "xtc_threshold"), ({"presence_penalty": 3}, "presence_penalty"),
    ({"repetition_context_size": -1}, "repetition_context_size"), ({"model": 5}, "model"),
    ({"stream_options": {"include_usage": "y"}}, "stream_options"), ({"adapters": "x"}, "adapters"),
    ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs"),
    ({"messages": []}, "messages"), ({"messages": "hi"}, "messages"), ({"messages": [5]}, "messages[0]"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f",
                                                                                     "arguments": "{x"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
])
def test_each_bad_field_is_a_400_naming_it(change, field):
    with pytest.raises(RequestError) as error:
        validate_body({**GOOD_CHAT, **change}, "chat", LIMITS)
    assert error.value.status == 400 and f"'{field}" in str(error.value)


def test_good_bodies_pass_with_nulls_dropped_and_legacy_logprobs_mapped():
    body = validate_body({**GOOD_CHAT, "seed": 2**64 - 1, "temperature": None, "stop": "x", "logit_bias": {"7": -100},
                          "stream_options": {}}, "chat", LIMITS)
    assert "temperature" not in body and body["seed"] == 2**64 - 1 and body["stream_options"] == {
        "include_usage": False}
    text = validate_body({"prompt": "Once", "logprobs": 3, "xtc_probability": 0}, "text", LIMITS)
    assert text["logprobs"] is True and text["top_logprobs"] == 3 and isinstance(text["xtc_probability"], float)
    for prompt in ("", ["a"], 5, None):
        with pytest.raises(RequestError, match="'prompt'"):
            validate_body({"prompt": prompt}, "text", LIMITS)


@pytest.mark.parametrize("raw", [b"{not json", b"\xff\xfe", b'{"a": NaN}', b'{"a": Infinity}', b"[" * 100000])
def test_bad_json_is_a_400_never_a_crash(raw):
    with pytest.raises(RequestError) as error:
        parse_json(raw)
    assert error.value.status == 400


# ---- the server ----------------------------------------------------------------------------


def test_attacks_from_issue_49_are_400s_and_the_server_goes_on(server):
    port, _ = server
    before = greedy_tokens(port)
    for path, body, field in [
        (CHAT, {**GOOD_CHAT, "stop": 5}, "stop"), (CHAT, {**GOOD_CHAT, "stop": [1, 2]}, "stop"),
        ("/v1/completions", {"prompt": "", "max_tokens": 2}, "prompt"),
        (CHAT, {**GOOD_CHAT, "seed": -1}, "seed"), (CHAT, {**GOOD_CHAT, "seed": 2**70}, "seed"),
        (CHAT, {"messages": [], "max_tokens": 2}, "messages"), (CHAT, {**GOOD_CHAT, "max_tokens": 10**9}, "max_tokens"),
    ]:
        status, _, reply = send(port, "POST", path, body)
        assert status == 400 and f"'{field}'" in reply["error"]["message"], (body, reply)
    status, _, reply = send(port, "GET", "/health")
    assert status == 200 and reply == {"status": "ok"}
    assert greedy_tokens(port) == before


def test_a_failure_inside_the_generation_loop_is_that_requests_500(server, monkeypatch):
    port, generator = server
    before = greedy_tokens(port)
    make_state_machine = generator._make_state_machine

    def failing(model_key, tokenizer, stop_words):
        if "explode" in stop_words:
            raise RuntimeError("injected failure")
        return make_state_machine(model_key, tokenizer, stop_words)

    monkeypatch.setattr(generator, "_make_state_machine", failing)
    status, _, reply = send(port, "POST", CHAT, {**GOOD_CHAT, "stop": ["explode"]})
    assert status == 500 and "injected failure" in reply["error"]["message"]
    assert send(port, "GET", "/health")[0] == 200
    assert greedy_tokens(port) == before


@pytest.mark.parametrize("stream", [False, True])
def test_a_failure_while_decoding_is_that_requests_500(server, monkeypatch, stream):
    """A failure after the request has started (headers buffered, or a stream under way)."""
    from mlx_lm import server as mlx_server

    port, _ = server
    before = greedy_tokens(port)
    format_top_logprobs = mlx_server._format_top_logprobs

    def failing(logprobs, top_n, tokenizer):
        if top_n == 7:
            raise RuntimeError("injected decode failure")
        return format_top_logprobs(logprobs, top_n, tokenizer)

    monkeypatch.setattr(mlx_server, "_format_top_logprobs", failing)
    status, _, reply = send(port, "POST", CHAT, {**GOOD_CHAT, "logprobs": True, "top_logprobs": 7, "stream": stream})
    if stream:  # the 200 went out with the headers: the stream ends with the error
        assert status == 200 and b"injected decode failure" in reply and b"[DONE]" not in reply
    else:
        assert status == 500 and "injected decode failure" in reply["error"]["message"]
    assert send(port, "GET", "/health")[0] == 200
    assert greedy_tokens(port) == before


def test_the_api_key_may_come_from_the_environment(monkeypatch):
    args = build_parser().parse_args(["serve"])
    monkeypatch.setenv("VELOXQUANT_API_KEY", "from-env")
    assert server_arguments(args, None).api_key == "from-env"
    args = build_parser().parse_args(["serve", "--api-key", "flag"])
    assert server_arguments(args, None).api_key == "flag"
    monkeypatch.delenv("VELOXQUANT_API_KEY")
    assert server_arguments(build_parser().parse_args(["serve"]), None).api_key is None


def _fuzz_value(rng: random.Random):
    choices = [lambda: rng.randint(-2**70, 2**70), lambda: rng.randint(-3, 3), lambda: rng.random() * 10 - 5,
               lambda: rng.choice(["", "x", "\x00", "é" * 50, "NaN", "1e309", "-1"]), lambda: rng.choice([True, False]),
               lambda: None, lambda: [rng.randint(-5, 5) for _ in range(rng.randint(0, 3))],
               lambda: {rng.choice(["a", "url", "type", "0"]): rng.choice([1, "x", None, []])}, lambda: [[[]]],
               lambda: [{"type": rng.choice(["text", "image_url", "input_audio", "file", 5])}]]
    return rng.choice(choices)()


FUZZ_FIELDS = ["model", "messages", "prompt", "stop", "max_tokens", "max_completion_tokens", "temperature", "top_p",
               "top_k", "min_p", "seed", "stream", "stream_options", "logprobs", "top_logprobs", "n", "logit_bias",
               "repetition_penalty", "repetition_context_size", "presence_penalty", "frequency_penalty",
               "xtc_probability", "xtc_threshold", "tools", "role_mapping", "chat_template_kwargs", "adapters",
               "draft_model", "num_draft_tokens", "user", "response_format", "zz_unknown"]
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "repetition_context_size")


def fuzz_request(rng: random.Random, port: int) -> tuple[bytes, bytes, bool]:
    """(head, body, whether the server owes an answer) of one random, mostly malformed request."""
    path = rng.choice([CHAT] * 5 + ["/v1/completions"] * 3 + ["/chat/completions", "/v1/models", "/health", "/x",
                                                              "/v1/" + "a" * 300])
    if path in (CHAT, "/chat/completions"):
        body = {"messages": [{"role": "user", "content": rng.choice(["hi", "tell me", "x " * 20])}], "max_tokens": 2}
    else:
        body = {"prompt": rng.choice(["Once", "a b c", "z"]), "max_tokens": 2}
    for name in rng.sample(FUZZ_FIELDS, rng.randint(0, 3)):
        value = _fuzz_value(rng)
        if name in TOKEN_FIELDS and isinstance(value, int) and not isinstance(value, bool) and 3 < value < CONTEXT:
            value = 3  # every generation stays a few tokens long
        body[name] = value
    data = json.dumps(body).encode()
    kind = rng.random()
    if kind < 0.15:
        data = bytes(rng.randrange(256) for _ in range(rng.randint(0, 64)))
    elif kind < 0.25:
        data = data[: rng.randint(0, len(data))]
    method = rng.choice(["POST"] * 16 + ["GET", "PUT", "DELETE", "OPTIONS", "PATCH", "HEAD"])
    headers = {"Host": f"127.0.0.1:{port}", "Content-Type": rng.choice(["application/json"] * 6 + [
        "text/plain", "application/json; charset=utf-8", "multipart/form-data", "", "application/x-www-form-urlencoded"])}
    length, owed = str(len(data)), True
    weird = rng.random()
    if weird < 0.1:
        length = rng.choice(["-1", "abc", "1e3", "+5", " ", "99999999999999999999999", "0x10", "٣"])
    elif weird < 0.15:
        length = None
    elif weird < 0.2:
        headers["Transfer-Encoding"] = "chunked"
    elif weird < 0.25:  # a length the body does not reach: the client sends less, then closes
        length, owed = str(len(data) + rng.randint(1, 100)), False
    elif weird < 0.3:
        headers["Authorization"] = rng.choice(["Bearer", "Basic xyz", "Bearer " + "k" * 1000])
        headers["Origin"] = "http://evil.example"
    elif weird < 0.33:  # more headers, or a longer header line, than http.server reads
        headers.update({f"X-Junk-{i}": "1" for i in range(120)} if rng.random() < 0.5 else {"X-Long": "y" * 70000})
    if length is not None:
        headers["Content-Length"] = length
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    return head.encode("utf-8"), data, owed


def test_fuzz_never_breaks_the_server(server):
    port, generator = server
    before = greedy_tokens(port)
    rng = random.Random(49)
    requests = [fuzz_request(rng, port) for _ in range(FUZZ_REQUESTS)]

    def one(request):
        head, body, owed = request
        # A client that half-closes reads as one that has gone (its request is stopped), so
        # only the requests whose body falls short close their side, to end the body.
        return send_raw(port, head, body, close_write=not owed), owed

    start = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, requests))
    assert time.monotonic() - start < 10 * HANG_GUARD_SECONDS, "the fuzz hung"
    statuses = [status for status, _ in results]
    assert len(statuses) >= 500
    assert not [s for s in statuses if s is not None and s >= 500], statuses
    assert all(status is not None for status, owed in results if owed)
    assert {200, 400, 415, 431}.issubset(statuses)  # the fuzz reaches generation, the checks and the headers
    assert send(port, "GET", "/health")[0] == 200
    assert greedy_tokens(port) == before


def test_a_drive_by_post_is_refused_and_cors_is_off_by_default(server, settings):
    port, _ = server
    evil = {"Origin": "http://evil.example"}
    status, headers, reply = send(port, "POST", CHAT, json.dumps(GOOD_CHAT).encode(),
                                  {**evil, "Content-Type": "text/plain"})
    assert status == 415 and "application/json" in reply["error"]["message"]
    for method, path in (("OPTIONS", CHAT), ("GET", "/health"), ("POST", CHAT)):
        _, headers, _ = send(port, method, path, GOOD_CHAT if method == "POST" else None, evil)
        assert not any(k.lower().startswith("access-control-") for k in headers), (method, headers)
    settings.allowed_origins = ["http://good.example"]
    _, headers, _ = send(port, "OPTIONS", CHAT, None, {"Origin": "http://good.example"})
    assert headers["Access-Control-Allow-Origin"] == "http://good.example"
    _, headers, _ = send(port, "OPTIONS", CHAT, None, evil)
    assert "Access-Control-Allow-Origin" not in headers


def test_image_parts_are_refused_and_no_url_is_fetched(server, settings):
    port, _ = server
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.5)
    target = f"http://127.0.0.1:{listener.getsockname()[1]}/probe.png"
    parts = [{"type": "image_url", "image_url": {"url": target}}, {"type": "image", "image": target},
             {"type": "input_image", "image_url": target}, {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]
    for allow_fetch in (False, True):
        settings.allow_fetch = allow_fetch  # no vision tower: refused either way
        for part in parts:
            body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "look"}, part]}], "max_tokens": 2}
            status, _, reply = send(port, "POST", CHAT, body)
            assert status == 400 and "'messages[0].content[1]'" in reply["error"]["message"], reply
    accepted = 0
    try:
        while True:
            listener.accept()[0].close()
            accepted += 1
    except socket.timeout:
        pass
    finally:
        listener.close()
    assert accepted == 0


def test_api_key(server, settings):
    port, _ = server
    settings.api_key = "s3cret"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
        assert send(port, "GET", "/v1/models", None, headers)[0] == 401
        status, response_headers, _ = send(port, "POST", CHAT, GOOD_CHAT, headers)
        assert status == 401 and response_headers["WWW-Authenticate"] == "Bearer"
    assert send(port, "GET", "/health")[0] == 200
    good = {"Authorization": "Bearer s3cret"}
    assert send(port, "GET", "/v1/models", None, good)[0] == 200
    assert send(port, "POST", CHAT, GOOD_CHAT, good)[0] == 200


@pytest.mark.parametrize("length, status", [("-1", 400), ("abc", 400), ("+5", 400), (str(10**12), 413), (None, 411)])
def test_a_bad_content_length_is_answered_without_reading_the_body(server, length, status):
    port, _ = server
    head = f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {length}\r\n\r\n" if length is not None else "\r\n"
    # The connection stays open for writing: a server waiting for the body would never answer.
    assert send_raw(port, head.encode(), close_write=False) == status


def test_a_body_over_the_limit_is_a_413(server, settings):
    port, _ = server
    settings.max_body_bytes = 1000
    body = {**GOOD_CHAT, "user": "x" * 2000}
    assert send(port, "POST", CHAT, body)[0] == 413
    settings.max_body_bytes = 4 * 2**20
    assert send(port, "POST", CHAT, body)[0] == 200


def _wait(condition, what):
    deadline = time.monotonic() + HANG_GUARD_SECONDS
    while not condition():
        assert time.monotonic() < deadline, f"hang: {what}"
        time.sleep(0.02)


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_stops_its_generation(server, stream):
    port, generator = server
    huge = CONTEXT - 100
    body = json.dumps({**GOOD_CHAT, "max_tokens": huge, "stream": stream}).encode()
    head = (f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    client = socket.create_connection(("127.0.0.1", port))
    client.sendall(head + body)
    _wait(lambda: [q for q in generator.in_flight() if q.max_tokens == huge and q.tokens > 2], "generation start")
    (request,) = [q for q in generator.in_flight() if q.max_tokens == huge]
    client.close()
    _wait(lambda: request.context is not None and request.context._should_stop, "the handler noticing")
    greedy_tokens(port, max_tokens=2)  # the loop removes stopped requests on every step
    decoded = request.tokens
    greedy_tokens(port, max_tokens=2)
    assert request.tokens == decoded < huge


def test_sigint_stops_the_server_with_status_0(model_dir):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    command = [sys.executable, "-m", "veloxquant_mlx.cli", "serve", "--model", str(model_dir), "--port", "0",
               "--log-level", "INFO"]
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    try:
        port, lines = None, []
        while port is None:
            line = process.stderr.readline()
            assert line, "".join(lines)
            lines.append(line)
            if match := re.search(r"http://127\.0\.0\.1:(\d+)/v1", line):
                port = int(match.group(1))
        answered = greedy_tokens(port, max_tokens=3)
        assert len(answered) == 3
        # A stream still decoding when the signal comes is aborted, not waited for.
        streaming = http.client.HTTPConnection("127.0.0.1", port, timeout=HANG_GUARD_SECONDS)
        streaming.request("POST", CHAT, json.dumps({**GOOD_CHAT, "max_tokens": CONTEXT - 100, "stream": True}),
                          {"Content-Type": "application/json"})
        reply = streaming.getresponse()
        assert reply.status == 200
        while not (line := reply.fp.readline()).startswith(b"data: "):  # keepalives come first
            assert line, "the stream ended before its first token"
        process.send_signal(signal.SIGINT)
        _, rest = process.communicate(timeout=HANG_GUARD_SECONDS)
        try:
            tail = reply.read()
        except (http.client.IncompleteRead, ConnectionError):
            tail = b""
        streaming.close()
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, rest
    assert "terminate called" not in rest and "Traceback" not in rest, rest
    assert b"[DONE]" not in tail


@pytest.mark.parametrize("system", ["short", pytest.param("long", marks=pytest.mark.slow)])
def test_concurrent_greedy_answers_are_the_one_at_a_time_answers(model_dir, system):
    """32 greedy requests sharing a system prompt, asked one at a time (filling the prompt pool) and then all
    at once (served from pooled caches trimmed to each prompt, decoded in batches), give the same tokens
    under `--kv vq4`. The short prompts (35 tokens) start decoding before they hold codes, so their rows join
    the batch's shared buffers steps later; the long ones (417 tokens) reuse their pooled means."""
    from veloxquant_mlx.evaluation.serving import POOL_SYSTEM, POOL_SYSTEM_LONG, pooled_answers

    httpd, generator = serve_in_thread(["--model", str(model_dir), "--port", "0", "--log-level", "CRITICAL",
                                        "--kv", "vq4"])
    try:
        generator.request_limits()
        alone, together, reused = pooled_answers(httpd.server_address[1], 32,
                                                 POOL_SYSTEM if system == "short" else POOL_SYSTEM_LONG)
    finally:
        httpd.shutdown()
        httpd.server_close()
        generator.stop_and_join()
    assert all(len(tokens) == 32 for tokens in alone) and reused == len(alone)
    assert [a == b for a, b in zip(alone, together)] == [True] * len(alone)
