"""Structured rotations vs a dense Haar rotation (and none) for SmolLM2's 576-wide inputs, which
mx.hadamard_transform does not support: relative weight error after 3-bit coding, build time and
stored bytes per rotation.

    python benchmarks/weights_rotation.py --layers 0,10,20 --bits 3 --out benchmarks/results/weights-rotation-smollm2
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from veloxquant_mlx.models import load_model
from veloxquant_mlx.weights import QuantizedLinear, StructuredRotation
from weights_quality import DenseBaselineRotation


class NoRotation(StructuredRotation):
    def __init__(self, dim: int):
        super().__init__(dim, mx.ones((1, dim)), None, (dim,))

    def apply(self, x):
        return x


def rotations(dim: int, seed: int):
    yield "none", lambda: NoRotation(dim)
    for stages in (1, 2, 3):
        yield f"structured-{stages}", lambda s=stages: StructuredRotation.seeded(dim, seed, s)
    yield "dense-haar", lambda: DenseBaselineRotation(dim, seed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--layers", default="0,10,20")
    parser.add_argument("--bits", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/weights-rotation-smollm2")
    args = parser.parse_args()
    model, _ = load_model(args.model)
    errors, build, stored = {}, {}, {}
    for index in (int(i) for i in args.layers.split(",")):
        layer = model.model.layers[index]
        for name, linear in (("q_proj", layer.self_attn.q_proj), ("k_proj", layer.self_attn.k_proj),
                             ("gate_proj", layer.mlp.gate_proj), ("up_proj", layer.mlp.up_proj)):
            w = linear.weight
            dim = w.shape[1]
            for kind, make in rotations(dim, index):
                start = time.perf_counter()
                rotation = make()
                mx.eval(rotation.signs)
                build.setdefault(kind, []).append(time.perf_counter() - start)
                stored[kind] = sum(a.nbytes for a in rotation.state().values())
                q = QuantizedLinear.from_weight(w, args.bits, rotation=rotation, column_alpha=0.0)
                w_hat = q(mx.eye(dim)).T
                err = (mx.linalg.norm(w_hat - w) / mx.linalg.norm(w)).item()
                errors.setdefault(kind, []).append(err)
                print(index, name, kind, round(err, 5), flush=True)
    rows = [{"rotation": k, "mean_relative_error": float(np.mean(v)), "max_relative_error": float(np.max(v)),
             "build_ms": 1e3 * float(np.median(build[k])), "stored_bytes": stored[k]} for k, v in errors.items()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"bits": args.bits, "layers": args.layers, "dim": 576,
                                                  "rows": rows}, indent=2))
    lines = [f"{args.bits}-bit coding of SmolLM2 layers {args.layers} (q/k/gate/up, input dim 576), "
             "relative Frobenius error of the decoded weight:", "",
             "| rotation | mean rel. error | max rel. error | build ms | stored bytes |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['rotation']} | {r['mean_relative_error']:.4f} | {r['max_relative_error']:.4f} | "
                     f"{r['build_ms']:.2f} | {r['stored_bytes']} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
