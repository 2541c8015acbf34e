"""`veloxquant chat`: a multi-turn chat over one compressed cache that grows across turns.

Each turn renders the whole conversation with the model's chat template, keeps the
cache up to the longest prefix it shares with what the cache already holds (the
template may spell an earlier reply differently from the tokens generated), and
prefills only the rest. `/save FILE` and `/load FILE` write and read the cache with
mlx-lm's prompt-cache format; the conversation rides along in its metadata. Under mlx.launch
FILE is a folder: one checked file per rank and a manifest (`sharded_files.py`).
"""

from __future__ import annotations

import json
import re
import signal
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, List, Optional, TextIO

import mlx.core as mx
from mlx_lm import stream_generate
from mlx_lm.models.cache import CacheList, can_trim_prompt_cache, trim_prompt_cache

from .config import KVCacheConfig
from .integration import KVCacheBuilder, load_prompt_cache, save_prompt_cache
from .outputs import OutputError, check_out_file, replacing_file
from .sharded_files import load_sharded_prompt_cache, save_sharded_prompt_cache
from .sharding import model_sharding

HELP = ("commands: /save FILE (/save! FILE replaces one), /load FILE, /reset, /help, /quit (or end of input); "
        "Ctrl-C stops a reply, or at the prompt ends the chat")
COMMANDS = ("/save", "/save!", "/load", "/reset", "/help", "/quit", "/exit", "/q")
# A line whose first word is a slash and letters (a "!" may follow) is a command; anything else (a path, say) is a message.
COMMAND_WORD = re.compile(r"/[A-Za-z]+!?")


def cached_tokens_of(caches) -> int:
    """Tokens the caches hold: the first attention cache's offset (a hybrid model's first layer may be a
    linear-attention or state-space layer, whose `ArraysCache` counts none; a `CacheList` holds one)."""
    for cache in caches:
        if isinstance(cache, CacheList):
            held = cached_tokens_of(cache.caches)
            if held:
                return held
        elif isinstance(getattr(cache, "offset", None), int):
            return cache.offset
    return 0


def common_prefix(a: List[int], b: List[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class ChatSession:
    """One conversation: messages, the token ids the cache holds, and the cache."""

    def __init__(self, model, tokenizer, config: KVCacheConfig, system_prompt: Optional[str] = None,
                 template_kwargs: Optional[dict] = None, model_name: str = ""):
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.system_prompt, self.template_kwargs, self.model_name = system_prompt, template_kwargs or {}, model_name
        self.reset()

    def reset(self):
        self.messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        self.caches = KVCacheBuilder(self.config).for_model(self.model, self.tokenizer).build()
        self.cached_tokens: List[int] = []
        self.last = None  # the last turn's final GenerationResponse
        self.last_prefilled = 0

    def _render(self) -> List[int]:
        if self.tokenizer.chat_template is None:
            text = "".join(f"{m['role']}: {m['content']}\n" for m in self.messages) + "assistant:"
            return self.tokenizer.encode(text)
        return self.tokenizer.apply_chat_template(self.messages, add_generation_prompt=True, tokenize=True,
                                                  **self.template_kwargs)

    @property
    def cache_tokens(self) -> int:
        return cached_tokens_of(self.caches)

    def turn(self, user_text: str, max_tokens: int = 256, sampler=None,
             stop: Optional[Callable[[], bool]] = None) -> Iterator[str]:
        """Stream the reply to `user_text`, prefilling only what the cache does not hold. `stop()` true
        after a token ends the reply there; the conversation keeps the part shown."""
        self.messages.append({"role": "user", "content": user_text})
        tokens = self._render()
        keep = common_prefix(self.cached_tokens, tokens)
        if keep == len(tokens):  # generation needs at least one new token to feed
            keep -= 1
        if keep < self.cache_tokens and not can_trim_prompt_cache(self.caches):
            # A hybrid model's state caches (linear attention, SSM) cannot go back: prefill the whole conversation.
            self.caches, keep = KVCacheBuilder(self.config).for_model(self.model, self.tokenizer).build(), 0
        trim_prompt_cache(self.caches, self.cache_tokens - keep)
        self.last_prefilled = len(tokens) - keep
        reply, generated = [], []
        responses = stream_generate(self.model, self.tokenizer, tokens[keep:], max_tokens=max_tokens,
                                    sampler=sampler, prompt_cache=self.caches)
        for response in responses:
            generated.append(response.token)
            reply.append(response.text)
            self.last = response
            yield response.text
            if stop is not None and stop():
                break
        responses.close()
        # generate_step feeds a sampled token to the model only to sample the next one, so the cache
        # holds the prompt and every reply token but the last (all of them when stopped early).
        self.cached_tokens = (tokens + generated)[: self.cache_tokens]
        self.messages.append({"role": "assistant", "content": "".join(reply)})

    def stats(self) -> str:
        from .cli_shared import memory_report

        text = f"[cache: {memory_report(self.caches)}; prefilled {self.last_prefilled} new tokens"
        if self.last is not None:
            text += f"; {self.last.generation_tokens} tokens at {self.last.generation_tps:.1f} tok/s"
        return text + "]"

    def save(self, path: str, force: bool = False) -> Path:
        """Write the conversation and its cache to `path` (.safetensors appended if missing); returns
        the path written. An existing file is replaced only with `force`."""
        metadata = {"model": self.model_name, "messages": json.dumps(self.messages),
                    "tokens": json.dumps(self.cached_tokens), "veloxquant_config": self.config.to_json()}
        if model_sharding(self.model) is not None:  # under mlx.launch: a folder of rank files and a manifest
            out = Path(path).expanduser()
            try:
                save_sharded_prompt_cache(out, self.caches, self.model, metadata, force=force)
            except FileExistsError as error:
                raise OutputError(f"/save {error}") from None
            return out
        out = check_out_file(path, force, what="/save", suffix=".safetensors", append_suffix=True)
        with replacing_file(out, force) as temp:
            save_prompt_cache(temp, self.caches, metadata)
        return out

    def load(self, path: str):
        path = Path(path).expanduser()
        if model_sharding(self.model) is not None or path.is_dir():
            caches, metadata = load_sharded_prompt_cache(path, self.model, self.config)
        else:
            caches, metadata = load_prompt_cache(path, self.config, return_metadata=True, model=self.model)
        if "tokens" not in metadata or "messages" not in metadata:
            raise ValueError(f"{path} is a prompt cache but not a saved chat (no messages in its metadata)")
        if self.model_name and metadata.get("model") not in (None, "", self.model_name):
            raise ValueError(f"{path} was saved with model {metadata['model']!r}, not {self.model_name!r}")
        tokens = json.loads(metadata["tokens"])
        if len(tokens) != cached_tokens_of(caches):
            raise ValueError(f"{path}: {len(tokens)} token ids for a cache of {cached_tokens_of(caches)} tokens")
        self.caches, self.cached_tokens = caches, tokens
        self.messages = json.loads(metadata["messages"])
        self.last = None


class ReplyInterrupt:
    """While active, Ctrl-C (SIGINT) asks the reply to stop after its current token instead of raising
    KeyboardInterrupt wherever Python happens to be, which could leave the cache's layers out of step.
    A second Ctrl-C before the reply stops raises KeyboardInterrupt as usual."""

    def __init__(self):
        self.requested = False

    def __call__(self) -> bool:
        return self.requested

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    @contextmanager
    def active(self):
        self.requested = False
        if threading.current_thread() is not threading.main_thread():
            yield self  # signal handlers can only be set from the main thread
            return
        previous = signal.signal(signal.SIGINT, self._handle)
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, previous)


def run_chat(session: ChatSession, max_tokens: int, sampler, stdin: Optional[TextIO] = None,
             stdout: Optional[TextIO] = None) -> int:
    """The read-reply loop; reads lines from `stdin` (a terminal or a script). Returns the turns run.
    Ctrl-C during a reply stops it and returns to the prompt; at the prompt it ends the chat."""
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    interactive = stdin.isatty()
    print(f"chat with {session.model_name} ({session.config.describe()}); {HELP}", file=stdout)
    interrupt = ReplyInterrupt()
    turns = 0
    while True:
        if interactive:
            print(">> ", end="", flush=True, file=stdout)
        try:
            line = stdin.readline()
        except KeyboardInterrupt:
            print(file=stdout)
            break
        if not line:
            break
        line = line.rstrip("\n")
        if not line.strip():
            continue
        command, _, argument = line.strip().partition(" ")
        if COMMAND_WORD.fullmatch(command) and command not in COMMANDS:
            print(f"error: unknown command {command}; {HELP}", file=stdout)
            continue
        if command in ("/quit", "/exit", "/q"):
            break
        if command == "/help":
            print(HELP, file=stdout)
            continue
        if command == "/reset":
            session.reset()
            print("[conversation cleared]", file=stdout)
            continue
        if command in ("/save", "/save!", "/load"):
            if not argument.strip():
                print(f"error: {command} needs a file name", file=stdout)
                continue
            try:
                if command == "/load":
                    session.load(argument.strip())
                    where = argument.strip()
                else:
                    where = session.save(argument.strip(), force=command == "/save!")
            except (ValueError, OSError) as error:
                hint = "; /save! FILE replaces it" if command == "/save" and "--force" in str(error) else ""
                print(f"error: {str(error).replace('; pass --force to replace it', '')}{hint}", file=stdout)
                continue
            verb = "loaded from" if command == "/load" else "saved to"
            print(f"[{session.cache_tokens} tokens, {len(session.messages)} messages {verb} {where}]", file=stdout)
            continue
        if not interactive:
            print(f">> {line}", file=stdout)
        start = time.perf_counter()
        with interrupt.active():
            for text in session.turn(line, max_tokens=max_tokens, sampler=sampler, stop=interrupt):
                print(text, end="", flush=True, file=stdout)
            mx.eval([c.state for c in session.caches])
        print(file=stdout)
        stopped = ", stopped by Ctrl-C" if interrupt.requested else ""
        print(session.stats() + f" ({time.perf_counter() - start:.1f} s{stopped})", file=stdout, flush=True)
        turns += 1
    return turns
