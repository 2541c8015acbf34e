"""Needle in a haystack: hide a passcode in long filler text and ask for it back.

The prompt is the filler with "The secret passcode is NNNN." inserted at a sentence
boundary near `depth` (0 = start, 1 = end), then a question, through the chat
template, followed by the start of the answer ("The secret passcode is") so that
even small models answer with the number. Greedy decoding; correct when the
generated text contains the passcode.
"""

from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import mlx.core as mx

from ..footprint import footprint
from .results import error_text, kv_fields
from .specs import MethodSpec
from .watchdog import STOPPED_BY_GUARD, MemoryGuard, MemoryGuardTriggered, release_memory

NEEDLE = "The secret passcode is {code}."
QUESTION = "What is the secret passcode mentioned in the text above? Answer with the number only."
ANSWER_PREFIX = "The secret passcode is"


def parse_lengths(text: str) -> List[int]:
    """'1k,2k,4k,500' -> [1024, 2048, 4096, 500]."""
    lengths = []
    for item in text.split(","):
        item = item.strip().lower()
        if not item:
            continue
        try:
            value = float(item[:-1]) * 1024 if item.endswith("k") else float(item)
        except ValueError:
            raise ValueError(f"bad length {item!r}: use tokens like 512, 1k, 32k") from None
        if value < 1:
            raise ValueError(f"length must be positive, got {item!r}")
        lengths.append(int(value))
    if not lengths:
        raise ValueError("no lengths given")
    return lengths


def parse_depths(text: str) -> List[float]:
    depths = []
    for item in text.split(","):
        if item.strip():
            try:
                depth = float(item)
            except ValueError:
                raise ValueError(f"bad depth {item!r}: use fractions between 0 and 1") from None
            if not 0.0 <= depth <= 1.0:
                raise ValueError(f"depth must be between 0 and 1, got {depth}")
            depths.append(depth)
    if not depths:
        raise ValueError("no depths given")
    return depths


def passcode(seed: int, length: int, depth: float, trial: int) -> str:
    return str(random.Random(f"{seed}:{length}:{depth}:{trial}").randint(1000, 9999))


def _sentence_boundary(text: str, position: int) -> int:
    """The end of a sentence nearest to `position` (or `position` when there is none)."""
    if position <= 0 or position >= len(text):
        return max(0, min(position, len(text)))
    ends = [m.end() for m in re.finditer(r"[.!?]\s", text)]
    if not ends:
        return position
    return min(ends, key=lambda end: abs(end - position))


def _prompt(tokenizer, haystack: str) -> str:
    content = f"{haystack}\n\n{QUESTION}"
    if getattr(tokenizer, "chat_template", None) is not None:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
    else:
        prompt = f"{content}\n\n"
    return prompt + ANSWER_PREFIX


def build_prompt(tokenizer, filler_ids: List[int], length: int, depth: float, code: str) -> List[int]:
    """Prompt tokens of about `length` tokens with the needle at `depth` of the filler."""
    needle = NEEDLE.format(code=code)
    overhead = len(_encode(tokenizer, _prompt(tokenizer, " " + needle + " ")))
    budget = length - overhead
    if budget < 1:
        raise ValueError(f"length {length} is too short: the question alone takes {overhead} tokens")
    if budget > len(filler_ids):
        raise ValueError(f"length {length} needs {budget} filler tokens, the text has {len(filler_ids)}")
    filler = tokenizer.decode(filler_ids[:budget])
    cut = _sentence_boundary(filler, round(depth * len(filler)))
    haystack = filler[:cut].rstrip() + " " + needle + " " + filler[cut:].lstrip()
    return _encode(tokenizer, _prompt(tokenizer, haystack.strip()))


def _encode(tokenizer, prompt: str) -> List[int]:
    # the chat template already holds any BOS it wants
    return tokenizer.encode(prompt, add_special_tokens=False)


@dataclass
class NeedleCase:
    length: int
    depth: float
    trial: int
    code: str
    prompt: List[int]


def make_cases(tokenizer, filler_ids, lengths, depths, trials: int, seed: int) -> List[NeedleCase]:
    cases = []
    for length in lengths:
        for depth in depths:
            for trial in range(trials):
                code = passcode(seed, length, depth, trial)
                cases.append(NeedleCase(length, depth, trial, code,
                                        build_prompt(tokenizer, filler_ids, length, depth, code)))
    return cases


def answer(model, tokenizer, caches, prompt: List[int], max_tokens: int, chunk: int,
           on_step: Optional[Callable[[], None]] = None) -> str:
    """Greedy answer to `prompt` with `caches` as mlx-lm's prompt cache."""
    from mlx_lm import stream_generate

    def progress(processed, total):
        if on_step is not None:
            on_step()

    text = ""
    for response in stream_generate(
        model, tokenizer, mx.array(prompt), max_tokens=max_tokens, prompt_cache=caches,
        prefill_step_size=chunk, prompt_progress_callback=progress,
    ):
        text += response.text
        if on_step is not None:
            on_step()
    return text


def is_correct(text: str, code: str) -> bool:
    return code in re.findall(r"\d+", text)


def run_case(model, tokenizer, spec: MethodSpec, case: NeedleCase, max_tokens: int, chunk: int,
             guard: MemoryGuard) -> Dict:
    result = {"length": case.length, "depth": case.depth, "trial": case.trial,
              "prompt_tokens": len(case.prompt), "passcode": case.code}
    caches = None
    start = time.perf_counter()
    try:
        caches = spec.make_caches(model)
        text = answer(model, tokenizer, caches, case.prompt, max_tokens, chunk,
                      on_step=lambda: guard.check(f"{spec.label}, {case.length} tokens"))
        result.update(status="ok", answer=text, correct=is_correct(text, case.code), **kv_fields(footprint(caches)))
    except MemoryGuardTriggered as error:
        result.update(status=STOPPED_BY_GUARD, error=str(error), correct=None)
    except Exception as error:
        result.update(status="error", error=error_text(error), correct=None)
    finally:
        del caches
        result["seconds"] = round(time.perf_counter() - start, 3)
    if result["status"] != "ok":
        release_memory()
    return result


def summarize(spec: MethodSpec, cells: List[Dict], lengths: List[int], depths: List[float]) -> Dict:
    record = {**spec.describe(), "cells": cells}
    scored = [c for c in cells if c.get("correct") is not None]
    statuses = {c["status"] for c in cells}
    record["status"] = "ok" if statuses <= {"ok"} else (
        STOPPED_BY_GUARD if STOPPED_BY_GUARD in statuses else "error")
    errors = sorted({c["error"] for c in cells if c.get("error")})
    record["error"] = "; ".join(errors) if errors else None
    record["accuracy"] = sum(c["correct"] for c in scored) / len(scored) if scored else None
    record["scored_cases"] = len(scored)
    grid = []
    for depth in depths:
        row = []
        for length in lengths:
            hits = [c["correct"] for c in scored if c["length"] == length and c["depth"] == depth]
            row.append(sum(hits) / len(hits) if hits else None)
        grid.append(row)
    record["grid"] = {"depths": depths, "lengths": lengths, "accuracy": grid}
    kv = [c for c in scored if c.get("kv_bytes")]
    if kv:
        longest = max(kv, key=lambda c: c["kv_tokens"])
        record.update({key: longest[key] for key in ("kv_bytes", "kv_allocated_bytes", "kv_tokens", "fp16_kv_bytes",
                                                     "bits_per_coord", "compression_vs_fp16")})
    return record


def evaluate_needle(model, tokenizer, specs: List[MethodSpec], cases: List[NeedleCase], lengths, depths,
                    max_tokens: int = 12, chunk: int = 2048,
                    guard: Optional[MemoryGuard] = None, progress: bool = True,
                    on_update: Optional[Callable[[List[Dict]], None]] = None) -> List[Dict]:
    """One record per spec with its accuracy grid. Cases run shortest first; after a
    method is stopped by the memory guard, its longer cases are skipped."""
    from tqdm.auto import tqdm

    guard = guard or MemoryGuard(0)
    records: List[Dict] = []
    bar = tqdm(total=len(specs) * len(cases), desc="needle", unit="case", disable=not progress)
    for spec in specs:
        cells: List[Dict] = []
        stopped_at = None
        for case in sorted(cases, key=lambda c: c.length):
            bar.set_postfix_str(f"{spec.label} {case.length} tok depth {case.depth:g}")
            if stopped_at is not None and case.length >= stopped_at:
                cells.append({"length": case.length, "depth": case.depth, "trial": case.trial,
                              "prompt_tokens": len(case.prompt), "passcode": case.code,
                              "status": "skipped", "correct": None,
                              "error": f"skipped after the memory guard stopped {stopped_at} tokens"})
            else:
                cell = run_case(model, tokenizer, spec, case, max_tokens, chunk, guard)
                if cell["status"] == STOPPED_BY_GUARD:
                    stopped_at = case.length
                cells.append(cell)
            bar.update(1)
            if on_update is not None:
                on_update(records + [summarize(spec, cells, lengths, depths)])
        records.append(summarize(spec, cells, lengths, depths))
    bar.close()
    return records
