"""Score error of RaBitQ keys against TurboQuant-MSE's at the same code bits, on Gaussian vectors.

For 4 heads x 1024 keys and 16 queries of N(0, I_64): the RMS error of the estimated scores
q.k over the RMS score, and the bias slope E[(est - true) true] / E[true^2] (0: unbiased,
-0.36: every score shrunk by 36%).

    PYTHONPATH=. python benchmarks/rabitq_score_error.py --out benchmarks/results/rabitq-score-error
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx

from veloxquant_mlx.methods.rabitq import RaBitQCodec
from veloxquant_mlx.methods.turboquant_mse import MSECodec


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    k = mx.random.normal((1, 4, 1024, 64), key=mx.random.key(5))
    q = mx.random.normal((1, 4, 16, 64), key=mx.random.key(6))
    true = q @ k.swapaxes(-1, -2)
    scale = mx.sqrt(mx.mean(true * true)).item()

    def stats(est):
        err = est - true
        return {"rms_error": mx.sqrt(mx.mean(err * err)).item() / scale,
                "bias_slope": mx.mean(err * true).item() / scale**2}

    rows = []
    for bits in (1, 2, 3, 4):
        rabitq = RaBitQCodec(64, bits, 0)
        row = {"bits": bits, "rabitq": stats(rabitq.score(rabitq.to_domain(q), rabitq.encode(k)))}
        for name, codec in (("turboquant_mse", MSECodec(64, bits, 0)), ("turboquant_mse_renorm", MSECodec(64, bits, 0, renorm=True))):
            row[name] = stats(q @ codec.reconstruct(codec.encode(k)).swapaxes(-1, -2))
        rows.append(row)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
    lines = ["Score error on N(0, I_64) keys and queries (4 x 1024 keys, 16 queries): RMS error / RMS score, "
             "and bias slope (0 = unbiased).", "",
             "| key bits | rabitq RMS | rabitq bias | turboquant_mse RMS | turboquant_mse bias | "
             "turboquant_mse renorm RMS | renorm bias |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{r[m][s]:.4f}" for m in ("rabitq", "turboquant_mse", "turboquant_mse_renorm") for s in ("rms_error", "bias_slope")]
        lines.append(f"| {r['bits']} | " + " | ".join(cells) + " |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
