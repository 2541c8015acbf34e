"""One table of every row of several `veloxquant eval ppl` runs (each run's own results.json), sorted by bits.

    PYTHONPATH=. python benchmarks/sweep_summary.py --runs benchmarks/results/kv-quality-sweep/* \
        --out benchmarks/results/kv-quality-sweep

Rows keep their run's name, so a figure can be traced to the folder (and its `args.methods`) that measured it.
Runs over different tokens must not be mixed: the script refuses runs whose text, skip, ctx or windows differ.
"""

import argparse
import json
from pathlib import Path

PROTOCOL = ("text", "skip_tokens", "ctx", "windows", "chunk")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", required=True, help="folders holding an eval ppl results.json")
    parser.add_argument("--out", required=True)
    parser.add_argument("--title", default="")
    args = parser.parse_args()
    rows, protocol = [], None
    for run in sorted(Path(r) for r in args.runs):
        path = run / "results.json"
        if not path.is_file():
            continue
        data = json.loads(path.read_text())
        mine = {k: data["args"].get(k) for k in PROTOCOL}
        if protocol is None:
            protocol = mine
        elif mine != protocol:
            raise SystemExit(f"{run} measured other tokens ({mine}) than the first run ({protocol})")
        for r in data["records"]:
            if r["label"] == "fp16" and rows and any(x["label"] == "fp16" for x in rows):
                continue  # one fp16 row: every run's is the same reference
            rows.append({"run": run.name, "label": r["label"], "status": r["status"], "error": r.get("error"),
                         "bits_per_coord": r.get("bits_per_coord"), "perplexity": r.get("perplexity"),
                         "kl_mean": r.get("kl_mean"), "kl_p99": r.get("kl_p99"), "top1": r.get("top1_agreement")})
    fp16 = next(r["perplexity"] for r in rows if r["label"] == "fp16")
    for r in rows:
        r["delta_ppl"] = None if r["perplexity"] is None else r["perplexity"] / fp16 - 1
    done = sorted((r for r in rows if r["perplexity"] is not None), key=lambda r: (-r["bits_per_coord"], r["kl_mean"]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps({"args": vars(args), "protocol": protocol, "rows": rows}, indent=2) + "\n")
    lines = [args.title or (f"SmolLM2-135M, `{Path(protocol['text']).name}` from token {protocol['skip_tokens']}: "
                            f"{protocol['windows']} window(s) of {protocol['ctx']} tokens, chunks of {protocol['chunk']}, "
                            "second half scored. Bits/coord: the caches' allocated bytes at the end of the window "
                            "(what `eval ppl` reports). KL and top-1 against fp16."), "",
             "| run | spec | bits/coord | PPL | ΔPPL | KL mean | KL p99 | top-1 |", "|---|---|---|---|---|---|---|---|"]
    for r in done:
        lines.append(f"| {r['run']} | `{r['label']}` | {r['bits_per_coord']:.2f} | {r['perplexity']:.2f} | "
                     f"{100 * r['delta_ppl']:+.2f}% | {r['kl_mean']:.4f} | {r['kl_p99']:.4f} | {100 * r['top1']:.1f}% |")
    failed = [r for r in rows if r["perplexity"] is None]
    if failed:
        lines += ["", "Did not finish:", ""] + [f"* {r['run']} `{r['label']}`: {r['error'] or 'stopped'}" for r in failed]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
