"""PNG figures of results (matplotlib is imported only here, and only when drawing)."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError("figures need matplotlib: pip install matplotlib (or pass --no-figures)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _title(results: Dict, what: str) -> str:
    env = results.get("environment", {})
    model = results.get("model", {}).get("name", "")
    return f"{what} — {model} ({env.get('backend', '?')})"


def _ok(records: List[Dict], *keys) -> List[Dict]:
    return [r for r in records if r.get("status") == "ok" and all(r.get(k) is not None for k in keys)]


def _save(plt, fig, out_dir, name: str, dpi: int = 120) -> str:
    fig.tight_layout()
    fig.savefig(Path(out_dir) / name, dpi=dpi)
    plt.close(fig)
    return name


def _pareto_front(points):
    """Points (x, y) not beaten by any other with x' <= x and y' <= y."""
    front, best = [], float("inf")
    for x, y in sorted(points):
        if y < best:
            front.append((x, y))
            best = y
    return front


def ppl_figure(results: Dict, out_dir) -> List[str]:
    """Perplexity and KL vs bits per coordinate; baselines as squares, ours as circles."""
    plt = _pyplot()
    records = _ok(results["records"], "bits_per_coord", "perplexity")
    if not records:
        return []
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, key, label in ((axes[0], "perplexity", "perplexity"), (axes[1], "kl_mean", "KL(fp16 || method), mean")):
        points = [(r["bits_per_coord"], r[key]) for r in records if r.get(key) is not None]
        for r in records:
            if r.get(key) is None:
                continue
            baseline = r["kind"] == "baseline"
            ax.scatter(r["bits_per_coord"], r[key], marker="s" if baseline else "o",
                       color="tab:gray" if baseline else "tab:blue", zorder=3)
            ax.annotate(r["label"], (r["bits_per_coord"], r[key]), textcoords="offset points",
                        xytext=(4, 4), fontsize=8)
        front = _pareto_front(points)
        if len(front) > 1:
            ax.plot(*zip(*front), color="tab:orange", lw=1, ls="--", zorder=2, label="Pareto front")
            ax.legend(loc="upper right", fontsize=8)
        fp16 = next((r for r in records if r["label"] == "fp16"), None)
        if key == "perplexity" and fp16 is not None:
            ax.axhline(fp16["perplexity"], color="tab:gray", lw=0.8, ls=":", zorder=1)
        xs = [x for x, _ in points]
        ax.set_xscale("log", base=2)
        ticks = [t for t in (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32) if min(xs) / 1.2 <= t <= max(xs) * 1.2]
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("bits per KV coordinate (measured live bytes)")
        ax.set_ylabel(label)
        if key == "perplexity":
            ys = [y for _, y in points]
            ax.set_yscale("log")
            steps = [m * 10**e for e in range(0, 6) for m in (1, 1.5, 2, 3, 5, 7)]
            yticks = [t for t in steps if min(ys) / 1.15 <= t <= max(ys) * 1.15]
            ax.set_yticks(yticks, [f"{t:g}" for t in yticks])
            ax.minorticks_off()
        elif any(y > 0 for _, y in points):
            ax.set_yscale("symlog", linthresh=1e-3)
            ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    s = results.get("settings", {})
    fig.suptitle(_title(results, f"Quality vs KV size, ctx {s.get('ctx')} x {s.get('windows')} windows "
                                 "(squares: mlx-lm baselines)"))
    return [_save(plt, fig, out_dir, "ppl_pareto.png")]


def needle_figures(results: Dict, out_dir) -> List[str]:
    plt = _pyplot()
    names = []
    for r in results["records"]:
        grid = r.get("grid")
        if not grid:
            continue
        values = [[float("nan") if v is None else v for v in row] for row in grid["accuracy"]]
        fig, ax = plt.subplots(figsize=(1.2 + 1.1 * len(grid["lengths"]), 1.2 + 0.6 * len(grid["depths"])))
        image = ax.imshow(values, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(grid["lengths"])), [str(n) for n in grid["lengths"]])
        ax.set_yticks(range(len(grid["depths"])), [f"{d:g}" for d in grid["depths"]])
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("needle depth")
        for i, row in enumerate(grid["accuracy"]):
            for j, v in enumerate(row):
                ax.text(j, i, "—" if v is None else f"{v:.2f}", ha="center", va="center", fontsize=8)
        accuracy = r.get("accuracy")
        ax.set_title(f"{r['label']}: {'n/a' if accuracy is None else f'{accuracy:.2f}'}", fontsize=10)
        fig.colorbar(image, ax=ax, fraction=0.05)
        names.append(_save(plt, fig, out_dir, f"needle_{_safe(r['label'])}.png", dpi=110))
    return names


def _lines(ax, records: List[Dict], key: str, scale: float = 1.0):
    labels = list(dict.fromkeys(r["label"] for r in records))
    for label in labels:
        rows = sorted((r["context"], r[key] * scale) for r in records if r["label"] == label)
        baseline = next(r["kind"] for r in records if r["label"] == label) == "baseline"
        ax.plot(*zip(*rows), marker="s" if baseline else "o", ls="--" if baseline else "-", label=label)
    ax.set_xscale("log", base=2)
    contexts = sorted({r["context"] for r in records})
    ax.set_xticks(contexts, [f"{c // 1024}k" if c % 1024 == 0 else str(c) for c in contexts])
    ax.minorticks_off()
    ax.set_xlabel("context (tokens)")
    ax.grid(alpha=0.3)


def benchmark_figures(results: Dict, out_dir) -> List[str]:
    plt = _pyplot()
    records = _ok(results["records"], "prefill_tokens_per_s")
    if not records:
        return []
    names = []
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    _lines(axes[0], records, "prefill_tokens_per_s")
    axes[0].set_ylabel("prefill tokens/s")
    decode = [r for r in records if r.get("decode_tokens_per_s") is not None]
    if decode:
        _lines(axes[1], decode, "decode_tokens_per_s")
    axes[1].set_ylabel("decode tokens/s")
    axes[0].legend(fontsize=8)
    fig.suptitle(_title(results, "Speed vs context (dashed: mlx-lm baselines)"))
    names.append(_save(plt, fig, out_dir, "speed_vs_context.png"))

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    _lines(axes[0], records, "kv_bytes", 1 / 2**20)
    axes[0].set_ylabel("KV cache (MiB, live buffers)")
    axes[0].set_yscale("log")
    _lines(axes[1], records, "peak_memory_bytes", 1 / 2**20)
    axes[1].set_ylabel("peak memory (MiB, weights included)")
    axes[0].legend(fontsize=8)
    fig.suptitle(_title(results, "Memory vs context"))
    names.append(_save(plt, fig, out_dir, "memory_vs_context.png"))
    return names


def _safe(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in label)


def draw_figures(results: Dict, out_dir) -> List[str]:
    """Draw the figures of `results` into `out_dir`; returns their file names."""
    drawers = {"eval ppl": ppl_figure, "eval needle": needle_figures, "benchmark": benchmark_figures}
    drawer: Optional[callable] = drawers.get(results.get("command"))
    return drawer(results, out_dir) if drawer else []
