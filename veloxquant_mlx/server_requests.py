"""The checks `veloxquant serve` makes on a request body before mlx-lm's server reads it.

Every field mlx-lm's `APIHandler` or its generation thread reads is checked for type and
range here, against the OpenAI schema where it has one (temperature 0..2, penalties
-2..2, logit bias -100..100, `n` = 1) and against the served model otherwise (token ids
below the vocabulary, `top_k` at most the vocabulary, `max_tokens` at most the context).
A failed check is a `RequestError` naming the field, answered as a 400. Fields this
server does not read are ignored, as OpenAI-compatible servers do.

`validate_body` returns the body with `null` fields dropped (so mlx-lm applies its
defaults) and a few values put in the form mlx-lm expects.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

IMAGE_PART_TYPES = ("image_url", "input_image", "image")
ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# Arguments `apply_chat_template` takes itself: a client's chat_template_kwargs may not set them.
RESERVED_TEMPLATE_ARGUMENTS = {
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
}
MAX_STOP_WORDS = 16
MAX_STOP_CHARS = 256
MAX_MESSAGES = 4096
MAX_PARTS = 256
MAX_TOOLS = 256
MAX_DRAFT_TOKENS = 64
MAX_TOP_LOGPROBS = 10  # mlx-lm's `_validate` bound
MAX_LEGACY_LOGPROBS = 5  # /v1/completions' integer `logprobs`


class RequestError(ValueError):
    """A request the server refuses, with the HTTP status an OpenAI client expects."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class RequestLimits:
    """What a request may ask of the served model."""

    max_tokens: int  # most completion tokens
    vocab_size: int  # token ids and top_k stay below/at it
    has_vision: bool = False
    allow_fetch: bool = False


def parse_json(raw: bytes) -> Any:
    """The JSON of a body: strict UTF-8, no NaN/Infinity, nesting refused as a 400, never a crash."""

    def refuse_constant(name):
        raise RequestError(f"invalid JSON in request body: {name} is not JSON")

    try:
        return json.loads(raw.decode("utf-8"), parse_constant=refuse_constant)
    except RequestError:
        raise
    except RecursionError:
        raise RequestError("invalid JSON in request body: nested too deeply") from None
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError
        raise RequestError(f"invalid JSON in request body: {error}") from None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _type_name(value) -> str:
    return "null" if value is None else type(value).__name__


def _check_int(body, name, low, high):
    value = body[name]
    if not _is_int(value):
        raise RequestError(f"'{name}' must be an integer, not {_type_name(value)}")
    if not low <= value <= high:
        raise RequestError(f"'{name}' must be between {low} and {high}, not {value}")


def _check_number(body, name, low, high, as_float=False):
    value = body[name]
    if not _is_number(value):
        raise RequestError(f"'{name}' must be a finite number, not {_type_name(value)}")
    if not low <= value <= high:
        raise RequestError(f"'{name}' must be between {low} and {high}, not {value}")
    if as_float:
        body[name] = float(value)


def _check_type(body, name, kind, description):
    if not isinstance(body[name], kind) or isinstance(body[name], bool) and kind is not bool:
        raise RequestError(f"'{name}' must be {description}, not {_type_name(body[name])}")


def _check_stop(body):
    stop = body["stop"]
    words = [stop] if isinstance(stop, str) else stop
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        raise RequestError(f"'stop' must be a string or a list of strings, not {_type_name(stop)}")
    if len(words) > MAX_STOP_WORDS:
        raise RequestError(f"'stop' may hold at most {MAX_STOP_WORDS} strings, not {len(words)}")
    for word in words:
        if not 0 < len(word) <= MAX_STOP_CHARS:
            raise RequestError(f"each 'stop' string must have 1 to {MAX_STOP_CHARS} characters")


def _check_logit_bias(body, limits: RequestLimits):
    bias = body["logit_bias"]
    if not isinstance(bias, dict):
        raise RequestError(f"'logit_bias' must be an object of token id to bias, not {_type_name(bias)}")
    if len(bias) > limits.vocab_size:
        raise RequestError(f"'logit_bias' may name at most {limits.vocab_size} tokens")
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and int(key) < limits.vocab_size):
            raise RequestError(f"'logit_bias' keys must be token ids from 0 to {limits.vocab_size - 1}, not {key!r}")
        if not (_is_number(value) and -100 <= value <= 100):
            raise RequestError(f"'logit_bias' values must be numbers between -100 and 100, not {value!r}")


def _check_template_kwargs(body):
    kwargs = body["chat_template_kwargs"]
    if not isinstance(kwargs, dict):
        raise RequestError(f"'chat_template_kwargs' must be an object, not {_type_name(kwargs)}")
    for key in kwargs:
        if not key.isidentifier() or key in RESERVED_TEMPLATE_ARGUMENTS:
            raise RequestError(f"'chat_template_kwargs' may not set {key!r}")


def _check_part(part, where, limits: RequestLimits):
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        raise RequestError(f"'{where}' must be an object with a string 'type'")
    kind = part["type"]
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise RequestError(f"'{where}.text' must be a string")
        return
    if kind not in IMAGE_PART_TYPES:
        raise RequestError(f"'{where}': content parts of type {kind[:64]!r} are not supported; only 'text'")
    if not limits.has_vision:
        raise RequestError(f"'{where}': this model has no vision tower, so {kind!r} parts are refused")
    url = part.get("image_url", part.get("image"))
    url = url.get("url") if isinstance(url, dict) else url
    if not isinstance(url, str):
        raise RequestError(f"'{where}' must give its image as a string URL")
    if not url.startswith("data:") and not limits.allow_fetch:
        raise RequestError(f"'{where}': this server fetches no URLs (start it with --allow-fetch); "
                           "send the image as a data: URL")


def _check_tool_calls(calls, where):
    if not isinstance(calls, list):
        raise RequestError(f"'{where}' must be a list")
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError(f"'{where}[{j}].function' must be an object with a string 'name'")
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            try:
                arguments = parse_json(arguments.encode())
            except RequestError:
                raise RequestError(f"'{where}[{j}].function.arguments' must be a JSON object") from None
        if arguments not in (None, "") and not isinstance(arguments, dict):
            raise RequestError(f"'{where}[{j}].function.arguments' must be a JSON object")


def _check_messages(body, limits: RequestLimits):
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list")
    if len(messages) > MAX_MESSAGES:
        raise RequestError(f"'messages' may hold at most {MAX_MESSAGES} messages")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RequestError(f"'{where}' must be an object")
        if message.get("role") not in ROLES:
            raise RequestError(f"'{where}.role' must be one of {', '.join(ROLES)}")
        content = message.get("content")
        if isinstance(content, list):
            if len(content) > MAX_PARTS:
                raise RequestError(f"'{where}.content' may hold at most {MAX_PARTS} parts")
            for j, part in enumerate(content):
                _check_part(part, f"{where}.content[{j}]", limits)
        elif content is not None and not isinstance(content, str):
            raise RequestError(f"'{where}.content' must be a string, a list of parts or null")
        for name in ("name", "tool_call_id"):
            if message.get(name) is not None and not isinstance(message[name], str):
                raise RequestError(f"'{where}.{name}' must be a string")
        if message.get("tool_calls") is not None:
            _check_tool_calls(message["tool_calls"], f"{where}.tool_calls")


def _check_tools(body):
    tools = body["tools"]
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise RequestError(f"'tools' must be a list of at most {MAX_TOOLS} tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError(f"'tools[{i}].function' must be an object with a string 'name'")


def validate_body(body: Any, endpoint: str, limits: RequestLimits) -> dict:
    """`body` checked for `endpoint` ("chat" or "text"), returned ready for mlx-lm's handler."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    body = {key: value for key, value in body.items() if value is not None}
    ranges = {
        "max_tokens": (1, limits.max_tokens), "max_completion_tokens": (1, limits.max_tokens),
        "top_k": (0, limits.vocab_size), "n": (1, 1), "seed": (0, 2**64 - 1),
        "num_draft_tokens": (0, MAX_DRAFT_TOKENS), "top_logprobs": (0, MAX_TOP_LOGPROBS),
        "repetition_context_size": (0, limits.max_tokens), "presence_context_size": (0, limits.max_tokens),
        "frequency_context_size": (0, limits.max_tokens),
    }
    numbers = {
        "temperature": (0, 2), "top_p": (0, 1), "min_p": (0, 1), "repetition_penalty": (0, 100),
        "presence_penalty": (-2, 2), "frequency_penalty": (-2, 2),
    }
    for name, (low, high) in ranges.items():
        if name in body:
            _check_int(body, name, low, high)
    for name, (low, high) in numbers.items():
        if name in body:
            _check_number(body, name, low, high)
    for name, high in (("xtc_probability", 1), ("xtc_threshold", 0.5)):
        if name in body:
            _check_number(body, name, 0, high, as_float=True)
    for name, kind, description in (("stream", bool, "true or false"), ("model", str, "a string"),
                                    ("draft_model", str, "a string")):
        if name in body:
            _check_type(body, name, kind, description)
    if "adapters" in body:
        raise RequestError("'adapters' is not supported by this server")
    if "stream_options" in body:
        _check_type(body, "stream_options", dict, "an object")
        include = body["stream_options"].get("include_usage", False)
        if not isinstance(include, bool):
            raise RequestError("'stream_options.include_usage' must be true or false")
        body["stream_options"] = {"include_usage": include}
    if "logprobs" in body:
        logprobs = body["logprobs"]
        if endpoint == "text" and _is_int(logprobs) and 0 <= logprobs <= MAX_LEGACY_LOGPROBS:
            body["logprobs"] = logprobs > 0
            if logprobs > 0:
                body.setdefault("top_logprobs", logprobs)
        elif not isinstance(logprobs, bool):
            raise RequestError("'logprobs' must be true or false")
    if "stop" in body:
        _check_stop(body)
    if "logit_bias" in body:
        _check_logit_bias(body, limits)
    if "chat_template_kwargs" in body:
        _check_template_kwargs(body)
    if endpoint == "chat":
        _check_messages(body, limits)
        if "tools" in body:
            _check_tools(body)
        if "role_mapping" in body:
            mapping = body["role_mapping"]
            if not isinstance(mapping, dict) or not all(isinstance(v, str) for v in mapping.values()):
                raise RequestError("'role_mapping' must be an object of strings")
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise RequestError("'prompt' must be a non-empty string")
    return body
