"""Perplexity and divergence from fp16 with the KV cache under test.

Each window of `ctx` tokens is fed in chunks of `chunk` tokens, so later chunks
attend to the compressed history; only the second half of each window is
scored (as llama.cpp's perplexity tool does), so every scored token sees at
least ctx/2 tokens of context. Windows run one after another and, within a
window, fp16 first: its log-probabilities are the reference for KL and top-1
agreement, and only one window of them is held at a time.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import mlx.core as mx

from ..footprint import Footprint, footprint
from .results import error_text, finite, kv_fields
from .specs import MethodSpec, with_fp16_first
from .watchdog import STOPPED_BY_GUARD, MemoryGuard, MemoryGuardTriggered, release_memory


@dataclass
class WindowScore:
    nll: mx.array  # (scored,)
    kl: mx.array  # (scored,) KL(fp16 || method)
    agree: mx.array  # (scored,) bool, same argmax as fp16
    logprobs: Optional[mx.array]  # (scored, vocab), kept for the fp16 reference only
    kv: Footprint
    kv_dtype: Optional[str] = None


def score_window(
    model,
    caches: list,
    window: mx.array,
    chunk: int,
    reference: Optional[mx.array] = None,
    keep_logprobs: bool = False,
    on_chunk: Optional[Callable[[], None]] = None,
) -> WindowScore:
    """Run `window` (ctx,) through `caches` chunk by chunk and score its second half.

    `reference` holds the fp16 log-probabilities of the scored positions; without
    it the method is compared with itself (KL 0, full agreement).
    """
    ctx = window.shape[0]
    first = ctx // 2
    nll, kl, agree, kept = [], [], [], []
    for start in range(0, ctx, chunk):
        if on_chunk is not None:
            on_chunk()
        tokens = window[start : start + chunk]
        logits = model(tokens[None], cache=caches)[0]
        lo, hi = max(first, start), min(ctx - 1, start + tokens.shape[0])
        if lo >= hi:
            mx.eval(logits)
            continue
        logits = logits[lo - start : hi - start].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        targets = window[lo + 1 : hi + 1]
        step_nll = -mx.take_along_axis(logprobs, targets[:, None], axis=-1)[:, 0]
        ref = logprobs if reference is None else reference[lo - first : hi - first]
        step_kl = mx.sum(mx.exp(ref) * (ref - logprobs), axis=-1)
        step_agree = mx.argmax(logprobs, axis=-1) == mx.argmax(ref, axis=-1)
        mx.eval(step_nll, step_kl, step_agree, logprobs if keep_logprobs else step_nll)
        nll.append(step_nll)
        kl.append(step_kl)
        agree.append(step_agree)
        if keep_logprobs:
            kept.append(logprobs)
    kv_dtype = None
    keys = getattr(caches[0], "keys", None) if caches else None
    if isinstance(keys, mx.array):
        kv_dtype = str(keys.dtype).split(".")[-1]
    elif isinstance(keys, (tuple, list)) and keys and isinstance(keys[-1], mx.array):
        kv_dtype = "quantized/" + str(keys[-1].dtype).split(".")[-1]  # scales' dtype
    return WindowScore(
        nll=mx.concatenate(nll),
        kl=mx.concatenate(kl),
        agree=mx.concatenate(agree),
        logprobs=mx.concatenate(kept) if keep_logprobs else None,
        kv=footprint(caches),
        kv_dtype=kv_dtype,
    )


def quantile(x: mx.array, q: float) -> float:
    """Linear-interpolated quantile (numpy's default)."""
    x = mx.sort(x.astype(mx.float32).flatten())
    n = x.shape[0]
    position = q * (n - 1)
    lo = int(math.floor(position))
    hi = min(lo + 1, n - 1)
    weight = position - lo
    return float(x[lo].item() * (1 - weight) + x[hi].item() * weight)


@dataclass
class MethodTally:
    spec: MethodSpec
    status: str = "ok"
    error: Optional[str] = None
    nll: List[mx.array] = field(default_factory=list)
    kl: List[mx.array] = field(default_factory=list)
    agree: List[mx.array] = field(default_factory=list)
    kv: Optional[Footprint] = None
    kv_dtype: Optional[str] = None
    seconds: float = 0.0
    has_reference: bool = True

    @property
    def running(self) -> bool:
        return self.status == "ok"

    def record(self) -> Dict:
        record = {**self.spec.describe(), "status": self.status, "error": self.error}
        record["windows_completed"] = len(self.nll)
        record["seconds"] = round(self.seconds, 3)
        if not self.nll:
            return record
        nll = mx.concatenate(self.nll)
        kl = mx.concatenate(self.kl)
        agree = mx.concatenate(self.agree)
        mean_nll = mx.mean(nll).item()
        std = mx.sqrt(mx.var(nll, ddof=1)).item() if nll.shape[0] > 1 else 0.0
        ppl = math.exp(mean_nll)
        record.update(
            perplexity=finite(ppl),
            # delta method, as mlx_lm.perplexity reports it
            perplexity_stderr=finite(ppl * std / math.sqrt(nll.shape[0])),
            mean_nll=finite(mean_nll),
            scored_tokens=int(nll.shape[0]),
            kl_mean=finite(mx.mean(kl).item()) if self.has_reference else None,
            kl_p99=finite(quantile(kl, 0.99)) if self.has_reference else None,
            top1_agreement=finite(mx.mean(agree.astype(mx.float32)).item()) if self.has_reference else None,
            kv_dtype=self.kv_dtype,
            **kv_fields(self.kv),
        )
        return record


def make_windows(token_ids: List[int], ctx: int, windows: int) -> mx.array:
    if ctx < 4 or ctx % 2:
        raise ValueError(f"--ctx must be an even number >= 4, got {ctx}")
    needed = ctx * windows
    if len(token_ids) < needed:
        raise ValueError(f"{windows} windows of {ctx} tokens need {needed} tokens, the text has {len(token_ids)}")
    return mx.array(token_ids[:needed], dtype=mx.uint32).reshape(windows, ctx)


def evaluate_perplexity(
    model,
    windows: mx.array,
    specs: List[MethodSpec],
    chunk: int = 512,
    guard: Optional[MemoryGuard] = None,
    progress: bool = True,
    on_update: Optional[Callable[[List[Dict]], None]] = None,
) -> List[Dict]:
    """One record per spec (fp16 first); `on_update(records)` after every window of every method."""
    from tqdm.auto import tqdm

    if chunk < 1:
        raise ValueError(f"--chunk must be >= 1, got {chunk}")
    guard = guard or MemoryGuard(0)
    specs = with_fp16_first(specs)
    tallies = [MethodTally(spec) for spec in specs]
    n_windows, ctx = windows.shape
    chunks = -(-ctx // chunk)
    bar = tqdm(total=n_windows * len(specs) * chunks, desc="ppl", unit="chunk", disable=not progress)
    for w in range(n_windows):
        reference = None
        for tally in tallies:
            if not tally.running:
                bar.update(chunks)
                continue
            bar.set_postfix_str(f"window {w + 1}/{n_windows} {tally.spec.label}")
            is_reference = tally.spec.label == "fp16"
            if not is_reference and reference is None:
                tally.has_reference = False

            def on_chunk():
                guard.check(f"{tally.spec.label}, window {w + 1}")
                bar.update(1)

            caches = None
            start = time.perf_counter()
            try:
                caches = tally.spec.make_caches(model, prefill_rule="decode")  # each token scored as decoding sees it
                score = score_window(
                    model, caches, windows[w], chunk,
                    reference=reference, keep_logprobs=is_reference, on_chunk=on_chunk,
                )
            except MemoryGuardTriggered as error:
                tally.status, tally.error = STOPPED_BY_GUARD, str(error)
            except Exception as error:  # a failing method must not end the sweep
                tally.status, tally.error = "error", error_text(error)
            else:
                tally.nll.append(score.nll)
                tally.kl.append(score.kl)
                tally.agree.append(score.agree)
                tally.kv, tally.kv_dtype = score.kv, score.kv_dtype
                if is_reference:
                    reference = score.logprobs
                del score
            finally:
                tally.seconds += time.perf_counter() - start
                del caches
            if not tally.running:
                release_memory()
            if on_update is not None:
                on_update([t.record() for t in tallies])
        del reference
        release_memory()
    bar.close()
    return [t.record() for t in tallies]
