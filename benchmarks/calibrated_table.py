"""One table over the calibrated-methods perplexity runs, sorted by effective bits.

    python benchmarks/calibrated_table.py benchmarks/results/calib-ppl-* --calibration \
        benchmarks/results/calib-ppl/calibration.json --out benchmarks/results/calib-summary

Reads each folder's results.json (`veloxquant eval ppl`, same text, context and windows), keeps
rows that completed every window, and adds each configuration's calibration seconds (capture +
learn, from `calibrated_artifacts.py`). Writes results.json + results.md.
"""

import argparse
import json
from pathlib import Path


def short(spec: str) -> str:
    return spec.split(",artifacts=")[0].split(":artifacts=")[0]


MODEL_NAMES = {"smollm2": "SmolLM2-135M", "gemma3-270m": "Gemma 3 270M"}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("folders", nargs="+")
    parser.add_argument("--calibration", required=True, nargs="+", help="calibration.json files")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    seconds = {short(c["spec"]): c["calibration_seconds"] for path in args.calibration
               for c in json.loads(Path(path).read_text())["configs"].values()}
    rows, settings, fp16 = [], None, None
    for folder in args.folders:
        result = json.loads((Path(folder) / "results.json").read_text())
        run = {k: result["args"].get(k) for k in ("ctx", "windows", "chunk", "text")}
        run["model"] = result.get("model", {}).get("name", "smollm2")
        if settings is None:
            settings = run
        if run != settings:
            raise SystemExit(f"{folder} ran {run}, not {settings}: not one table")
        for r in result["records"]:
            if r["status"] != "ok" or r.get("windows_completed") != settings["windows"]:
                continue
            if r["label"] == "fp16":
                if fp16 is not None and abs(fp16 - r["perplexity"]) > 1e-6:
                    raise SystemExit(f"{folder}: fp16 perplexity {r['perplexity']} != {fp16}")
                fp16 = r["perplexity"]
                if any(row["method"] == "fp16" for row in rows):
                    continue
            label = short(r["spec"])
            rows.append({"method": label, "bits_per_coord": r["bits_per_coord"], "perplexity": r["perplexity"],
                         "kl_mean": r["kl_mean"], "top1": r["top1_agreement"],
                         "calibration_seconds": seconds.get(label), "folder": folder})
    for row in rows:
        row["delta_ppl"] = row["perplexity"] / fp16 - 1
    rows.sort(key=lambda r: (r["method"] != "fp16", r["bits_per_coord"], r["kl_mean"]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"settings": settings, "rows": rows}, indent=2))
    model = MODEL_NAMES.get(settings["model"], settings["model"])
    lines = [f"{model}, `{Path(settings['text']).name}`, {settings['windows']} windows of {settings['ctx']} "
             f"tokens (chunks of {settings['chunk']}, second halves scored). Bits per coordinate from the caches' "
             f"bytes; KL and top-1 against fp16; calibration seconds = capture + learn on a shared, loaded CPU.",
             "", "| method | bits/coord | PPL | ΔPPL | KL mean | top-1 | calibration s |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        cal = "—" if r["calibration_seconds"] is None else f"{r['calibration_seconds']:.0f}"
        bits = f"{r['bits_per_coord']:.2f}"
        lines.append(f"| `{r['method']}` | {bits} | {r['perplexity']:.2f} | {100 * r['delta_ppl']:+.2f}% | "
                     f"{r['kl_mean']:.4f} | {100 * r['top1']:.1f}% | {cal} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
