"""One quality table from `veloxquant eval ppl` / `eval needle` folders and `benchmarks/llama_cpp_kv.py`'s folder.

    PYTHONPATH=. python benchmarks/quality_table.py --ppl benchmarks/results/quality-table-ppl-baselines \
        benchmarks/results/quality-table-ppl-presets --needle benchmarks/results/quality-table-needle \
        --llama-cpp benchmarks/results/quality-table-llama-cpp --bits benchmarks/results/presets-bits \
        --out benchmarks/results/quality-table-summary

Rows are sorted by bits per coordinate. Our rows' ΔPPL / KL are against mlx-lm's KVCache (float32 on this CPU)
in the same eval run; llama.cpp's against its own f16 cache on the same tokens. Where several ppl folders hold
the same label (fp16 in each), the first one's record is kept; every folder must have scored the same windows.
Needle folders of the same cache (say 1K-2K in one run, 4K-8K in another) add up: the share is of all their cells.
"""

import argparse
import json
from pathlib import Path


MODEL_NAMES = {"smollm2": "SmolLM2-135M", "gemma3-270m": "Gemma 3 270M"}


def load(folder):
    return json.loads((Path(folder) / "results.json").read_text())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ppl", nargs="+", required=True)
    parser.add_argument("--needle", nargs="*", default=[])
    parser.add_argument("--llama-cpp", default=None)
    parser.add_argument("--bits", default=None, help="benchmarks/presets_bits.py folder (used bytes, max from 2K)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    rows, settings = {}, None
    for folder in args.ppl:
        data = load(folder)
        mine = {k: data["settings"][k] for k in ("ctx", "windows", "chunk", "text_source")}
        mine["model"] = data["args"].get("model", "smollm2")
        # eval ppl's records with kv_allocated_bytes count the bytes the tokens hold, not the allocation.
        mine["held_bits"] = any("kv_allocated_bytes" in r for r in data["records"])
        mine["skip_tokens"] = data["settings"].get("skip_tokens", 0)
        if settings is not None and mine != settings:
            raise ValueError(f"{folder} scored other windows: {mine} vs {settings}")
        settings = mine
        fp16 = next(r for r in data["records"] if r["label"] == "fp16")
        for r in data["records"]:
            if r["label"] in rows or r.get("status") != "ok" or r.get("perplexity") is None:
                continue
            rows[r["label"]] = {"cache": r["label"], "engine": "mlx-lm" if r["kind"] == "baseline" else "veloxquant",
                                "bits_allocated": r["bits_per_coord"], "ppl": r["perplexity"],
                                "delta_ppl": r["perplexity"] / fp16["perplexity"] - 1, "kl": r["kl_mean"],
                                "top1": r["top1_agreement"], "source": Path(folder).name}
    if args.bits:
        for r in load(args.bits)["records"]:
            if r["spec"] in rows:
                rows[r["spec"]]["bits_used_max_2k"] = r["max_from_2048"]
                rows[r["spec"]]["config"] = r["config"]
    needle_lengths = set()
    for folder in args.needle:
        for r in load(folder)["records"]:
            if r["label"] in rows and r.get("accuracy") is not None:
                row = rows[r["label"]]
                cells = [c for c in r["cells"] if c.get("status") == "ok"]
                row["needle_cells"] = row.get("needle_cells", 0) + len(cells)
                row["needle_correct"] = row.get("needle_correct", 0) + sum(bool(c["correct"]) for c in cells)
                row["needle"] = row["needle_correct"] / row["needle_cells"]
                row.setdefault("needle_grids", []).append(r.get("grid"))
                needle_lengths.update(c["length"] for c in cells)
    lengths = " / ".join(f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in sorted(needle_lengths))
    if args.llama_cpp:
        data = load(args.llama_cpp)
        if data["args"].get("model", "smollm2") != settings["model"]:
            raise ValueError(f"{args.llama_cpp} ran {data['args'].get('model')}, the ppl folders {settings['model']}")
        for r in data["records"]:
            label = f"llama.cpp {r['type_k']}/{r['type_v']}" + ("" if r["rotation"] or r["type_k"] == "f16" else " no rotation")
            rows[label] = {"cache": label, "engine": "llama.cpp", "bits_allocated": r["bits_per_coord"],
                           "ppl": r["perplexity"], "delta_ppl": r["delta_ppl"], "kl": r["kl_mean"],
                           "top1": r["top1_agreement"], "source": Path(args.llama_cpp).name}
    ordered = sorted(rows.values(), key=lambda r: -r["bits_allocated"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "settings": settings, "rows": ordered},
                                                 indent=2) + "\n")
    lines = [f"{MODEL_NAMES.get(settings['model'], settings['model'])}, `{settings['text_source']}`: {settings['windows']} window(s) of {settings['ctx']} tokens "
             f"from token {settings['skip_tokens']}, chunks of {settings['chunk']}, second half scored. ΔPPL and KL: ours "
             "and mlx-lm's against mlx-lm's KVCache in the same run, llama.cpp's against its own f16 cache on the same "
             "tokens. Bits/coord: " + ("the bytes the caches' tokens hold at the end of a window (spare capacity left "
             "out, floating-point elements at 2 bytes; " if settings["held_bits"] else
             "the caches' allocated bytes at the end of a window (") + "llama.cpp: ggml's block layout); "
             "'max used >= 2K': the presets' used bytes, the most at any context from 2048 tokens "
             f"(`presets-bits`). Needle: share of the (length, depth) cells answered, of 5 depths at "
             f"{lengths or '-'} tokens (cells the runs finished).", "",
             "| cache | engine | bits/coord | max used >= 2K | PPL | ΔPPL | KL mean | top-1 | needle |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in ordered:
        used = f"{r['bits_used_max_2k']:.2f}" if "bits_used_max_2k" in r else "—"
        needle = f"{r['needle']:.2f} ({r['needle_cells']} cells)" if "needle" in r else "—"
        lines.append(f"| `{r['cache']}` | {r['engine']} | {r['bits_allocated']:.2f} | {used} | {r['ppl']:.2f} | "
                     f"{100 * r['delta_ppl']:+.2f}% | {r['kl']:.4f} | {100 * r['top1']:.1f}% | {needle} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
