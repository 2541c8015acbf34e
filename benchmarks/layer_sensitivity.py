"""End-to-end sensitivity of each layer's keys and values to one bit more or less, and the
per-layer widths it suggests at the base config's average (the probe RateQuant's per-layer proxies
lacked: docs/calibrated.md, "ratequant loses to uniform widths").

    PYTHONPATH=. python benchmarks/layer_sensitivity.py --text ../shared/data/wikitext2-test.txt \\
        --skip-tokens 200000 --ctx 1024 --out benchmarks/results/layer-sensitivity

On one window of `--ctx` tokens (second half scored, `--chunk` tokens per forward call, as
`veloxquant eval ppl` scores), every probe quantizes all layers with the base config and then
changes ONE layer's key (or value) width by +1 or -1 bit; its KL against the fp16 run, minus the
base's, is that layer's gain (+1) or loss (-1). The allocation then moves bits greedily from the
layer of the smallest loss to the layer of the largest gain while the gain exceeds the loss (each
layer moves at most one bit either way), keeping the average width, and `--eval-skip` windows
score the uniform base and the allocation side by side (held-out tokens: the default scores the
text's first window, the one `veloxquant eval ppl` reports). Writes results.json and results.md.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from veloxquant_mlx.evaluation.perplexity import score_window
from veloxquant_mlx.evaluation.specs import parse_method_spec
from veloxquant_mlx.integration import KVCacheBuilder
from veloxquant_mlx.models import load_model

ROLES = {"keys": "bits", "values": "value_bits"}


def layer_caches(model, base, widths=None):
    """One cache per layer: the base config, with {(layer, role): bits} overrides."""
    caches = KVCacheBuilder(base).for_model(model).build()
    for (layer, role), bits in (widths or {}).items():
        changed = replace(base, **{ROLES[role]: bits})
        caches[layer] = KVCacheBuilder(changed).for_model(model).build()[layer]
    return caches


def kl_of(model, window, chunk, reference, caches) -> float:
    return float(mx.mean(score_window(model, caches, window, chunk, reference=reference).kl))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--text", required=True)
    parser.add_argument("--skip-tokens", type=int, default=200000, help="where the probe window starts")
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--base", default="turboquant_mse:3:vbits=2,sinks=4,window=32,center=true,renorm=true")
    parser.add_argument("--roles", default="values,keys")
    parser.add_argument("--eval-skip", default="0", help="comma list of token offsets of held-out windows")
    parser.add_argument("--eval-ctx", type=int, default=2048)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    model, tokenizer = load_model(args.model)
    ids = tokenizer.encode(Path(args.text).read_text())
    base = parse_method_spec(args.base).config
    layers = len(model.layers)

    def reference_of(window):
        return score_window(model, make_prompt_cache(model), window, args.chunk, keep_logprobs=True).logprobs

    window = mx.array(ids[args.skip_tokens:args.skip_tokens + args.ctx], dtype=mx.uint32)
    reference = reference_of(window)
    start = time.perf_counter()
    base_kl = kl_of(model, window, args.chunk, reference, layer_caches(model, base))
    probes = {}
    for role in args.roles.split(","):
        width = getattr(base, ROLES[role])
        for layer in range(layers):
            for delta in (1, -1):
                if not 1 <= width + delta <= 8:
                    continue
                kl = kl_of(model, window, args.chunk, reference, layer_caches(model, base, {(layer, role): width + delta}))
                probes[f"{role}.{layer}.{delta:+d}"] = kl - base_kl
                print(json.dumps({"role": role, "layer": layer, "delta": delta, "kl_change": kl - base_kl}), flush=True)
    probe_s = time.perf_counter() - start

    # Greedy: the largest gain against the smallest loss, one bit each, per role.
    allocation = {}
    for role in args.roles.split(","):
        width = getattr(base, ROLES[role])
        gains = sorted(((-probes.get(f"{role}.{l}.+1", 0.0), l) for l in range(layers) if f"{role}.{l}.+1" in probes),
                       reverse=True)
        losses = sorted((probes.get(f"{role}.{l}.-1", float("inf")), l) for l in range(layers))
        taken = set()
        for gain, up in gains:
            loss, down = next(((c, l) for c, l in losses if l not in taken and l != up), (None, None))
            if loss is None or gain <= loss or up in taken:
                break
            allocation[(up, role)], allocation[(down, role)] = width + 1, width - 1
            taken |= {up, down}

    evals = []
    for skip in (int(s) for s in args.eval_skip.split(",")):
        held = mx.array(ids[skip:skip + args.eval_ctx], dtype=mx.uint32)
        ref = reference_of(held)
        uniform = kl_of(model, held, args.chunk, ref, layer_caches(model, base))
        allocated = kl_of(model, held, args.chunk, ref, layer_caches(model, base, allocation))
        evals.append({"skip": skip, "ctx": args.eval_ctx, "kl_uniform": uniform, "kl_allocated": allocated})
        print(json.dumps(evals[-1]), flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    widths = {role: [allocation.get((l, role), getattr(base, ROLES[role])) for l in range(layers)]
              for role in args.roles.split(",")}
    (out / "results.json").write_text(json.dumps({
        "args": vars(args), "base_kl": base_kl, "probes": probes, "probe_seconds": probe_s,
        "widths": widths, "evals": evals}, indent=2))
    lines = [f"Base `{args.base}`: KL {base_kl:.4f} on tokens {args.skip_tokens}-{args.skip_tokens + args.ctx - 1} "
             "(second half scored). KL change when one layer's width moves by one bit:", "",
             "| layer | " + " | ".join(f"{r} +1 | {r} -1" for r in args.roles.split(",")) + " |",
             "|---:|" + "---:|---:|" * len(args.roles.split(","))]
    for l in range(layers):
        cells = []
        for role in args.roles.split(","):
            cells += [f"{probes.get(f'{role}.{l}.+1', float('nan')):+.4f}", f"{probes.get(f'{role}.{l}.-1', float('nan')):+.4f}"]
        lines.append(f"| {l} | " + " | ".join(cells) + " |")
    lines += ["", "Allocation (same average width): " + "; ".join(f"{r}: {','.join(map(str, w))}" for r, w in widths.items()),
              "", "| held-out window (first token) | KL uniform | KL allocated |", "|---:|---:|---:|"]
    lines += [f"| {e['skip']} | {e['kl_uniform']:.4f} | {e['kl_allocated']:.4f} |" for e in evals]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
