"""How close could any quantizer of the presets' kind come to the quality targets? The presets code each
key and value as a rotated unit vector (coordinates close to Gaussian, variance 1/D) at b bits a coordinate,
with Lloyd-Max scalar codes. No code of b bits per coordinate of a Gaussian source has a mean squared error
below Shannon's rate-distortion bound D(b) = sigma^2 2^(-2b) (Cover & Thomas, Thm 10.3.2); Lloyd-Max scalar
codes sit 2.7-3.9 dB above it at 2-4 bits.

`rd_floor` (registered here, in this process only) replaces the codes with the bound's test channel
(Cover & Thomas, Sec. 10.3.2): y = a u + sqrt(a D(b)) n, a = 1 - 2^(-2b), n standard normal, which has
exactly the bound's error E(u - y)^2 = D(b) per coordinate. The cache stores y in fp16, so its bytes are
not a code's: the table's bits are the configuration's nominal ones, and the `rd_floor` rows measure the
quality a perfect b-bit code would give under the presets' sinks, window, centring and scales. If they miss a
target, no scalar or vector code of that rate on these rotated vectors meets it.

    PYTHONPATH=. python benchmarks/rate_distortion_floor.py --out DIR [--noise-seed N] [--methods SPECS]
    PYTHONPATH=. python benchmarks/rate_distortion_floor.py --needle 8k:0.25 --out DIR --methods SPECS

The first is `veloxquant eval ppl` on one 2048-token window; `--needle LENGTHS:DEPTHS` runs `veloxquant eval
needle` on those cells instead.
"""

from __future__ import annotations

import argparse
import sys

import mlx.core as mx

from veloxquant_mlx.cli import main
from veloxquant_mlx.formats import Format, fp16
from veloxquant_mlx.methods.base import Codec, Method, register_method
from veloxquant_mlx.rotations import random_rotation


class TestChannelCodec(Codec):
    """The rate-distortion test channel at `bits` per coordinate on R x / ||x||, with the stored scale of
    `turboquant_mse` ("renorm": ||x|| / ||y||, "unbiased": ||x|| / <u, y>)."""

    def __init__(self, dim: int, bits: float, seed: int, scale: str):
        self.dim = self.domain_dim = dim
        self.bits, self.scale = bits, scale
        self.rotation = random_rotation(dim, seed)
        self.format = Format("rd_floor", dim, dim, (fp16("decoded", dim), fp16("norm")))

    def encode(self, x):
        x = x.astype(mx.float32)
        norm = mx.sqrt(mx.sum(x * x, axis=-1, keepdims=True))
        unit = self.rotation.apply(x) / mx.maximum(norm, 1e-30)
        distortion = 2.0 ** (-2 * self.bits) / self.dim
        gain = 1 - 2.0 ** (-2 * self.bits)
        y = gain * unit + (gain * distortion) ** 0.5 * mx.random.normal(unit.shape)
        if self.scale == "unbiased":
            norm = norm / mx.maximum(mx.sum(unit * y, axis=-1, keepdims=True), 1e-30)
        else:
            norm = norm / mx.maximum(mx.sqrt(mx.sum(y * y, axis=-1, keepdims=True)), 1e-30)
        return {"decoded": y.astype(mx.float16), "norm": norm.astype(mx.float16)}

    def decode(self, fields):
        return fields["decoded"].astype(mx.float32) * fields["norm"].astype(mx.float32)

    def to_domain(self, x):
        return self.rotation.apply(x)

    def from_domain(self, y):
        return self.rotation.invert(y)

    domain = "rotation"


@register_method("rd_floor")
class RateDistortionFloor(Method):
    key_bits = range(1, 9)
    value_bits = range(1, 9)
    # key_rate / value_rate: a fractional rate in place of bits / value_bits (write it with a decimal point)
    options = {"renorm": bool, "unbiased_values": bool, "key_rate": float, "value_rate": float}
    summary = "benchmark only: the rate-distortion test channel in place of codes"
    status = "experimental"
    status_note = "a measurement device, not a cache"
    values_summary = "same channel at value_bits"

    @classmethod
    def key_codec(cls, config, dim, params=None):
        return TestChannelCodec(dim, config.options.get("key_rate", config.bits), config.seed, "renorm")

    @classmethod
    def value_codec(cls, config, dim, params=None):
        scale = "unbiased" if config.options.get("unbiased_values") else "renorm"
        return TestChannelCodec(dim, config.options.get("value_rate", config.value_bits), config.seed + 1, scale)


PROTECTED = "sinks=4,center=true,renorm=true,unbiased_values=true"
METHODS = ",".join([
    "fp16", "vq4", "vq3", "vq2",
    f"rd_floor:4:vbits=3,window=32,{PROTECTED}",
    f"rd_floor:3:vbits=2,window=32,{PROTECTED}",
    f"rd_floor:2:vbits=1,window=24,{PROTECTED}",
])

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", default="../shared/data/wikitext2-test.txt")
    parser.add_argument("--skip-tokens", default="0", help="where the window starts (0: the quality table's)")
    parser.add_argument("--methods", default=METHODS)
    parser.add_argument("--noise-seed", type=int, default=0, help="seed of the channel's noise (its draws move "
                        "one window's result by about a point of perplexity at 3 bits)")
    parser.add_argument("--needle", help="LENGTHS:DEPTHS (e.g. 8k:0,0.25): the needle test on those cells instead")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    mx.random.seed(args.noise_seed)
    if args.needle:
        lengths, depths = args.needle.split(":")
        sys.exit(main(["eval", "needle", "--text", args.text, "--lengths", lengths, "--depths", depths, "--no-figures",
                       "--no-progress", "--min-free-gb", "0.5", "--methods", args.methods, "--out", args.out]))
    sys.exit(main(["eval", "ppl", "--text", args.text, "--skip-tokens", args.skip_tokens, "--ctx", "2048", "--windows", "1",
                   "--chunk", "512", "--no-figures", "--no-progress", "--min-free-gb", "0.5",
                   "--methods", args.methods, "--out", args.out]))
