"""Host and total time of one decode step of a whole model, fp16 cache vs ours.

    python benchmarks/decode_profile.py [--shape llama-3.1-8b] [--context 4096] [--steps 16]

Prefills `--context` random tokens, then times `--steps` decode steps of the whole
model: host = building the step's graph (the model call, no evaluation); total = the
step evaluated alone (no overlap with the next step). The difference between ours and
fp16 in host time is what our cache's Python and ops add per token; `generate_step`
overlaps host and device work, so a host-bound loop runs at about max(host, device).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from veloxquant_mlx.evaluation.shapes import build_shape_model  # noqa: E402
from veloxquant_mlx.evaluation.specs import parse_method_spec  # noqa: E402


def prefilled_caches(model, spec: str, context: int, vocab: int, batch: int = 1) -> list:
    """The caches of `spec` for `model` after `batch` prompts of `context` random tokens (2048 at a time)."""
    caches = parse_method_spec(spec).make_caches(model)
    tokens = mx.random.randint(0, vocab, (batch, context), key=mx.random.key(0))
    for start in range(0, context, 2048):
        model(tokens[:, start:start + 2048], cache=caches)
        mx.eval([c.state for c in caches])
    return caches


def profile(model, spec: str, context: int, steps: int, vocab: int):
    caches = prefilled_caches(model, spec, context, vocab)
    y = mx.array([[1]])
    host, total = [], []
    for _ in range(steps + 2):
        start = time.perf_counter()
        logits = model(y, cache=caches)
        host.append(time.perf_counter() - start)
        mx.eval(logits)
        mx.synchronize()
        total.append(time.perf_counter() - start)
    return statistics.median(host[2:]) * 1e3, statistics.median(total[2:]) * 1e3


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--methods", default="fp16,turboquant_mse:3:vbits=4")
    args = parser.parse_args()
    model = build_shape_model(args.shape, dtype="float16", weights_bits=4)
    vocab = model.args.vocab_size
    for spec in args.methods.split(","):
        host, total = profile(model, spec, args.context, args.steps, vocab)
        print(f"{spec:<28} context {args.context}: host {host:.2f} ms, step alone {total:.2f} ms per token")


if __name__ == "__main__":
    main()
