"""Calibrate every configuration of a calibrated-methods table from one capture.

    python benchmarks/calibrated_artifacts.py --text ../shared/data/wikitext2-test.txt \
        --skip-tokens 200000 --out benchmarks/results/calib-ppl

`veloxquant calibrate` does capture + learn for one configuration; here the capture (the
model's forward passes) runs once and each configuration's learning is timed on its own,
so `calibration.json` holds capture seconds, learn seconds per configuration, and the eval
specs (with `artifacts=DIR`) that `veloxquant eval ppl --methods` takes next. The artifact
dirs go under OUT/artifacts/NAME.
"""

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx

from veloxquant_mlx.artifacts import precompute
from veloxquant_mlx.calibration import calibration_tokens, capture, learn
from veloxquant_mlx.evaluation.specs import parse_method_spec
from veloxquant_mlx.models import load_model

SPECS = {
    "rq2.5": "ratequant:kbudget=2.5,vbudget=2.5",
    "rq3": "ratequant:kbudget=3.0,vbudget=3.0",
    "rq3.5": "ratequant:kbudget=3.5,vbudget=3.5",
    "rq-k3.5-v2.5": "ratequant:kbudget=3.5,vbudget=2.5",
    "rq-k2.5-v3.5": "ratequant:kbudget=2.5,vbudget=3.5",
    "tq3-out4": "turboquant_mse:3:outliers=4",
    "tq3-out8": "turboquant_mse:3:outliers=8",
    "tq3-out16": "turboquant_mse:3:outliers=16",
    "tq2-out8": "turboquant_mse:2:outliers=8",
    "kivi2-out8": "kivi:2:group=32,outliers=8",
    "rq3-out8": "ratequant:kbudget=3.0,vbudget=3.0,outliers=8",
    "rqkivi2.5": "ratequant:group=32,kbudget=2.5,vbudget=2.5,base=kivi",
    "rqkivi2": "ratequant:group=32,kbudget=2.0,vbudget=2.0,base=kivi",
    "rqkivi3": "ratequant:group=32,kbudget=3.0,vbudget=3.0,base=kivi",
    "rq2.5-rel": "ratequant:kbudget=2.5,vbudget=2.5,objective=relative",
    "rq3-rel": "ratequant:kbudget=3.0,vbudget=3.0,objective=relative",
    "rq3.5-rel": "ratequant:kbudget=3.5,vbudget=3.5,objective=relative",
    "rqkivi2.5-rel": "ratequant:group=32,kbudget=2.5,vbudget=2.5,base=kivi,objective=relative",
    "sq2": "spectralquant:2",
    "sq3": "spectralquant:3",
    "sq4": "spectralquant:4",
    # vecinfer (issue 11 item 5): key bits per coordinate = centroid_bits / sub_dim
    "vi-k2-vq2": "vecinfer:2:values=vq",
    "vi-k1-vq1": "vecinfer:1:values=vq",
    "vi-k1.5-vq2": "vecinfer:2:sub_dim=4,centroid_bits=6,values=vq",
    "vi-k2-mse2": "vecinfer:2",
    "vi-k2-mse3": "vecinfer:2:vbits=3",
    "vi-k2-mse3-nosmooth": "vecinfer:2:vbits=3,smooth=false",
    "vi-k2-vq2-nosmooth": "vecinfer:2:values=vq,smooth=false",
}


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--text", required=True)
    parser.add_argument("--skip-tokens", type=int, default=200000)
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", nargs="*", default=None, help="names from SPECS")
    args = parser.parse_args()

    out = Path(args.out)
    model, tokenizer = load_model(args.model)
    sequences = calibration_tokens(tokenizer, Path(args.text).read_text(), args.sequences, args.tokens,
                                   args.skip_tokens)
    start = time.perf_counter()
    layers = capture(model, sequences)
    captured = time.perf_counter() - start
    record = {"model": args.model, "text": args.text, "skip_tokens": args.skip_tokens,
              "tokens": int(sum(s.shape[0] for s in sequences)), "configs": {}}
    if (out / "calibration.json").exists():  # runs with --only add to the record
        record["configs"] = json.loads((out / "calibration.json").read_text())["configs"]
    specs = []
    for name, spec in SPECS.items():
        if args.only and name not in args.only:
            continue
        config = parse_method_spec(spec).config
        start = time.perf_counter()
        learned = learn(config, layers, progress=False)
        mx.eval([list(e[r].values()) for e in learned if e for r in e])
        seconds = time.perf_counter() - start
        target = out / "artifacts" / name
        precompute(model, config, target, layers=learned,
                   calibration={"method": config.method, "tokens": record["tokens"], "learn_seconds": seconds})
        full = f"{spec},artifacts={target}" if ":" in spec and "=" in spec.split(":")[-1] else f"{spec}:artifacts={target}"
        entry = {"spec": full, "capture_seconds": round(captured, 2), "learn_seconds": round(seconds, 2),
                 "calibration_seconds": round(seconds + captured, 2)}
        if config.method == "ratequant":
            from veloxquant_mlx.methods.ratequant import RateQuant

            entry.update(RateQuant.calibration_summary(learned))
        record["configs"][name] = entry
        specs.append(full)
        print(f"{name}: learned in {seconds:.1f} s -> {target}", flush=True)
        (out / "calibration.json").write_text(json.dumps(record, indent=2))  # after each: a long run keeps what it did
    print(",".join(specs))


if __name__ == "__main__":
    main()
