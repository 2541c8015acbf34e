"""What TurboQuant-MSE stores as a vector's scale, on the presets' tuning window (WikiText-2 tokens
200000-202047): the presets store ||x|| / ||c||^gamma with gamma = 1 (`renorm`: the decoded vector keeps
the true norm); the variants change that scale, in this process only.

    VELOXQUANT_KERNELS=portable PYTHONPATH=. python benchmarks/norm_gain_ablation.py VARIANT --out DIR/VARIANT

VARIANT:
  default       the presets as they are (renorm on keys and values);
  values-plain  values store the plain norm ||x|| (renorm on the keys only);
  ls            keys and values store the least-squares gain ||x|| <u, c> / ||c||^2 (u the rotated
                unit vector, c its decoded codes): the scale that minimises ||x - s c||;
  ls-values     the least-squares gain for values, renorm for keys;
  gamma1.5      ||x|| / ||c||^1.5 for both (more than renorm);
  unbiased      keys and values store ||x|| / <u, c>: the decoded vector's projection on the true one
                is exact (more than renorm, since <u, c> <= ||c||);
  unbiased-values  the unbiased scale for values, renorm for keys.

The variants other than `values-plain` replace the codec's MLX encode, so run them on the portable
path (`VELOXQUANT_KERNELS=portable`), which encodes with it; `default` gives the same numbers there
as with the native kernels.
"""

from __future__ import annotations

import argparse
import sys

import mlx.core as mx

import veloxquant_mlx.methods.turboquant_mse as turboquant_mse
from veloxquant_mlx.cli import main
from veloxquant_mlx.packing import pack

VARIANTS = ("default", "values-plain", "ls", "ls-values", "gamma1.5", "unbiased", "unbiased-values")


def encoder(variant: str, role: str):
    """The codec's encode with the variant's scale for `role` ("keys" or "values")."""

    def encode(self, x):
        x = x.astype(mx.float32)
        norm = mx.sqrt(mx.sum(x * x, axis=-1, keepdims=True))
        unit = self.rotation.apply(x) / mx.maximum(norm, 1e-30)
        codes = turboquant_mse.quantize(unit, self.boundaries)
        decoded = turboquant_mse.dequantize(codes, self.centroids)
        squared = mx.maximum(mx.sum(decoded * decoded, axis=-1, keepdims=True), 1e-30)
        if variant == "ls" or (variant == "ls-values" and role == "values"):
            scale = norm * mx.sum(unit * decoded, axis=-1, keepdims=True) / squared
        elif variant == "unbiased" or (variant == "unbiased-values" and role == "values"):
            scale = norm / mx.maximum(mx.sum(unit * decoded, axis=-1, keepdims=True), 1e-30)
        elif variant == "gamma1.5":
            scale = norm / squared ** 0.75
        else:
            scale = norm / mx.sqrt(squared)
        return {"codes": pack(codes, self.bits), "norm": scale.astype(mx.float16)}
    return encode


def use(variant: str) -> None:
    method = turboquant_mse.TurboQuantMSE
    if variant == "values-plain":
        method.value_codec = classmethod(lambda cls, config, dim, params=None: turboquant_mse.MSECodec(
            dim, config.value_bits, config.seed + 1, params, False))
    elif variant != "default":
        for role, make in (("keys", method.key_codec.__func__), ("values", method.value_codec.__func__)):
            def codec(cls, config, dim, params=None, make=make, role=role):
                c = make(cls, config, dim, params)
                c.encode = encoder(variant, role).__get__(c)
                return c
            setattr(method, "key_codec" if role == "keys" else "value_codec", classmethod(codec))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variant", choices=VARIANTS)
    parser.add_argument("--text", default="../shared/data/wikitext2-test.txt")
    parser.add_argument("--skip-tokens", default="200000", help="where the window starts (200000: the presets' "
                        "tuning window; 0: the quality table's)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    use(args.variant)
    sys.exit(main(["eval", "ppl", "--text", args.text, "--skip-tokens", args.skip_tokens, "--ctx", "2048", "--windows", "1",
                   "--chunk", "512", "--no-figures", "--no-progress", "--min-free-gb", "0.5",
                   "--methods", "fp16,vq4,vq3,vq2", "--out", args.out]))
