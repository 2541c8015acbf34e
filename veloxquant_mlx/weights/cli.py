"""`veloxquant quantize-weights`: quantize a model's linear layers into a folder."""

from __future__ import annotations


def run_quantize_weights(args) -> None:
    from pathlib import Path

    from ..models import DEFAULT_MODEL, GEMMA3_MODEL, model_source
    from ..outputs import check_out_dir, replacing_dir
    from .directory import quantize_to_dir

    source = Path(args.model).expanduser()
    model_dir = source if source.is_dir() else Path(model_source(args.model)) if args.model in (
        DEFAULT_MODEL, GEMMA3_MODEL) else None
    out = check_out_dir(args.out, args.force, not_into=model_dir)  # before loading and quantizing
    skip = [s for s in (args.skip or "").split(",") if s]
    with replacing_dir(out, args.force) as temp:
        config = quantize_to_dir(args.model, temp, args.bits, seed=args.seed, skip=skip, group_size=args.group_size,
                                 column_alpha=args.column_alpha, embeddings=args.embeddings,
                                 calibration_tokens=args.calibration_tokens, calibration_text=args.calibration_text,
                                 share_rotations=args.share_rotations, format=args.format,
                                 scale_bits=args.scale_bits, center_bits=args.center_bits)
    print(f"quantized {config['base_model']} to {args.bits} bits in {config['quantize_seconds']:.1f} s; "
          f"wrote {out} (load it with --model {out})")


def register_cli(subparsers) -> None:
    from ..models import DEFAULT_MODEL

    p = subparsers.add_parser("quantize-weights", help="quantize linear layers to rotated Lloyd-Max codes")
    p.add_argument("--model", default=DEFAULT_MODEL, help="local path, .gguf file, hub id or 'smollm2'")
    p.add_argument("--bits", type=int, default=4, choices=(2, 3, 4), help="code bits per weight (default: 4)")
    p.add_argument("--out", required=True, help="folder to write (weights.json + reservoir.vqw)")
    p.add_argument("--force", action="store_true", help="replace an existing, non-empty --out folder (default: refuse)")
    p.add_argument("--seed", type=int, default=0, help="seed of the rotations (default: 0)")
    p.add_argument("--group-size", type=int, default=None, help="per-group scales (default: one per row)")
    p.add_argument("--column-alpha", type=float, default=0.5, help="column scaling exponent (0: off)")
    p.add_argument("--embeddings", action="store_true",
                   help="quantize the embedding tables too (with a tied output layer, that layer as well)")
    p.add_argument("--calibration-tokens", type=int, default=0,
                   help="GPTQ codes calibrated on this many tokens (a multiple of 256; 0: data-free codes)")
    p.add_argument("--calibration-text", default=None,
                   help="text file for --calibration-tokens (default: the packaged sample text)")
    p.add_argument("--share-rotations", action="store_true",
                   help="one rotation and input scale per shared input (q/k/v, gate/up), folded into the norm before "
                        "them: faster GPU decode, worse perplexity (docs/methods.md); default: one per layer")
    p.add_argument("--format", default="rotated", choices=("rotated", "group_affine"),
                   help="rotated: rotated Lloyd-Max codes (default); group_affine: per-group affine codes with "
                        "quantized group scales and centres (data-free; keeps a Q4_1 source's grid at 4 bits)")
    p.add_argument("--scale-bits", type=int, default=None, help="group_affine: bits of a group's scale code (default 4)")
    p.add_argument("--center-bits", type=int, default=None, help="group_affine: bits of a group's centre code (default 6)")
    p.add_argument("--skip", default="", help="comma-separated layer names/paths/patterns to keep in float")
    p.set_defaults(func=run_quantize_weights)
