"""Write a random-weight model of a named architecture (`veloxquant_mlx/evaluation/shapes.py`) as an
mlx-lm model folder, so that servers and `mlx_lm.load` can open it like a downloaded model.

The tokenizer is SmolLM2's (or `--tokenizer-from`'s), and the vocabulary is cut to the tokenizer's size so that every token the
random model emits can be detokenized; every other shape is the named architecture's.

    python benchmarks/shape_model_folder.py llama-3.1-8b /tmp/llama-8b-q4 --weights-bits 4
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mlx_lm.utils import save_model

from veloxquant_mlx.evaluation.shapes import build_shape_model, copy_tokenizer, shape_config
from veloxquant_mlx.models import default_model_dir


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", help="a name from veloxquant_mlx/evaluation/shapes.py, e.g. llama-3.1-8b")
    parser.add_argument("out", help="the folder to write (must not exist)")
    parser.add_argument("--weights-bits", type=int, default=4, help="4 or 8; 16 keeps float weights")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--tokenizer-from", help="a folder holding the tokenizer files (default: SmolLM2's converted folder)")
    args = parser.parse_args(argv)

    out = Path(args.out)
    if out.exists():
        parser.error(f"{out} exists")
    source = Path(args.tokenizer_from) if args.tokenizer_from else default_model_dir()
    vocab = len(json.loads((source / "tokenizer.json").read_text())["model"]["vocab"])
    config = {**shape_config(args.shape), "vocab_size": vocab, "torch_dtype": args.dtype}
    model = build_shape_model(args.shape, dtype=args.dtype, weights_bits=args.weights_bits,
                              overrides={"vocab_size": vocab})
    if args.weights_bits and args.weights_bits < 16:
        config["quantization"] = {"group_size": 64, "bits": args.weights_bits}
    out.mkdir(parents=True)
    source_config = copy_tokenizer(out, source)
    config.update({k: source_config[k] for k in ("bos_token_id", "eos_token_id") if source_config.get(k) is not None})
    save_model(out, model)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    print(f"wrote {out}: {args.shape}, vocabulary {vocab}, weights {args.weights_bits}-bit")


if __name__ == "__main__":
    main()
