"""Compressed prompt-cache files: `veloxquant cache-prompt` and `generate --prompt-cache-file`.

The same conventions as mlx-lm's `cache_prompt` / `generate --prompt-cache-file`: with a
chat template the document is cached as an unfinished user message, and a later question
is appended to that message (the part of the templated prompt from the question on), so
the model reads "document + question" without prefilling the document again. The file
is mlx-lm's prompt-cache format (safetensors) holding codes, not dequantized values.
"""

from __future__ import annotations

import time
from typing import Callable, List, Optional, Tuple

import mlx.core as mx

from .config import KVCacheConfig
from .integration import KVCacheBuilder, load_prompt_cache, save_prompt_cache

QUERY_MARK = "<query>"


def document_tokens(tokenizer, text: str) -> List[int]:
    """The document as mlx-lm's cache_prompt feeds it: an unfinished user message, or plain text."""
    if tokenizer.chat_template is not None:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=False,
                                             continue_final_message=True)
    return tokenizer.encode(text)


def prefill(model, caches, tokens: List[int], step: int = 512,
            progress: Optional[Callable[[int, int], None]] = None):
    """Run `tokens` through the model into `caches`, `step` tokens at a time."""
    for start in range(0, len(tokens), step):
        model(mx.array([tokens[start : start + step]]), cache=caches)
        mx.eval([c.state for c in caches])
        if progress is not None:
            progress(min(start + step, len(tokens)), len(tokens))


def cache_prompt(model, tokenizer, text: str, config: KVCacheConfig, out, model_name: str,
                 step: int = 512, progress=None) -> dict:
    """Write the compressed cache of `text` to `out`; returns what was written."""
    tokens = document_tokens(tokenizer, text)
    caches = KVCacheBuilder(config).for_model(model, tokenizer).build()
    start = time.perf_counter()
    prefill(model, caches, tokens, step, progress)
    seconds = time.perf_counter() - start
    metadata = {"model": model_name, "veloxquant_config": config.to_json(), "tokens": str(len(tokens)),
                "chat_template": str(tokenizer.chat_template is not None)}
    save_prompt_cache(out, caches, metadata)
    return {"tokens": len(tokens), "seconds": seconds, "caches": caches}


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
                        config: Optional[KVCacheConfig] = None) -> Tuple[list, dict]:
    """(caches, metadata) of a `cache_prompt` file, refusing one made for another model or config."""
    caches, metadata = load_prompt_cache(path, config, return_metadata=True)
    if model_name is not None and metadata.get("model") not in (None, "", model_name):
        raise ValueError(f"{path} was cached with model {metadata['model']!r}, not {model_name!r}")
    return caches, metadata
