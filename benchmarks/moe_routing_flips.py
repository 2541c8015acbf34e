"""How much of a random MoE model's KL in the architecture matrix comes from its router?

The matrix (`veloxquant models`) compares the logits of the library's caches with mlx-lm's caches on a tiny
random model. In an MoE layer a tiny change of the keys can flip which experts a token goes to, a
discontinuity of the model, not of the cache. This script runs `laguna` (the one file over its KL threshold)
as the matrix does, recording mlx-lm's expert choices; then runs each spec twice, routing freely and with the
recorded choices replayed (the weights recomputed from the run's own router scores), and writes the KL, the
share of routings that flipped and the per-step KL.

    PYTHONPATH=. python benchmarks/moe_routing_flips.py --out benchmarks/results/models-matrix-laguna-routing
"""

from __future__ import annotations

import argparse
import json
import os

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models import laguna

from veloxquant_mlx.evaluation import models_matrix
from veloxquant_mlx.evaluation.specs import parse_method_spec


class RouterLog:
    """Wraps laguna's gate: records its choices, or replays the recorded ones and counts flips."""

    def __init__(self):
        self.mode, self.choices, self.at, self.flipped, self.routed = "free", [], 0, 0, 0
        self.original = laguna.MoEGate.__call__

    def gate(self, module, x):
        indices, weights = self.original(module, x)
        if self.mode == "record":
            mx.eval(indices)
            self.choices.append(indices)
        elif self.mode in ("count", "replay"):
            recorded = self.choices[self.at]
            self.at += 1
            differs = mx.any(mx.sort(indices, axis=-1) != mx.sort(recorded, axis=-1), axis=-1)
            self.flipped += int(differs.sum().item())
            self.routed += differs.size
            if self.mode == "replay":
                logits = module.proj(x).astype(mx.float32)
                if module.softcap > 0.0:
                    logits = mx.tanh(logits / module.softcap) * module.softcap
                scores = mx.take_along_axis(module._routing_scores(logits), recorded, axis=-1)
                indices, weights = recorded, scores / scores.sum(axis=-1, keepdims=True)
        return indices, weights


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", type=int, default=300)
    parser.add_argument("--decode", type=int, default=20)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    log = RouterLog()
    laguna.MoEGate.__call__ = lambda module, x: log.gate(module, x)
    model, _ = models_matrix.build_model("laguna")
    tokens = mx.random.randint(0, 512, (args.prefill + args.decode,), key=mx.random.key(1))
    log.mode = "record"
    reference = models_matrix.run_caches(model, mlx_cache.make_prompt_cache(model), tokens, args.prefill)
    records = []
    for spec in ("vq4", "kivi:4"):
        for mode in ("count", "replay"):
            log.mode, log.at, log.flipped, log.routed = mode, 0, 0, 0
            out = models_matrix.run_caches(model, parse_method_spec(spec).make_caches(model), tokens, args.prefill)
            kl, largest = models_matrix.kl_and_max(reference, out)
            p = reference - mx.logsumexp(reference, -1, keepdims=True)
            q = out - mx.logsumexp(out, -1, keepdims=True)
            records.append({"spec": spec, "routing": "free" if mode == "count" else "replayed", "kl": kl,
                            "max_abs_dlogit": largest, "routings_flipped": log.flipped, "routings": log.routed,
                            "per_step_kl": [round(v, 4) for v in mx.sum(mx.exp(p) * (p - q), -1).tolist()]})
            print(json.dumps(records[-1]), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as handle:
        json.dump({"model": "laguna (tiny random, as in the matrix)", "prefill": args.prefill,
                   "decode": args.decode, "records": records}, handle, indent=2)
    with open(os.path.join(args.out, "results.md"), "w") as handle:
        handle.write("| spec | routing | KL | routings flipped |\n|---|---|---:|---:|\n")
        for r in records:
            flips = f"{r['routings_flipped']}/{r['routings']}" if r["routing"] == "free" else "-"
            handle.write(f"| `{r['spec']}` | {r['routing']} | {r['kl']:.4g} | {flips} |\n")


if __name__ == "__main__":
    main()
