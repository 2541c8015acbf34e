"""`veloxquant serve` (mlx-lm's server with compressed caches) through the real `openai` client.

The served model is a small random-weight llama with SmolLM2's tokenizer and chat
template, so requests cost milliseconds; what is tested is the serving, not the text.
"""

import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import pytest

from conftest import bound_server, serve_in_thread, tiny_llama_dir

openai = pytest.importorskip("openai")

POOL_BYTES = 2_000_000
CONTEXT = 200


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory.mktemp("tiny-smollm2"), CONTEXT)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    httpd, generator = serve_in_thread(["--model", str(tiny_model_dir), "--served-model-name", "tiny", "--port", "0",
                                        "--max-tokens", "8", "--prompt-cache-bytes", str(POOL_BYTES),
                                        "--log-level", "WARNING", "--method", "turboquant_mse", "--bits", "4"])
    yield httpd, generator
    httpd.shutdown()
    httpd.server_close()
    generator.stop_and_join()


@pytest.fixture
def client(server):
    port = server[0].server_address[1]
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client, text, **kwargs):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}],
                                          temperature=0.0, **kwargs)


def test_models_and_chat_and_completions(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    reply = _chat(client, "Hello there", max_tokens=5)
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.completion_tokens <= 5
    text = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=4, temperature=0.0)
    assert text.usage.completion_tokens <= 4 and text.choices[0].text is not None


def test_streaming_gives_the_same_text(client):
    whole = _chat(client, "Stream me a few words", max_tokens=6).choices[0].message.content
    pieces = [c.choices[0].delta.content or "" for c in _chat(client, "Stream me a few words", max_tokens=6,
                                                              stream=True) if c.choices]
    assert "".join(pieces) == whole


def test_prefix_cache_hit_gives_what_a_cold_cache_gives(client, server):
    """A request that reuses a pooled cache (trimmed to the shared prefix) answers as a fresh cache does."""
    from mlx_lm import generate

    question = "Tell me about lighthouses and the keepers who lived in them."
    first = _chat(client, question, max_tokens=6)
    again = _chat(client, question, max_tokens=6)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.choices[0].message.content == first.choices[0].message.content
    messages = [{"role": "user", "content": question},
                {"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And then?"}]
    follow = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0.0)
    assert follow.usage.prompt_tokens_details.cached_tokens > 0
    provider = server[1].model_provider
    prompt = provider.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    cold = generate(provider.model, provider.tokenizer, prompt, max_tokens=6,
                    prompt_cache=provider.model.make_cache())
    assert follow.choices[0].message.content == cold


def test_pool_holds_codes_bounded_in_bytes(client, server):
    from veloxquant_mlx.cache import CompressedKVCache

    for i in range(6):
        _chat(client, f"request number {i} " * 8, max_tokens=3)
    pool = server[1].prompt_cache
    assert 0 < pool.nbytes <= POOL_BYTES
    entries = [pool._trie.get(model, tokens) for lru in pool._lru._lrus.values() for model, tokens in lru]
    assert entries
    for entry in entries:
        for layer in entry.prompt_cache:  # batch-1 caches of codes, never dequantized arrays
            assert isinstance(layer, CompressedKVCache) and layer.batch == 1 and layer.encoded > 0


def test_bad_requests_get_openai_errors_and_the_server_goes_on(client, server):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="context limit"):
        _chat(client, "word " * (CONTEXT + 10), max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        _chat(client, "hi", max_tokens=-3)
    port = server[0].server_address[1]
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=b"{not json",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(request, timeout=30)
    assert error.value.code == 400
    assert _chat(client, "still there?", max_tokens=2).choices[0].finish_reason in ("stop", "length")


def test_concurrent_requests_and_a_client_that_disconnects(client):
    stream = _chat(client, "A long story please", max_tokens=8, stream=True)
    next(iter(stream))
    stream.close()  # gone mid-stream
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda i: _chat(client, f"client {i} says hi", max_tokens=4), range(8)))
    assert all(r.choices[0].finish_reason in ("stop", "length") for r in replies)
    # Batched answers equal the same requests sent one at a time.
    alone = [_chat(client, f"client {i} says hi", max_tokens=4) for i in range(8)]
    assert [r.choices[0].message.content for r in replies] == [r.choices[0].message.content for r in alone]


def test_load_8_clients_50_requests_each(client, server):
    def run(worker):
        done = 0
        for i in range(50):
            reply = _chat(client, f"worker {worker} request {i}: hello", max_tokens=2)
            done += reply.choices[0].finish_reason in ("stop", "length")
        return done

    with ThreadPoolExecutor(8) as pool:
        first = list(pool.map(run, range(8)))
        active_after_first = mx.get_active_memory()
        second = list(pool.map(run, range(8, 16)))
    assert first == [50] * 8 and second == [50] * 8
    assert server[1].prompt_cache.nbytes <= POOL_BYTES
    # Memory is bounded: a second round of 400 new prompts does not keep what the first left.
    assert mx.get_active_memory() <= 1.5 * active_after_first + POOL_BYTES


def test_connections_wait_in_the_backlog_while_accepts_fall_behind(tiny_model_dir):
    """Many clients connecting while the accept loop is held up (the generation thread holding the
    interpreter) all complete their handshakes; with Python's backlog of 5 the rest were dropped or reset."""
    import socket

    httpd, generator = bound_server(["--model", str(tiny_model_dir), "--port", "0", "--kv", "vq4"])  # never accepts
    connected = []
    try:
        for _ in range(64):
            sock = socket.socket()
            sock.settimeout(0.5)
            try:
                sock.connect(httpd.server_address[:2])
                connected.append(sock)
            except OSError:
                sock.close()
        assert len(connected) == 64
    finally:
        for sock in connected:
            sock.close()
        httpd.server_close()
        generator.stop_and_join()
