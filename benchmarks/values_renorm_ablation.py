"""The presets with TurboQuant-MSE's `renorm` on the keys only (values keep the plain norm), against
the presets as they are, on the presets' tuning window (WikiText-2 tokens 200000-202047).

    PYTHONPATH=. python benchmarks/values_renorm_ablation.py values-plain --out DIR/values-plain
    PYTHONPATH=. python benchmarks/values_renorm_ablation.py default --out DIR/default

`renorm` rescales a decoded vector to the true norm. For values that makes the decoded vector a
biased estimate of the true one (Lloyd-Max reconstruction is the cell's conditional mean; rescaling
it is not), while attention averages value errors over many tokens, so whether values gain from it
is a question of its own. The config has one `renorm` for both roles; this swaps the value codec
for one without it, in this process only.
"""

from __future__ import annotations

import argparse
import sys

import veloxquant_mlx.methods.turboquant_mse as turboquant_mse
from veloxquant_mlx.cli import main


def plain_value_codec(cls, config, dim, params=None):
    return turboquant_mse.MSECodec(dim, config.value_bits, config.seed + 1, params, False)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variant", choices=("values-plain", "default"))
    parser.add_argument("--text", default="../shared/data/wikitext2-test.txt")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.variant == "values-plain":
        turboquant_mse.TurboQuantMSE.value_codec = classmethod(plain_value_codec)
    sys.exit(main(["eval", "ppl", "--text", args.text, "--skip-tokens", "200000", "--ctx", "2048", "--windows", "1",
                   "--chunk", "512", "--no-figures", "--no-progress", "--min-free-gb", "0.5",
                   "--methods", "fp16,vq4,vq3,vq2", "--out", args.out]))
