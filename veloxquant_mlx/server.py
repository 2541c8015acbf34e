"""`veloxquant serve`: mlx-lm's OpenAI-compatible server with compressed KV caches.

Everything HTTP, batching and prompt reuse is `mlx_lm.server`'s own code. We change
only what it loads and a few answers:

* `VeloxModelProvider` loads the model with the project's loader (the dequantizing
  CPU path, GGUF files, "smollm2") and patches it so `make_prompt_cache` returns
  compressed caches. They have `merge`, so mlx-lm batches concurrent requests
  (`batch.BatchCompressedKVCache`), and its `LRUPromptCache` keeps what
  `extract` returns: batch-1 caches of codes, trimmed to a shared prefix on a hit
  and bounded by `--prompt-cache-bytes` through their `nbytes`.
* A request for a model other than the one served is a 404 ("model not found"),
  not a download; a prompt longer than `--max-context` is a 400.
* `/v1/models` lists the served model.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import time
from typing import Optional

import mlx.core as mx
from mlx_lm import server as mlx_server
from mlx_lm.models.cache import make_prompt_cache

from .config import KVCacheConfig


class RequestError(ValueError):
    """A request the server refuses, with the HTTP status an OpenAI client expects."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class VeloxModelProvider(mlx_server.ModelProvider):
    """mlx-lm's provider loading through `models.load_model`; `kv_config=None` keeps mlx-lm's
    own caches (the baseline of `benchmarks/serve_throughput.py`)."""

    def __init__(self, cli_args: argparse.Namespace, kv_config: Optional[KVCacheConfig]):
        self.kv_config = kv_config
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
        model, tokenizer = load_model(model_path)
        if self.cli_args.chat_template:
            tokenizer.chat_template = self.cli_args.chat_template
        if self.cli_args.use_default_chat_template and tokenizer.chat_template is None:
            tokenizer.chat_template = tokenizer.default_chat_template
        if self.kv_config is not None:
            patch_model(model, self.kv_config, tokenizer=tokenizer)
        self.model_key = (model_path, adapter_path, draft_model_path)
        self.model, self.tokenizer, self.processor, self.draft_model = model, tokenizer, None, None
        self.is_batchable = all(getattr(c, "batchable", hasattr(c, "merge")) for c in make_prompt_cache(model))


class VeloxResponseGenerator(mlx_server.ResponseGenerator):
    def _tokenize(self, tokenizer, request, args):
        result = super()._tokenize(tokenizer, request, args)
        limit = self.cli_args.max_context or context_limit(self.model_provider.model)
        if limit and len(result[0]) > limit:
            raise RequestError(f"the prompt has {len(result[0])} tokens, more than this server's context limit "
                               f"of {limit} (--max-context)", 400)
        return result


def context_limit(model) -> Optional[int]:
    """The model's trained context (`max_position_embeddings`), or None if it does not say."""
    return getattr(getattr(model, "args", None), "max_position_embeddings", None)


class _StatusOfErrors:
    """The response generator as one request handler sees it: remembers the HTTP status
    of the `RequestError` its `generate` raised (mlx-lm's handler answers 404 to any)."""

    def __init__(self, generator, handler):
        self._generator, self._handler = generator, handler

    def generate(self, *args, **kwargs):
        try:
            return self._generator.generate(*args, **kwargs)
        except RequestError as error:
            self._handler.error_status = error.status
            raise

    def __getattr__(self, name):
        return getattr(self._generator, name)


_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 411: "invalid_request_error"}


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
            data = json.dumps({"error": {"message": body["error"], "type": _ERROR_TYPES.get(self._status, "error"),
                                         "param": None, "code": self._status}}).encode()
        return self._stream.write(data)

    def __getattr__(self, name):
        return getattr(self._stream, name)


class VeloxAPIHandler(mlx_server.APIHandler):
    def __init__(self, response_generator, *args, **kwargs):
        self.error_status = None
        super().__init__(_StatusOfErrors(response_generator, self), *args, **kwargs)

    def _set_completion_headers(self, status_code: int = 200):
        if status_code == 404 and self.error_status is not None:
            status_code, self.error_status = self.error_status, None
        if status_code >= 400 and not isinstance(self.wfile, _OpenAIErrorBody):
            self.wfile = _OpenAIErrorBody(self.wfile, status_code)
        super()._set_completion_headers(status_code)

    def handle_models_request(self):
        self._set_completion_headers(200)
        self.end_headers()
        name = self.response_generator.cli_args.served_model_name
        created = int(getattr(self.response_generator.cli_args, "started", time.time()))
        self.wfile.write(json.dumps({"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "veloxquant"}]}).encode())


def server_arguments(args, kv_config: Optional[KVCacheConfig]) -> argparse.Namespace:
    """mlx-lm server's settings: ours from the command line, the rest at mlx-lm's defaults."""
    return argparse.Namespace(
        model=args.model, served_model_name=args.served_model_name or args.model, adapter_path=None,
        host=args.host, port=args.port, allowed_origins=["*"], draft_model=None, num_draft_tokens=3,
        trust_remote_code=False, log_level=args.log_level, chat_template=args.chat_template,
        use_default_chat_template=args.use_default_chat_template, temp=args.temp, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, max_tokens=args.max_tokens, chat_template_args=args.chat_template_args,
        decode_concurrency=args.decode_concurrency, prompt_concurrency=args.prompt_concurrency,
        prefill_step_size=args.prefill_step_size, prompt_cache_size=args.prompt_cache_size,
        prompt_cache_bytes=args.prompt_cache_bytes, kv_bits=None, kv_group_size=64,
        quantized_kv_start=0, pipeline=False, max_context=args.max_context,
        started=time.time(),
    )


def make_server(cli_args: argparse.Namespace, kv_config: Optional[KVCacheConfig]):
    """(HTTP server, response generator), the server bound but not yet serving (tests and `serve`)."""
    provider = VeloxModelProvider(cli_args, kv_config)
    response_generator = VeloxResponseGenerator(provider, mlx_server.LRUPromptCache(cli_args.prompt_cache_size))
    httpd = mlx_server.ThreadingHTTPServer(
        (cli_args.host, cli_args.port),
        lambda *a, **k: VeloxAPIHandler(response_generator, *a,
                                         system_fingerprint=mlx_server.get_system_fingerprint(), **k),
    )
    return httpd, response_generator


def serve(cli_args: argparse.Namespace, kv_config: KVCacheConfig, ready: Optional[callable] = None):
    logging.basicConfig(level=getattr(logging, cli_args.log_level.upper()),
                        format="%(asctime)s - %(levelname)s - %(message)s")
    httpd, response_generator = make_server(cli_args, kv_config)
    host, port = httpd.server_address[:2]
    logging.info(f"veloxquant serve: {cli_args.served_model_name} with {kv_config.describe()} caches "
                 f"on http://{host}:{port}/v1")
    if ready is not None:
        ready(host, port)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
        response_generator.stop_and_join()


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
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                        help="logging level (default: INFO)")
