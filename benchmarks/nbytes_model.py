"""Does `nbytes` cover what the caches hold? Prefill the default model through compressed
caches and compare MLX's active memory growth with the caches' `nbytes`.

    python benchmarks/nbytes_model.py --method kivi:2 --tokens 3072 --out results/cpu/nbytes_kivi2.json
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx

from veloxquant_mlx.evaluation.specs import parse_method_spec
from veloxquant_mlx.models import load_model


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--method", default="kivi:2")
    parser.add_argument("--tokens", type=int, default=3072)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model, _ = load_model(args.model, dequantize=True)
    mx.eval(model.parameters())
    spec = parse_method_spec(args.method)
    warm = spec.make_caches(model)  # codecs' constants (shared by all caches) exist before counting
    model(mx.array([[1, 2, 3]]), cache=warm)
    mx.eval([c.state for c in warm])
    del warm
    tokens = mx.random.randint(0, 1000, (1, args.tokens), key=mx.random.key(0))
    mx.eval(tokens)
    mx.synchronize()
    mx.clear_cache()
    caches = spec.make_caches(model)
    before = mx.get_active_memory()
    for start in range(0, args.tokens, args.chunk):
        mx.eval(model(tokens[:, start : start + args.chunk], cache=caches))
        mx.eval([c.state for c in caches])
    mx.synchronize()
    mx.clear_cache()
    grown = mx.get_active_memory() - before
    nbytes = sum(c.nbytes for c in caches)
    record = {"method": args.method, "tokens": args.tokens, "active_memory_growth": grown, "nbytes": nbytes,
              "ratio": grown / nbytes}
    print(json.dumps(record))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(record, fh, indent=1)


if __name__ == "__main__":
    main()
