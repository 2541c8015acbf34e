"""`veloxquant serve`: mlx-lm's OpenAI-compatible server with compressed KV caches, safe by default.

Everything HTTP, batching and prompt reuse is `mlx_lm.server`'s own code. We change
what it loads, a few answers, and what it lets through:

* `VeloxModelProvider` loads the model with the project's loader (the dequantizing
  CPU path, GGUF files, "smollm2") and patches it so `make_prompt_cache` returns
  compressed caches. They have `merge`, so mlx-lm batches concurrent requests
  (`batch.BatchCompressedKVCache`), and its `LRUPromptCache` keeps what
  `extract` returns: batch-1 caches of codes, trimmed to a shared prefix on a hit
  and bounded by `--prompt-cache-bytes` through their `nbytes`.
* A request for a model other than the one served is a 404 ("model not found"),
  not a download; a prompt longer than `--max-context` is a 400.
* Every body is checked (`server_requests.validate_body`) before mlx-lm reads it: a
  wrong type or range is a 400 naming the field. A POST must be `application/json`
  (415), so a web page cannot send one without a CORS preflight, and CORS headers go
  only to the `--allow-origin` origins. `--api-key` (or `VELOXQUANT_API_KEY`) requires
  `Authorization: Bearer KEY` everywhere but `/health`. A body is at most
  `--max-body-mb`; a bad `Content-Length` is refused before any byte is read.
* No URL is fetched: image parts are refused for a model without a vision tower, and
  http(s) images need `--allow-fetch`.
* The generation loop outlives any one request's failure: the requests it was serving
  get a 500 and it starts again. A request whose client has gone is stopped.
* SIGINT and SIGTERM stop the server, abort what is in flight and exit with status 0.
* `/v1/models` lists the served model.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hmac
import io
import json
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
import weakref
from typing import Optional

import mlx.core as mx
from mlx_lm import server as mlx_server
from mlx_lm.models.cache import make_prompt_cache

from .config import KVCacheConfig
from .prompt_cache import FreshPromptCache
from .server_requests import RequestError, RequestLimits, parse_json, validate_body

ENDPOINTS = {"/v1/completions": "text", "/v1/chat/completions": "chat", "/chat/completions": "chat"}
DEFAULT_MAX_TOKENS_LIMIT = 131072  # for a model whose config names no context length
CLIENT_CHECK_SECONDS = 0.05
STATS_PATH = "/v1/veloxquant/stats"


class VeloxModelProvider(mlx_server.ModelProvider):
    """mlx-lm's provider loading through `models.load_model`; `kv_config=None` keeps mlx-lm's
    own caches (the baseline of `benchmarks/serve_throughput.py`)."""

    def __init__(self, cli_args: argparse.Namespace, kv_config: Optional[KVCacheConfig]):
        self.kv_config = kv_config
        self.ready = threading.Event()  # set once a model is loaded
        super().__init__(cli_args)
        self.served_names = {"default_model", cli_args.model, cli_args.served_model_name}

    def load(self, model_path, adapter_path=None, draft_model_path=None):
        if model_path not in self.served_names:
            raise RequestError(f"model {model_path!r} not found; this server serves {self.cli_args.served_model_name!r}",
                               404)
        if adapter_path is not None:
            raise RequestError("adapters are not supported by veloxquant serve", 400)
        return super().load("default_model", None, "default_model")

    def _load(self, model_path, adapter_path=None, draft_model_path=None):
        from .integration import patch_model
        from .models import load_model

        self.reset()
        gc.collect()
        mx.clear_cache()
        group = self.pipeline_group or self.tensor_group  # mlx-lm's: set under mlx.launch
        model, tokenizer = load_model(model_path, group=group,
                                      parallel="pipeline" if self.pipeline_group is not None else "tensor")
        if self.cli_args.chat_template:
            tokenizer.chat_template = self.cli_args.chat_template
        if self.cli_args.use_default_chat_template and tokenizer.chat_template is None:
            tokenizer.chat_template = tokenizer.default_chat_template
        if self.kv_config is not None:
            patch_model(model, self.kv_config, tokenizer=tokenizer,
                        max_kv_size=getattr(self.cli_args, "max_kv_size", None))
        self.model_key = (model_path, adapter_path, draft_model_path)
        self.model, self.tokenizer, self.processor, self.draft_model = model, tokenizer, None, None
        self.is_batchable = all(getattr(c, "batchable", hasattr(c, "merge")) for c in make_prompt_cache(model))
        self.ready.set()

    def reset(self) -> None:
        self.ready.clear()
        super().reset()


class _TrackedQueue:
    """A request's response queue as the generation thread sees it: counts the tokens put,
    and knows when the request has had its last answer (None or an error)."""

    def __init__(self, queue, max_tokens: int, on_done=None):
        self.queue, self.max_tokens, self.on_done = queue, max_tokens, on_done
        self.tokens, self.done, self.context = 0, False, None

    def put(self, item, *args, **kwargs):
        if isinstance(item, mlx_server.Response):
            self.tokens += 1
        elif isinstance(item, mlx_server.GenerationContext):
            self.context = item
        elif item is None or isinstance(item, Exception):
            self.done = True
            if self.on_done is not None:
                self.on_done(self)
        self.queue.put(item, *args, **kwargs)


class VeloxResponseGenerator(mlx_server.ResponseGenerator):
    """mlx-lm's generation thread, restarted when a request makes it fail."""

    def __init__(self, model_provider, prompt_cache, kv_budget_bytes: Optional[int] = None):
        self._in_flight = weakref.WeakSet()  # held only by the generation loop's own state
        self._limits = None
        self._budget_bytes = kv_budget_bytes
        self.kv_budget = None  # `server_admission.KVBudget`, made once the model is loaded
        super().__init__(model_provider, prompt_cache)

    def _run_generate(self):
        while not self._stop:
            try:
                self._generate()
                return
            except Exception as error:
                logging.exception(f"generation failed, its requests get an error: {error}")
                self._fail_in_flight(error)
                if self.model_provider.model is None:  # the model did not load: nothing to serve
                    self._generation_failed = True
                    return
                time.sleep(0.05)  # a failure that repeats without requests does not spin a core

    def _fail_in_flight(self, error: Exception):
        for queue in list(self._in_flight):
            if not queue.done:
                queue.put(RuntimeError(f"generation failed: {type(error).__name__}: {error}"))
        self._in_flight = weakref.WeakSet()

    def _next_request(self, timeout=None):
        if self._budget_bytes is None:
            return self._tracked(super()._next_request(timeout))
        if self.kv_budget is None:
            self.kv_budget = self._make_budget()
        return self.kv_budget.next(lambda wait: self._tracked(super(VeloxResponseGenerator, self)._next_request(wait)),
                                   timeout, self._prompt_tokens)

    def _tracked(self, request):
        if request is None:
            return None
        budget = self.kv_budget
        queue = _TrackedQueue(request[0], request[2].max_tokens, budget.release if budget is not None else None)
        self._in_flight.add(queue)
        return (queue, *request[1:])

    def _make_budget(self):
        """`--kv-memory-gb`'s rule for the served caches (generation thread, the model loaded)."""
        from .server_admission import CacheBytes, KVBudget

        provider = self.model_provider
        provider.load_default()
        if provider.model is None:
            raise RuntimeError("--kv-memory-gb needs the served model loaded")
        kv_bits = self.cli_args.kv_bits
        if kv_bits is not None:  # mlx-lm's QuantizedKVCache (`--kv none --kv-bits`), as its server makes them
            from mlx_lm.models.cache import QuantizedKVCache

            group = self.cli_args.kv_group_size
            layers = len(make_prompt_cache(provider.model))
            cache_bytes = CacheBytes(provider.model, lambda: [QuantizedKVCache(group, kv_bits) for _ in range(layers)])
        else:
            cache_bytes = CacheBytes(provider.model, lambda: make_prompt_cache(provider.model))
        logging.info(f"KV budget: {self._budget_bytes / 1e9:g} GB; a sequence's caches take "
                     f"{cache_bytes.per_token / 1e3:.2f} KB per token (measured)")
        return KVBudget(self._budget_bytes, cache_bytes)

    def _prompt_tokens(self, request) -> int:
        return len(self._tokenize(self.model_provider.tokenizer, request[1], request[2])[0])

    def in_flight(self) -> list:
        """The requests the generation loop still holds, unanswered (their `tokens` so far)."""
        return [queue for queue in list(self._in_flight) if not queue.done]

    def _tokenize(self, tokenizer, request, args):
        result = super()._tokenize(tokenizer, request, args)
        prompt = result[0]
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            raise RequestError("the chat template did not give a list of token ids", 400)
        if not prompt:
            raise RequestError("the prompt has no tokens", 400)
        limit = self.cli_args.max_context or context_limit(self.model_provider.model)
        if limit and len(prompt) > limit:
            raise RequestError(f"the prompt has {len(prompt)} tokens, more than this server's context limit "
                               f"of {limit} (--max-context)", 400)
        if isinstance(self.prompt_cache, FreshPromptCache):
            # A fresh prefill's first chunk: the first segment (a chat's system prompt is prefilled on its own,
            # and the prompt's last token is held back for generation), at most one prefill step.
            segments = result[1]
            first = len(segments[0]) - (len(segments) == 1)
            self.prompt_cache.first_chunk = min(first, self.cli_args.prefill_step_size)
        return result

    def request_limits(self) -> RequestLimits:
        """What a request may ask of the served model (waits for the model to load)."""
        if self._limits is None:
            provider = self.model_provider
            while not provider.ready.wait(0.25):
                if not self.generation_available():
                    raise RequestError("the model is not loaded; the server cannot generate", 503)
            model, tokenizer = provider.model, provider.tokenizer
            if model is None:
                raise RequestError("the server is shutting down", 503)
            vocab = getattr(getattr(model, "args", None), "vocab_size", None) or len(tokenizer)
            self._limits = RequestLimits(
                max_tokens=context_limit(model) or DEFAULT_MAX_TOKENS_LIMIT, vocab_size=vocab,
                has_vision=provider.processor is not None)
        return dataclasses.replace(self._limits, allow_fetch=self.cli_args.allow_fetch)


def peak_rss_bytes() -> int:
    """This process's peak resident memory (`ru_maxrss`: KB on Linux, bytes on macOS)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def context_limit(model) -> Optional[int]:
    """The model's trained context (`max_position_embeddings`), or None if it does not say."""
    return getattr(getattr(model, "args", None), "max_position_embeddings", None)


class ClientGone(ConnectionError):
    """The client closed its connection while its request was generating."""


def client_gone(connection: socket.socket) -> bool:
    """Whether the peer has closed `connection` (a zero-byte peek on a readable socket).

    A client that only shuts down its sending side looks the same, so it counts as gone:
    HTTP clients keep the connection open until they have read the reply."""
    try:
        poller = select.poll()
        poller.register(connection, select.POLLIN | select.POLLHUP | select.POLLERR)
        if not poller.poll(0):
            return False
        return connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except (OSError, ValueError):
        return True


class _StatusOfErrors:
    """The response generator as one request handler sees it: remembers the HTTP status of
    the error its `generate` raised (mlx-lm's handler answers 404 to any), and stops a
    request's tokens when its client has gone."""

    def __init__(self, generator, handler):
        self._generator, self._handler = generator, handler

    def generate(self, request, generation_args, progress_callback=None):
        def progress(processed, total):  # between prefill chunks
            if client_gone(self._handler.connection):
                raise ClientGone()
            if progress_callback is not None:
                progress_callback(processed, total)

        try:
            ctx, responses = self._generator.generate(request, generation_args, progress_callback=progress)
        except Exception as error:
            self._handler.error_status = getattr(error, "status", 500)
            raise
        return ctx, self._handler.while_connected(responses)

    def __getattr__(self, name):
        return getattr(self._generator, name)


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                411: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
                500: "server_error", 503: "server_error"}


def error_json(message: str, status: int) -> dict:
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "error"), "param": None, "code": status}}


class _OpenAIErrorBody:
    """The response stream of a failed request: mlx-lm writes `{"error": "text"}`, OpenAI
    clients read `{"error": {"message", "type", "code"}}`."""

    def __init__(self, stream, status: int):
        self._stream, self._status = stream, status

    def write(self, data: bytes):
        try:
            body = json.loads(data)
        except ValueError:  # the status line and headers, or a plain-text body
            return self._stream.write(data)
        if isinstance(body, dict) and isinstance(body.get("error"), str):
            data = json.dumps(error_json(body["error"], self._status)).encode()
        return self._stream.write(data)

    def __getattr__(self, name):
        return getattr(self._stream, name)


class VeloxAPIHandler(mlx_server.APIHandler):
    timeout = 120  # seconds a client may stall mid-request before its connection is dropped

    def __init__(self, response_generator, *args, **kwargs):
        self.error_status = None
        super().__init__(_StatusOfErrors(response_generator, self), *args, **kwargs)

    @property
    def settings(self) -> argparse.Namespace:
        return self.response_generator.cli_args

    def _set_completion_headers(self, status_code: int = 200):
        if status_code == 404 and self.error_status is not None:
            status_code, self.error_status = self.error_status, None
        if status_code >= 400 and not isinstance(self.wfile, _OpenAIErrorBody):
            self.wfile = _OpenAIErrorBody(self.wfile, status_code)
        super()._set_completion_headers(status_code)

    def _set_cors_headers(self):
        allowed = self.settings.allowed_origins
        if "*" in allowed or self.headers.get("Origin") in allowed:
            super()._set_cors_headers()

    def refuse(self, status: int, message: str, *headers):
        """Answer `status` with an OpenAI error body and close the connection."""
        body = json.dumps(error_json(message, status)).encode()
        self.error_status = None
        self._set_completion_headers(status)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True

    def authorized(self) -> bool:
        key = self.settings.api_key
        if not key:
            return True
        scheme, _, token = self.headers.get("Authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())

    def _refuse_unauthorized(self):
        self.refuse(401, "a valid API key is required: send 'Authorization: Bearer KEY'",
                    ("WWW-Authenticate", "Bearer"))

    def do_GET(self):
        if self.path != "/health" and not self.authorized():
            return self._refuse_unauthorized()
        if self.path == STATS_PATH:
            return self.handle_stats()
        super().do_GET()

    def handle_stats(self):
        """What an operator's benchmark reads: the KV budget's admissions and MLX's memory counters."""
        budget = self.response_generator.kv_budget
        body = json.dumps({"kv_budget_bytes": None if budget is None else budget.limit,
                           "admission": None if budget is None else dataclasses.asdict(budget.stats),
                           "mlx_peak_memory_bytes": mx.get_peak_memory(), "peak_rss_bytes": peak_rss_bytes(),
                           "mlx_active_memory_bytes": mx.get_active_memory()}).encode()
        self._set_completion_headers(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def refuse_method(self):
        self.refuse(405, f"method {self.command} is not allowed", ("Allow", "GET, POST, OPTIONS"))

    do_PUT = do_DELETE = do_PATCH = do_HEAD = refuse_method

    def do_POST(self):
        if not self.authorized():
            return self._refuse_unauthorized()
        endpoint = ENDPOINTS.get(self.path)
        if endpoint is None:
            return self.refuse(404, f"no endpoint {self.path[:200]!r}")
        if self.headers.get_content_type() != "application/json":
            return self.refuse(415, "Content-Type must be application/json")
        raw = self._read_body()
        if raw is None:
            return
        try:
            body = validate_body(parse_json(raw), endpoint, self.response_generator.request_limits())
        except RequestError as error:
            return self.refuse(error.status, str(error))
        # mlx-lm's handler reads the checked body again, as if it had come from the client.
        data = json.dumps(body).encode()
        del self.headers["Content-Length"]
        self.headers["Content-Length"] = str(len(data))
        socket_file, self.rfile = self.rfile, io.BytesIO(data)
        try:
            super().do_POST()
        finally:
            self.rfile = socket_file

    def _read_body(self) -> Optional[bytes]:
        """The body, or None once refused: a missing, malformed or too large Content-Length
        is answered before any byte of it is read."""
        if "Transfer-Encoding" in self.headers:
            self.refuse(411, "chunked bodies are not accepted; send Content-Length")
            return None
        lengths = self.headers.get_all("Content-Length") or []
        if not lengths:
            self.refuse(411, "Content-Length header is required")
            return None
        text = lengths[0].strip()
        if len(set(lengths)) > 1 or not (text.isascii() and text.isdigit()) or len(text) > 18:
            self.refuse(400, "invalid Content-Length header")
            return None
        length, limit = int(text), self.settings.max_body_bytes
        if length > limit:
            self.refuse(413, f"the body has {length} bytes, more than this server's limit of {limit} "
                             "(--max-body-mb)")
            return None
        try:
            raw = self.rfile.read(length)
        except OSError:  # the client stalled past `timeout` or went away
            raw = b""
        if len(raw) < length:
            self.close_connection = True
            return None
        return raw

    def handle_chat_completions(self):
        if not self.settings.allow_fetch:
            for part in mlx_server._image_parts(self.body["messages"]):
                url = mlx_server._image_url(part)
                if not isinstance(url, str) or not url.startswith("data:"):
                    raise RequestError("this server fetches no URLs (start it with --allow-fetch)")
        return super().handle_chat_completions()

    def handle_completion(self, request, stop_words):
        try:
            super().handle_completion(request, stop_words)
        except (ClientGone, BrokenPipeError, ConnectionResetError, TimeoutError):
            logging.info("client went away; its request was stopped")
            self.close_connection = True
        except Exception as error:
            logging.exception(f"request failed: {error}")
            self.close_connection = True
            if self.stream:  # the 200 and some tokens are sent: end the stream with the error
                try:
                    self.wfile.write(f"data: {json.dumps(error_json(str(error), 500))}\n\n".encode())
                except OSError:
                    pass
            else:  # mlx-lm buffers the 200 headers until the reply is whole: replace them
                self._headers_buffer = []
                self.refuse(500, f"generation failed: {type(error).__name__}: {error}")

    def while_connected(self, responses):
        """`responses` until its client closes the connection (checked every few tokens),
        then `ClientGone`: mlx-lm's handler stops the request on the way out."""
        checked = time.monotonic()
        for response in responses:
            yield response
            if time.monotonic() - checked > CLIENT_CHECK_SECONDS:
                if client_gone(self.connection):
                    raise ClientGone()
                checked = time.monotonic()

    def handle_models_request(self):
        self._set_completion_headers(200)
        self.end_headers()
        name = self.settings.served_model_name
        created = int(getattr(self.settings, "started", time.time()))
        self.wfile.write(json.dumps({"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "veloxquant"}]}).encode())

    def log_message(self, format, *args):
        logging.info(f"{self.address_string()} {format % args}")


def server_arguments(args, kv_config: Optional[KVCacheConfig]) -> argparse.Namespace:
    """mlx-lm server's settings: ours from the command line, the rest at mlx-lm's defaults."""
    return argparse.Namespace(
        model=args.model, served_model_name=args.served_model_name or args.model, adapter_path=None,
        host=args.host, port=args.port, allowed_origins=list(getattr(args, "allow_origin", None) or []),
        api_key=getattr(args, "api_key", None) or os.environ.get("VELOXQUANT_API_KEY") or None,
        max_body_bytes=int(getattr(args, "max_body_mb", 4.0) * 2**20),
        allow_fetch=getattr(args, "allow_fetch", False), draft_model=None, num_draft_tokens=3,
        trust_remote_code=False, log_level=args.log_level, chat_template=args.chat_template,
        use_default_chat_template=args.use_default_chat_template, temp=args.temp, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, max_tokens=args.max_tokens, chat_template_args=args.chat_template_args,
        decode_concurrency=args.decode_concurrency, prompt_concurrency=args.prompt_concurrency,
        prefill_step_size=args.prefill_step_size, prompt_cache_size=args.prompt_cache_size,
        prompt_cache_bytes=args.prompt_cache_bytes, kv_bits=_mlx_kv_bits(args, kv_config),
        kv_group_size=getattr(args, "kv_group_size", 64), kv_memory_gb=getattr(args, "kv_memory_gb", None),
        quantized_kv_start=0, pipeline=getattr(args, "pipeline", False), max_context=args.max_context,
        max_kv_size=getattr(args, "max_kv_size", None),
        started=time.time(),
    )


def _mlx_kv_bits(args, kv_config) -> Optional[int]:
    bits = getattr(args, "kv_bits", None)
    if bits is not None and kv_config is not None:
        raise ValueError("--kv-bits serves mlx-lm's QuantizedKVCache: give it with --kv none")
    return bits


class _HTTPServer(mlx_server.ThreadingHTTPServer):
    """mlx-lm's threading server with a listen backlog for many clients at once: Python's default of 5 let
    concurrent clients' connections be reset while the generation thread held the interpreter and accepts
    fell behind (docs/serving.md); the kernel caps it at net.core.somaxconn."""

    request_queue_size = 1024


def make_server(cli_args: argparse.Namespace, kv_config: Optional[KVCacheConfig]):
    """(HTTP server, response generator), the server bound but not yet serving (tests and `serve`)."""
    provider = VeloxModelProvider(cli_args, kv_config)
    budget = getattr(cli_args, "kv_memory_gb", None)
    response_generator = VeloxResponseGenerator(provider, FreshPromptCache(cli_args.prompt_cache_size),
                                                None if budget is None else round(budget * 1e9))
    httpd = _HTTPServer(
        (cli_args.host, cli_args.port),
        lambda *a, **k: VeloxAPIHandler(response_generator, *a,
                                         system_fingerprint=mlx_server.get_system_fingerprint(), **k),
    )
    return httpd, response_generator


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def serve(cli_args: argparse.Namespace, kv_config: Optional[KVCacheConfig], ready: Optional[callable] = None,
          exit_when_done: bool = True):
    """Serve until SIGINT or SIGTERM, then stop the generation thread (in-flight requests get
    an error) and, with `exit_when_done`, end the process with status 0.

    The process ends through `os._exit` once everything is stopped and flushed: after another
    thread has run MLX's compiled kernels (the generation thread does), MLX may abort during
    the interpreter's own exit ("terminate called without an active exception")."""
    logging.basicConfig(level=getattr(logging, cli_args.log_level.upper()),
                        format="%(asctime)s - %(levelname)s - %(message)s")
    if mx.distributed.init().rank() != 0:  # under mlx.launch rank 0 serves HTTP; the others follow its requests
        VeloxResponseGenerator(VeloxModelProvider(cli_args, kv_config),
                               mlx_server.LRUPromptCache(cli_args.prompt_cache_size)).join()
        return
    httpd, response_generator = make_server(cli_args, kv_config)
    host, port = httpd.server_address[:2]
    caches = (kv_config.describe() if kv_config is not None else
              f"mlx-lm's QuantizedKVCache ({cli_args.kv_bits} bits)" if cli_args.kv_bits else "mlx-lm's own")
    logging.info(f"veloxquant serve: {cli_args.served_model_name} with {caches} caches "
                 f"on http://{host}:{port}/v1")
    if not cli_args.api_key and host not in ("127.0.0.1", "localhost", "::1"):
        logging.warning(f"listening on {host} without --api-key: anyone who can reach it can use it")
    main_thread = threading.current_thread() is threading.main_thread()
    if main_thread:  # SIGINT too: a shell starts background jobs with SIGINT ignored
        signal.signal(signal.SIGINT, _interrupt)
        signal.signal(signal.SIGTERM, _interrupt)
    if ready is not None:
        ready(host, port)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        logging.info("veloxquant serve: stopping")
    finally:
        if main_thread:  # a second Ctrl-C must not cut the shutdown short
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        httpd.server_close()
        response_generator.stop_and_join()
        if exit_when_done:
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


def add_server_arguments(parser: argparse.ArgumentParser):
    """The server flags, named and defaulted as `mlx_lm.server`'s."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080, help="port to listen on; 0 picks a free one (default: 8080)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model id clients send and /v1/models lists (default: --model)")
    parser.add_argument("--max-context", type=int, default=None,
                        help="longest prompt in tokens; longer ones get HTTP 400 "
                             "(default: the model's max_position_embeddings)")
    parser.add_argument("--temp", type=float, default=0.0, help="default sampling temperature (default: 0.0)")
    parser.add_argument("--top-p", type=float, default=1.0, help="default nucleus sampling top-p (default: 1.0)")
    parser.add_argument("--top-k", type=int, default=0, help="default top-k sampling, 0 = off (default: 0)")
    parser.add_argument("--min-p", type=float, default=0.0, help="default min-p sampling (default: 0.0)")
    parser.add_argument("--max-tokens", type=int, default=512,
                        help="default most tokens per completion (default: 512)")
    parser.add_argument("--chat-template", default="", help="a chat template to use instead of the model's "
                                                            "(default: the model's)")
    parser.add_argument("--use-default-chat-template", action="store_true",
                        help="use the tokenizer's default template when the model has none (default: off)")
    parser.add_argument("--chat-template-args", type=json.loads, default={},
                        help="JSON of extra chat-template arguments (default: {})")
    parser.add_argument("--decode-concurrency", type=int, default=32,
                        help="most requests decoded together in one batch (default: 32)")
    parser.add_argument("--prompt-concurrency", type=int, default=8,
                        help="most prompts prefilled together in one batch (default: 8)")
    parser.add_argument("--prefill-step-size", type=int, default=2048, help="prefill chunk in tokens (default: 2048)")
    parser.add_argument("--prompt-cache-size", type=int, default=10,
                        help="most reusable prompt caches kept (default: 10)")
    parser.add_argument("--prompt-cache-bytes", type=mlx_server._parse_size, default=None,
                        help="most bytes of reusable prompt caches (their nbytes), e.g. 512MB (default: no limit)")
    parser.add_argument("--kv-memory-gb", type=_positive_float, default=None,
                        help="KV-cache budget in GB: a request starts only while the running requests' caches plus "
                             "its own (prompt + max_tokens, as measured for the served caches) fit; otherwise it "
                             "waits, logged as queued (default: no budget)")
    parser.add_argument("--kv-bits", type=int, choices=[2, 3, 4, 5, 6, 8], default=None,
                        help="with --kv none: mlx-lm's QuantizedKVCache at these bits, as `mlx_lm.server --kv-bits` "
                             "(mlx-lm serves such requests one at a time) (default: none)")
    parser.add_argument("--kv-group-size", type=int, choices=[32, 64, 128], default=64,
                        help="group size of --kv-bits (default: 64)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                        help="logging level (default: INFO)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                             "(default: $VELOXQUANT_API_KEY, else none)")
    parser.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                        help="a web origin (e.g. http://localhost:3000) that may call the server from a "
                             "browser; repeatable (default: none, no CORS headers)")
    parser.add_argument("--max-body-mb", type=_positive_float, default=4.0,
                        help="largest request body in MB; larger ones get HTTP 413 (default: 4)")
    parser.add_argument("--allow-fetch", action="store_true",
                        help="let a vision model's requests name http(s) image URLs for the server to fetch "
                             "(default: off; image parts must be data: URLs)")


def _positive_float(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, not {text}")
    return value
