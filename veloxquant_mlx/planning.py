"""`veloxquant plan`: a memory budget -> a RateQuant allocation, its expected quality, measured.

The budget covers the KV cache of one sequence of `context` tokens (batch 1): every layer's
packed rows (`storage.RowStore`: key codes | value codes | one word for both fp16 norms),
the capacity rounded up to the store's growth step. A sliding-window layer holds at most its
window and one prefill chunk (`held_tokens`), so a bit there costs less memory than in a full
layer: the water-filling weighs each layer's widths by the tokens it holds. What is left after the norms is spread
as code bits per coordinate, the same budget for keys and values unless `--kbudget` fixes the
keys' share; `ratequant` then places widths per layer by reverse water-filling on curves
fitted from a probe of the model's own activations (`methods/ratequant.py`).
"""

from __future__ import annotations

import math
from pathlib import Path

import mlx.core as mx
import numpy as np

from .calibration import CALIBRATION_SEQUENCES, CALIBRATION_TOKENS, calibration_tokens, capture
from .config import KVCacheConfig
from .methods.ratequant import MAX_BITS, MIN_BITS, RateQuant, expected_nsr, params_of, width_grid
from .storage import STEP

NORM_BITS = 32  # one uint32 word per token and head holds the key and value fp16 norms


MEASURE_CHUNK = 512  # `measure` feeds the context in prefill chunks of this many tokens


def capacity(context: int) -> int:
    return math.ceil(context / STEP) * STEP


def held_tokens(model, context: int, chunk: int = MEASURE_CHUNK) -> list:
    """Store capacity of each attention layer after `context` tokens fed in chunks of `chunk`: the
    context for a full layer; for a sliding-window one (mlx-lm's RotatingKVCache), its max_size - 1
    earlier tokens plus the last chunk, as it holds them right after a prefill chunk, in the steps
    its store grows by (`rotating.py`: the window, where it is shorter than a full layer's step)."""
    from .attention_hook import attention_cache, base_caches

    last = context - (context - 1) // chunk * chunk
    held = []
    for cache in base_caches(model):
        if not attention_cache(cache):
            continue
        window = getattr(cache, "max_size", None)
        if window is None:
            held.append(capacity(context))
        else:
            step = min(STEP, window)
            held.append(math.ceil(min(context, window - 1 + last) / step) * step)
    return held


def budget_bits(shapes, memory_bytes: float, held) -> float:
    """Mean code bits per held coordinate (keys and values) that fit `memory_bytes`, each layer
    holding `held` tokens (`held_tokens`)."""
    norms = sum(s[0] * n for s, n in zip(shapes, held))
    coords = sum(s[0] * (s[1] + s[2]) * n for s, n in zip(shapes, held))
    return (memory_bytes * 8 - norms * NORM_BITS) / coords


def row_bytes(shapes, key_widths, value_widths) -> list:
    """Bytes per token of each layer's rows at these widths (widths on the 32-code grid)."""
    return [4 * h * (round(kw * dk / 32) + round(vw * dv / 32) + 1)
            for (h, dk, dv), kw, vw in zip(shapes, key_widths, value_widths)]


def plan(model, tokenizer, text: str, memory_gb: float, context: int, out_dir, kbudget=None,
         sequences: int = CALIBRATION_SEQUENCES, tokens: int = CALIBRATION_TOKENS, seed: int = 0,
         progress: bool = True, skip: int = 0, objective: str = "relative") -> dict:
    from .artifacts import model_fingerprint, precompute

    fingerprint = model_fingerprint(model)
    shapes = [s for s in fingerprint["layer_shapes"] if s]
    held = held_tokens(model, context)
    mean = budget_bits(shapes, memory_gb * 1e9, held)
    fp16_bytes = sum(2 * h * (dk + dv) * min(n, context) for (h, dk, dv), n in zip(shapes, held))
    if mean < MIN_BITS:
        raise ValueError(f"{memory_gb} GB holds {mean:.2f} code bits per coordinate at {context} tokens; "
                         f"ratequant needs at least {MIN_BITS} (fp16 would take {fp16_bytes / 1e9:.4f} GB)")
    mean = min(mean, MAX_BITS)
    coords_k = sum(h * dk * n for (h, dk, _), n in zip(shapes, held))
    coords_v = sum(h * dv * n for (h, _, dv), n in zip(shapes, held))
    if kbudget is None:
        kb = vb = mean
    else:
        kb = float(kbudget)
        vb = (mean * (coords_k + coords_v) - kb * coords_k) / coords_v
    kb, vb = (math.floor(min(b, MAX_BITS) * 1e4) / 1e4 for b in (kb, vb))
    config = KVCacheConfig(method="ratequant", seed=seed, options={"kbudget": kb, "vbudget": vb, "objective": objective})
    layers = capture(model, calibration_tokens(tokenizer, text, sequences, tokens, skip), progress=progress)
    fits = RateQuant.fit(config, layers, progress=progress)
    widths = {role: RateQuant.allocation(fits, role, b, objective, tokens=held) for role, b in (("keys", kb), ("values", vb))}
    learned = [None if f is None else {r: params_of(f[r], widths[r][i]) for r in ("keys", "values")}
               for i, f in enumerate(fits)]
    kw = [w for w in widths["keys"] if w is not None]
    vw = [w for w in widths["values"] if w is not None]
    grid = max(width_grid(s[1]) for s in shapes)
    uniform = {role: [math.floor(b / grid) * grid] for role, b in (("keys", kb), ("values", vb))}
    rows = {role: [e[role] for e in learned if e] for role in ("keys", "values")}
    record = {
        "memory_gb": memory_gb, "context": context, "kbudget": kb, "vbudget": vb,
        "key_widths": kw, "value_widths": vw,
        "predicted_bytes": sum(b * n for b, n in zip(row_bytes(shapes, kw, vw), held)),
        "held_tokens": held,
        "fp16_bytes": fp16_bytes,
        "expected_key_nsr": expected_nsr(rows["keys"]),
        "expected_value_nsr": expected_nsr(rows["values"]),
        "uniform_key_nsr": _uniform_nsr(rows["keys"], uniform["keys"][0]),
        "uniform_value_nsr": _uniform_nsr(rows["values"], uniform["values"][0]),
        "uniform_widths": [uniform["keys"][0], uniform["values"][0]],
    }
    precompute(model, config, out_dir, layers=learned, calibration={"method": "ratequant", "plan": record})
    record["config"] = config
    return record


def _uniform_nsr(rows, width: float) -> float:
    noise = sum(float(r["fit"][0].item()) * float(r["fit"][1].item()) ** -width for r in rows)
    return noise / sum(float(r["signal"][0].item()) for r in rows)


def measure(model, config, tokens: mx.array, chunk: int = MEASURE_CHUNK) -> int:
    """Bytes every cache holds after `tokens` went through the model in chunks of `chunk`."""
    from .integration import KVCacheBuilder

    caches = KVCacheBuilder(config).for_model(model).build()
    for start in range(0, tokens.shape[0], chunk):
        mx.eval(model(tokens[None, start : start + chunk], cache=caches))
    return sum(c.nbytes for c in caches)


def run_plan(args) -> None:
    from .models import load_model
    from .outputs import check_out_dir, replacing_dir

    out = check_out_dir(args.out, args.force)  # before the model and the long probe
    text = Path(args.text).read_text()
    model, tokenizer = load_model(args.model)
    with replacing_dir(out, args.force) as temp:
        record = plan(model, tokenizer, text, args.memory_gb, args.context, temp, kbudget=args.kbudget,
                      progress=not args.no_progress, skip=args.skip_tokens, objective=args.objective)
    config = record["config"].replace(artifact_dir=str(args.out))
    print(f"budget {args.memory_gb} GB at {args.context} tokens: {record['kbudget']:.4f} key / "
          f"{record['vbudget']:.4f} value code bits per coordinate (fp16 would take {record['fp16_bytes'] / 1e9:.4f} GB)")
    print("layer  key bits  value bits")
    for i, (k, v) in enumerate(zip(record["key_widths"], record["value_widths"])):
        print(f"{i:5d}  {k:8.2f}  {v:10.2f}")
    print(f"mean widths: keys {np.mean(record['key_widths']):.3f}, values {np.mean(record['value_widths']):.3f}")
    print(f"predicted cache: {record['predicted_bytes'] / 1e9:.5f} GB")
    print(f"expected quality (fitted distortion / signal, lower is better): keys {record['expected_key_nsr']:.3e} "
          f"(uniform {record['uniform_widths'][0]:g} bits: {record['uniform_key_nsr']:.3e}), values "
          f"{record['expected_value_nsr']:.3e} (uniform {record['uniform_widths'][1]:g} bits: "
          f"{record['uniform_value_nsr']:.3e})")
    print(f"use: --method ratequant --option kbudget={record['kbudget']} --option vbudget={record['vbudget']} "
          f"--option objective={args.objective} --artifact-dir {args.out}   (eval spec: ratequant:kbudget="
          f"{record['kbudget']},vbudget={record['vbudget']},objective={args.objective},artifacts={args.out})")
    if args.measure:
        ids = tokenizer.encode(text)
        if len(ids) < args.context:
            raise ValueError(f"the text has {len(ids)} tokens, fewer than the context {args.context}")
        used = measure(model, config, mx.array(ids[-args.context:]))
        verdict = "meets" if used <= args.memory_gb * 1e9 else "EXCEEDS"
        print(f"measured: {used / 1e9:.5f} GB after {args.context} tokens ({verdict} the {args.memory_gb} GB budget)")


def register_cli(sub, default_model: str) -> None:
    p = sub.add_parser("plan", help="turn a KV memory budget into a ratequant allocation")
    p.add_argument("--model", default=default_model, help=f"local folder, .gguf file, hub id or 'smollm2' (default: {default_model})")
    p.add_argument("--memory-gb", type=float, required=True, help="KV cache budget of one sequence, GB (1e9 bytes)")
    p.add_argument("--context", type=int, required=True, help="tokens the cache must hold")
    p.add_argument("--text", required=True, help="text to probe (and to measure with --measure)")
    p.add_argument("--out", required=True, help="artifact directory to write for the allocation")
    p.add_argument("--force", action="store_true", help="replace an existing, non-empty --out folder (default: refuse)")
    p.add_argument("--kbudget", type=float, default=None, help="fix the keys' code bits; values get the rest")
    p.add_argument("--measure", action="store_true", help="run --context tokens and report the cache's bytes")
    p.add_argument("--objective", choices=("absolute", "relative"), default="relative",
                   help="ratequant's water-filling objective (relative measured better on SmolLM2)")
    p.add_argument("--skip-tokens", type=int, default=0, help="probe from this many tokens into the text")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_plan)
