"""Compressed prompt-cache files: `veloxquant cache-prompt` and `generate --prompt-cache-file`.

The same conventions as mlx-lm's `cache_prompt` / `generate --prompt-cache-file`: with a
chat template the document is cached as an unfinished user message, and a later question
is appended to that message (the part of the templated prompt from the question on), so
the model reads "document + question" without prefilling the document again. The file
is mlx-lm's prompt-cache format (safetensors) holding codes, not dequantized values.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import mlx.core as mx
import mlx_lm.models.cache as mlx_cache
from mlx_lm.generate import generation_stream

from .cache import CacheFormatError, CompressedKVCache
from .config import KVCacheConfig
from .integration import KVCacheBuilder, load_prompt_cache, save_prompt_cache
from .rotating import CompressedRotatingKVCache
from .sharded_files import load_sharded_prompt_cache, save_sharded_prompt_cache
from .sharding import model_sharding

QUERY_MARK = "<query>"


def document_tokens(tokenizer, text: str) -> List[int]:
    """The document as mlx-lm's cache_prompt feeds it: an unfinished user message, or plain text."""
    if tokenizer.chat_template is not None:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=False,
                                             continue_final_message=True)
    return tokenizer.encode(text)


def prefill(model, caches, tokens: List[int], step: int = 512,
            progress: Optional[Callable[[int, int], None]] = None):
    """Run `tokens` through the model into `caches`, `step` tokens at a time, on mlx-lm's generation
    stream as its `generate_step` does. On a sharded model the output is evaluated too: a cache may hold
    arrays its `state` leaves unevaluated whose graph holds collectives, and evaluated later beside other
    collectives the ranks can pair them differently (summing the wrong tensors, or waiting for ever)."""
    sharded = model_sharding(model) is not None
    with mx.stream(generation_stream):
        for start in range(0, len(tokens), step):
            out = model(mx.array([tokens[start : start + step]]), cache=caches)
            mx.eval([c.state for c in caches], out if sharded else [])
            if progress is not None:
                progress(min(start + step, len(tokens)), len(tokens))


def cache_prompt(model, tokenizer, text: str, config: KVCacheConfig, out, model_name: str,
                 step: int = 512, progress=None, for_mlx_lm: Optional[str] = None) -> dict:
    """Write the compressed cache of `text` to `out`; returns what was written. `for_mlx_lm`
    (the model path mlx-lm's CLI is to load): write `for_mlx_lm_caches` of it instead, in
    mlx-lm's own format and metadata."""
    tokens = document_tokens(tokenizer, text)
    caches = KVCacheBuilder(config).for_model(model, tokenizer).build()
    start = time.perf_counter()
    prefill(model, caches, tokens, step, progress)
    seconds = time.perf_counter() - start
    if for_mlx_lm is not None:
        mlx_cache.save_prompt_cache(str(out), for_mlx_lm_caches(caches),
                                    {"model": for_mlx_lm, "tokenizer_config": "{}"})
    else:
        metadata = {"model": model_name, "veloxquant_config": config.to_json(), "tokens": str(len(tokens)),
                    "chat_template": str(tokenizer.chat_template is not None)}
        if model_sharding(model) is not None:
            save_sharded_prompt_cache(out, caches, model, metadata)
        else:
            save_prompt_cache(out, caches, metadata)
    return {"tokens": len(tokens), "seconds": seconds, "caches": caches}


def for_mlx_lm_caches(caches) -> list:
    """mlx-lm's own `KVCache`s holding the keys and values the compressed `caches` decode to,
    for tools that never import this library (`python -m mlx_lm generate --prompt-cache-file`).
    This gives up the compression: the file and the memory are those of an fp16 cache, only
    the values are the compressed ones."""
    out = []
    for cache in caches:
        if isinstance(cache, CompressedRotatingKVCache):
            raise ValueError("a sliding-window layer's compressed cache has no mlx-lm KVCache equivalent; "
                             "write the compressed file instead")
        if not isinstance(cache, CompressedKVCache):
            out.append(cache)  # a layer left to mlx-lm's own cache
            continue
        plain = mlx_cache.KVCache()
        if cache.offset:
            keys, values = cache.dequantized()
            dtype = cache.window_dtype
            plain.state = (keys.astype(dtype), values.astype(dtype), cache.offset)
        out.append(plain)
    return out


def question_suffix(tokenizer, question: str, system_prompt: Optional[str] = None,
                    template_kwargs: Optional[dict] = None) -> List[int]:
    """The tokens that follow a cached document for `question` (mlx-lm's generate does the same)."""
    if tokenizer.chat_template is None:
        return tokenizer.encode(question, add_special_tokens=False)
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    full = tokenizer.apply_chat_template(messages + [{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True, **(template_kwargs or {}))
    probe = tokenizer.apply_chat_template(messages + [{"role": "user", "content": QUERY_MARK}], tokenize=False,
                                          add_generation_prompt=True, **(template_kwargs or {}))
    return tokenizer.encode(full[probe.index(QUERY_MARK):], add_special_tokens=False)


def load_document_cache(path, model_name: Optional[str] = None,
                        config: Optional[KVCacheConfig] = None, model=None) -> Tuple[list, dict]:
    """(caches, metadata) of a `cache_prompt` file, refusing one made for another model (by
    name, and with `model` by its arguments and weights) or config."""
    if model is not None and Path(path).is_dir():  # one file per rank and a manifest (`sharded_files.py`)
        caches, metadata = load_sharded_prompt_cache(path, model, config)
    else:
        caches, metadata = load_prompt_cache(path, config, return_metadata=True, model=model)
    if model_name is not None and metadata.get("model") not in (None, "", model_name):
        raise ValueError(f"{path} was cached with model {metadata['model']!r}, not {model_name!r}")
    if not caches or not isinstance(caches[0], (CompressedKVCache, CompressedRotatingKVCache)):
        kind = type(caches[0]).__name__ if caches else "no layer"
        raise CacheFormatError(f"{path} holds mlx-lm's own caches ({kind}), not a compressed one: use it with "
                               "mlx-lm (python -m mlx_lm generate --prompt-cache-file), or write one with "
                               "veloxquant cache-prompt")
    return caches, metadata


class FreshPromptCache(mlx_cache.LRUPromptCache):
    """mlx-lm's prompt-cache pool (`mlx_lm.server`), whose reused caches hold what a fresh prefill of
    the same tokens would.

    A pooled cache trimmed into its codes keeps as codes the tokens a fresh cache holds in its fp16
    window, and a refill (trim back to a code boundary a window before the prefix's end,
    `CompressedKVCache.refill_span`, and feed those tokens again) encodes them once more from a chunk
    of another length, whose float noise can move a code. So the pool keeps the server's segment snapshots
    (the end of a system prompt) that mlx-lm's pool drops as prefixes of a longer trimmable cache, and
    where the nearest cache would need a refill, an entry that is a prefix of the prompt is taken
    instead, as it was stored: the prompt then continues from exactly the cache an earlier prefill of
    that prefix made. Only without one is the nearest cache trimmed and refilled. A cache whose
    centring means a fresh prefill would not compute (`fresh_means`: uncapped means, or capped ones
    from tokens past the shared prefix or past the fresh prefill's first chunk) is not reused: the
    prompt is prefilled afresh. `first_chunk` is that chunk's length for the next fetch (the server
    sets it from its segments; None: every token but the last, as mlx-lm's generate prefills)."""

    first_chunk = None

    def insert_cache(self, model, tokens: List[int], prompt_cache: List, *, cache_type: str = "assistant"):
        # mlx-lm's batch caches extract a sequence as lazy slices of the whole batch's buffers (ours extract
        # independent rows): pooled unevaluated, each entry would hold the batch as it was when extracted.
        mx.async_eval([c.state for c in prompt_cache if type(c).__module__.startswith("mlx_lm.")])
        if not any(hasattr(c, "refill_span") for c in prompt_cache):
            return super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)
        self._trie.pop_prefixes = self._pop_superseded
        try:
            return super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)
        finally:
            del self._trie.pop_prefixes

    def _pop_superseded(self, model, tokens: List[int]):
        """mlx-lm's `pop_prefixes` (the entries on `tokens`' path, which this insert makes redundant for a
        cache that trims exactly), less the server's segment snapshots (cache types other than "assistant":
        the end of a system prompt, or of the context before a thinking tail), which are kept (see the class)."""
        popped, node = [], self._trie._trie[model]
        for length, token in enumerate(tokens):
            entry = node.get("__value__")
            if entry is not None and entry.cache_type == "assistant":
                popped.append((length, node.pop("__value__")))
            node = node[token]
        return popped

    def fetch_nearest_cache(self, model, tokens: List[int]):
        first_chunk, self.first_chunk = self.first_chunk, None
        cache, rest = super().fetch_nearest_cache(model, tokens)
        held = len(tokens) - len(rest)
        if cache is None or not held:
            return cache, rest
        back = min(held, max((c.refill_span() for c in cache if hasattr(c, "refill_span")), default=0))
        if back:
            prefix = self._trie.search(model, tokens).shorter
            if prefix:
                cache, held, back = copy.deepcopy(self._trie.get(model, prefix).prompt_cache), len(prefix), 0
                rest = tokens[held:]
        if back:
            mlx_cache.trim_prompt_cache(cache, back)
            rest = tokens[held - back:]
        first_chunk = len(tokens) - 1 if first_chunk is None else first_chunk
        if not all(_fresh_means(c, first_chunk) for c in cache):
            return None, tokens
        return cache, rest


def _fresh_means(cache, first_chunk: int) -> bool:
    """Whether a layer's cache has the centring means a fresh prefill with this first chunk computes; a
    centred cache that cannot tell (the MLA latent cache) is taken as not."""
    if hasattr(cache, "fresh_means"):
        return cache.fresh_means(first_chunk)
    if isinstance(cache, mlx_cache.CacheList):  # a hybrid layer's attention and state caches
        return all(_fresh_means(c, first_chunk) for c in cache.caches)
    config = getattr(cache, "config", None)
    return not (config is not None and getattr(config, "center", False))
