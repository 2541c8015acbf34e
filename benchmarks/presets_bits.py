"""Bits per coordinate of the presets' (or any specs') caches at several contexts, from the caches' bytes.

    PYTHONPATH=. python benchmarks/presets_bits.py --specs vq4,vq3,vq2 --contexts 2048,2049,2304,3000,4096,8192 \
        --out benchmarks/results/presets-bits

The caches of SmolLM2's layout are filled with random keys and values in 512-token chunks (`presets.measured_bits`):
the bytes depend on the token count only. `used` leaves out the store's spare capacity (it grows in 256-token
steps); `allocated` (what `veloxquant eval ppl` reports) includes it.
"""

import argparse

from veloxquant_mlx.evaluation.results import write_json_and_markdown
from veloxquant_mlx.evaluation.specs import parse_method_list
from veloxquant_mlx.models import load_model
from veloxquant_mlx.presets import PRESET_BITS, measured_bits


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--specs", default="vq4,vq3,vq2")
    parser.add_argument("--contexts", default="2048,2049,2304,3000,4096,8192")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    model, _ = load_model(args.model)
    contexts = [int(c) for c in args.contexts.split(",")]
    records = []
    for spec in parse_method_list(args.specs):
        bits = measured_bits(spec.config, model, contexts)
        records.append({"spec": spec.label, "config": spec.config.describe(), "stated_bits": PRESET_BITS.get(spec.label),
                        "bits_used": {str(c): round(b, 4) for c, b in bits.items()},
                        "max_from_2048": round(max(b for c, b in bits.items() if c >= 2048), 4)})
        print(records[-1], flush=True)
    lines = [f"Bits per coordinate from the caches' used bytes (`{args.model}` layout, random fill), by context.", "",
             "| preset/spec | config | stated | " + " | ".join(str(c) for c in contexts) + " | max over >= 2048 |",
             "|---" * (len(contexts) + 4) + "|"]
    for r in records:
        stated = "—" if r["stated_bits"] is None else f"<= {r['stated_bits']:g}"
        lines.append(f"| `{r['spec']}` | {r['config']} | {stated} | "
                     + " | ".join(f"{r['bits_used'][str(c)]:.3f}" for c in contexts) + f" | {r['max_from_2048']:.3f} |")
    write_json_and_markdown(args.out, {"args": vars(args), "records": records}, lines)


if __name__ == "__main__":
    main()
