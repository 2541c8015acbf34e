"""WikiText-2 perplexity of weight-quantized SmolLM2: ours (rotated Lloyd-Max codes) vs MLX's
`nn.quantize` (affine, mxfp4, nvfp4), with bits per weight counted from the stored arrays.

    python benchmarks/weights_quality.py --windows 3 --ctx 512 --out benchmarks/results/weights-quality-smollm2

Specs: `ref` (the dequantized Q4_1 weights), `vq:BITS[:g=GROUP][:stages=K][:alpha=A][:rot=dense][:gptq=N][:emb=1][:share=0]` (alpha: column_alpha, default 0.5 as in quantize_model;
share=0: one rotation and input scale per layer instead of one per shared input (q/k/v, gate/up), quantize_model's default;
gptq=N: GPTQ codes calibrated on the first N tokens of the packaged python-reference.txt, never on WikiText; emb=1: the embedding table too),
`affine:BITS:GROUP[:emb=1]`, `mxfp4`, `nvfp4`,
`gaffine:BITS[:g=GROUP][:s=SCALE_BITS][:c=CENTER_BITS][:clip=0]` (ours, `weights.affine.GroupAffineLinear`: per-group
min-max affine codes with the group scales and centres quantized against one fp16 maximum per row;
clip=0: without the per-group clip search). `weights MB` counts every matrix of the model (linear layers and
the embedding table, float ones at 16 bits) as stored. MLX-quantized layers are evaluated as float layers holding their dequantized weights (the
same function; MLX's quantized matmul is ~10x slower on the CPU). Only linear layers are quantized by every method
(SmolLM2's embedding is tied to its output layer and stays as loaded). MLX keeps scales and
biases in the model's dtype (float32 here on the CPU); they are counted at 16 bits, as they
would be stored in an fp16 or bf16 model; mxfp4/nvfp4 scales are 8-bit and counted so.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from veloxquant_mlx.texts import load_text, tokenize_prefix
from veloxquant_mlx.models import load_model
from veloxquant_mlx.weights import GroupAffineLinear, QuantizedLinear, RotatingRMSNorm, StructuredRotation, quantize_model
from veloxquant_mlx.weights import model as weights_model
from veloxquant_mlx.weights.gptq import calibration_tokens
from veloxquant_mlx.weights.rotation import dense_rotation_matrix

DEFAULT_SPECS = ("ref,vq:3,affine:3:64,affine:2:32,vq:4,affine:4:64,mxfp4,nvfp4,affine:3:32,vq:2,affine:2:64,"
                 "vq:3:g=64,vq:3:alpha=0,vq:3:rot=dense")


class DenseBaselineRotation(StructuredRotation):
    """A dense Haar rotation behind the StructuredRotation interface (quality baseline only)."""

    def __init__(self, dim: int, seed: int):
        super().__init__(dim, mx.ones((1, dim)), None, (dim,))
        self.matrix = dense_rotation_matrix(dim, seed)

    def apply_signed(self, x):  # its signs are ones: `apply` (scale, signs) ends here
        return x @ self.matrix.T.astype(x.dtype)

    def state(self):
        return {"signs": self.signs.astype(mx.int8), "dense": self.matrix}


def parse(spec: str) -> dict:
    parts = spec.split(":")
    out = {"spec": spec, "kind": parts[0]}
    if parts[0] in ("vq", "gaffine"):
        out["bits"] = int(parts[1])
        for item in parts[2:]:
            key, _, value = item.partition("=")
            out[key] = value
    elif parts[0] == "affine":
        out["bits"], out["group"] = int(parts[1]), int(parts[2])
        for item in parts[3:]:
            key, _, value = item.partition("=")
            out[key] = value
    return out


def quantize_vq(model, spec: dict, seed: int, tokenizer=None) -> None:
    group = int(spec["g"]) if "g" in spec else None
    stages = int(spec.get("stages", 2))
    if spec.get("rot") == "dense":
        for path in weights_model.linear_paths(model):
            module = dict(model.named_modules())[path]
            rotation = DenseBaselineRotation(module.weight.shape[1], weights_model.layer_seed(seed, path))
            layer = QuantizedLinear.from_weight(module.weight, spec["bits"], group_size=group, rotation=rotation,
                                                column_alpha=float(spec.get("alpha", 0.5)))
            model.update_modules(weights_model.tree_unflatten([(path, layer)]))
        return
    calibration = calibration_tokens(tokenizer, int(spec["gptq"])) if "gptq" in spec else None
    quantize_model(model, spec["bits"], seed=seed, group_size=group, stages=stages,
                   column_alpha=float(spec.get("alpha", 0.5)), embeddings=spec.get("emb") == "1",
                   calibration=calibration, share_rotations=spec.get("share", "1") != "0", progress=False)


def quantize_group_affine(model, spec: dict) -> None:
    """As quantize_model(format="group_affine"), with the clip search optional (`clip=0`)."""
    modules = dict(model.named_modules())
    for path in weights_model.linear_paths(model):
        module = modules[path]
        layer = GroupAffineLinear.from_weight(module.weight, spec["bits"], group_size=int(spec.get("g", 32)),
                                              scale_bits=int(spec.get("s", 4)), center_bits=int(spec.get("c", 6)),
                                              bias=module.get("bias"), clip_search=spec.get("clip", "1") != "0")
        model.update_modules(weights_model.tree_unflatten([(path, layer)]))


def quantize_mlx(model, spec: dict) -> None:
    def only_linear(_path, module):
        return isinstance(module, nn.Linear) or (spec.get("emb") == "1" and isinstance(module, nn.Embedding))

    if spec["kind"] == "affine":
        nn.quantize(model, group_size=spec["group"], bits=spec["bits"], class_predicate=only_linear)
    else:
        nn.quantize(model, mode=spec["kind"], class_predicate=only_linear)


def dequantize_mlx_layers(model) -> None:
    """Swap MLX-quantized layers for float ones holding the same (dequantized) weights: the
    same function, computed with float matmuls (quantized matmuls are ~10x slower on the CPU)."""
    swaps = []
    for path, module in model.named_modules():
        if isinstance(module, GroupAffineLinear):
            linear = nn.Linear(module.in_features, module.out_features, bias="bias" in module)
            linear.weight = module.dequantized_weight()
            if "bias" in module:
                linear.bias = module.bias
            swaps.append((path, linear))
        elif isinstance(module, nn.QuantizedEmbedding):
            table = nn.Embedding(module.num_embeddings, module.dims)
            table.weight = mx.dequantize(module.weight, module.scales, module.get("biases"), module.group_size,
                                         module.bits, mode=module.mode)
            swaps.append((path, table))
        elif isinstance(module, nn.QuantizedLinear):
            weight = mx.dequantize(module.weight, module.scales, module.get("biases"), module.group_size,
                                   module.bits, mode=module.mode)
            linear = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in module)
            linear.weight = weight
            if "bias" in module:
                linear.bias = module.bias
            swaps.append((path, linear))
    model.update_modules(weights_model.tree_unflatten(swaps))


def weights_megabytes(model) -> float:
    """Bytes of every weight matrix (linear layers and embedding tables) as stored, float at 16 bits,
    plus what shared rotations add to their norms."""
    total = 0.0
    for _, module in model.named_modules():
        if isinstance(module, (QuantizedLinear, RotatingRMSNorm, GroupAffineLinear)):
            total += module.storage_nbytes()
        elif isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            total += module.weight.size * 4
            for name in ("scales", "biases"):
                if name in module:
                    a = module[name]
                    total += a.size * (1 if a.dtype == mx.uint8 else 2)
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            total += module.weight.size * 2
    return total / 1e6


def bits_per_weight(model) -> float:
    bits = weights = 0
    for _, module in model.named_modules():
        if isinstance(module, RotatingRMSNorm):  # a shared rotation, its input scales, the folded weight
            bits += 8 * module.storage_nbytes()
        elif isinstance(module, (QuantizedLinear, GroupAffineLinear)):
            bits += 8 * module.storage_nbytes()
            weights += module.in_features * module.out_features
        elif isinstance(module, nn.QuantizedLinear):
            out, packed = module.weight.shape
            weights += out * packed * 32 // module.bits
            bits += module.weight.size * 32
            for name in ("scales", "biases"):
                if name in module:
                    a = module[name]
                    bits += a.size * (8 if a.dtype == mx.uint8 else 16)
        elif isinstance(module, nn.Linear):
            bits += module.weight.size * 16
            weights += module.weight.size
    return bits / weights


def perplexity(model, windows: mx.array, ref_top1=None):
    nll, count, agree, top1 = 0.0, 0, 0, []
    for w in windows:
        logits = model(w[None])[0, :-1].astype(mx.float32)
        targets = w[1:]
        losses = nn.losses.cross_entropy(logits, targets, reduction="sum")
        pred = mx.argmax(logits, axis=-1)
        mx.eval(losses, pred)
        nll += losses.item()
        count += targets.size
        top1.append(pred)
        if ref_top1 is not None:
            agree += (pred == ref_top1[len(top1) - 1]).sum().item()
    ppl = float(mx.exp(mx.array(nll / count)).item())
    return ppl, top1, (agree / count if ref_top1 is not None else 1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--text", default="/work/shared/data/wikitext2-test.txt")
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--specs", default=DEFAULT_SPECS)
    parser.add_argument("--out", default="benchmarks/results/weights-quality-smollm2")
    parser.add_argument("--resume", action="store_true", help="keep the rows of OUT/results.json, run the rest")
    parser.add_argument("--render", action="store_true", help="only rewrite OUT/results.md from OUT/results.json")
    args = parser.parse_args()
    if args.render:
        saved = json.loads((Path(args.out) / "results.json").read_text())
        for key in ("model", "text", "ctx", "windows", "seed"):
            setattr(args, key, saved["meta"][key])
        write(Path(args.out), args, saved["rows"])
        return

    _, tokenizer = load_model(args.model)
    ids = tokenize_prefix(tokenizer, load_text(args.text), args.ctx * args.windows)
    windows = mx.array(ids).reshape(args.windows, args.ctx)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, ref_top1, ref_ppl = [], None, None
    if args.resume and (out / "results.json").is_file():
        rows = json.loads((out / "results.json").read_text())["rows"]
    done = {r["spec"] for r in rows}
    specs = args.specs.split(",")
    if done:  # the reference's top-1 tokens are needed for the agreement column
        specs = ["ref"] + [s for s in specs if s not in done]
    for spec_text in specs:
        spec = parse(spec_text)
        model, _ = load_model(args.model)
        mx.eval(model.parameters())
        start = time.perf_counter()
        if spec["kind"] == "vq":
            quantize_vq(model, spec, args.seed, tokenizer)
        elif spec["kind"] == "gaffine":
            quantize_group_affine(model, spec)
        elif spec["kind"] != "ref":
            quantize_mlx(model, spec)
        mx.eval(model.parameters())
        seconds = time.perf_counter() - start
        bpw = bits_per_weight(model)
        megabytes = weights_megabytes(model)
        dequantize_mlx_layers(model)
        ppl, top1, agree = perplexity(model, windows, ref_top1)
        if spec["kind"] == "ref":
            ref_top1, ref_ppl = top1, ppl
            if "ref" in done:
                continue
        row = {"spec": spec_text, "bits_per_weight": round(bpw, 4), "weights_mb": round(megabytes, 2), "ppl": round(ppl, 4),
               "ppl_vs_ref": round(ppl / ref_ppl - 1, 4) if ref_ppl else None,
               "top1_agreement": round(agree, 4), "quantize_seconds": round(seconds, 2)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del model
        write(out, args, rows)


def write(out: Path, args, rows) -> None:
    """results.json and results.md of the rows so far (rewritten after every spec)."""
    meta = {"model": args.model, "text": args.text, "ctx": args.ctx, "windows": args.windows, "seed": args.seed,
            "tokens_scored": args.windows * (args.ctx - 1), "device": str(mx.default_device())}
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = [f"WikiText-2 perplexity, {args.model}, {args.windows} windows of {args.ctx} tokens "
             f"({meta['tokens_scored']} scored); linear layers quantized, and the embedding table (tied to the output "
             "layer) too in `emb=1` rows; reference = the weights as loaded (the dequantized GGUF: Q4_1 for smollm2, Q4_K_M for gemma3-270m). bits/weight: over the quantized "
             "matrices, scales counted; weights MB: every matrix of the model as stored (float at 16 bits).", "",
             "| method | bits/weight | weights MB | ppl | vs ref | top-1 agreement with ref | quantize s |",
             "|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: r["bits_per_weight"]):
        vs = "" if r["ppl_vs_ref"] is None else f"{100 * r['ppl_vs_ref']:+.1f}%"
        mb = f"{r['weights_mb']:.1f}" if "weights_mb" in r else "n/m"
        lines.append(f"| {r['spec']} | {r['bits_per_weight']:.3f} | {mb} | {r['ppl']:.3f} | {vs} | "
                     f"{r['top1_agreement']:.3f} | {r['quantize_seconds']:.1f} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
