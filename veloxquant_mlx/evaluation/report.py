"""Markdown from results.json (results.md beside it, `save_results`), and README sections rewritten
from it, so that no number in the README is typed by hand."""

from __future__ import annotations

import json
import os
import re
import statistics
from pathlib import Path
from typing import Any, Dict, List, Optional

from .results import RESULTS_JSON, RESULTS_MD, _jsonable, load_results

MIB = 2**20


def _num(value, digits: int = 2, suffix: str = "") -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        if value != 0 and (abs(value) < 10 ** -digits or abs(value) >= 1e6):
            return f"{value:.{digits}e}{suffix}"
        return f"{value:.{digits}f}{suffix}"
    return f"{value}{suffix}"


def _mib(nbytes) -> str:
    return "—" if nbytes is None else f"{nbytes / MIB:.2f}"


def _status(record: Dict) -> str:
    status = record.get("status", "?")
    if status == "ok":
        return "ok"
    error = (record.get("error") or "").replace("|", "\\|").replace("\n", " ")
    return f"{status}: {error[:120]}" if error else status


def _table(header: List[str], rows: List[List[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _context_line(results: Dict) -> str:
    env = results.get("environment", {})
    model = results.get("model", {})
    device = env.get("device_info", {}).get("device_name") or env.get("device", "")
    parts = [
        f"model `{model.get('name', '?')}`",
        f"backend {env.get('backend', '?')} ({device})".replace(" ()", "")
        + (f", {env['kernels']} decode kernels" if env.get("kernels") else ""),
        f"mlx {env.get('mlx', '?')}, mlx-lm {env.get('mlx_lm', '?')}",
        results.get("timestamp", ""),
    ]
    if not results.get("complete", True):
        parts.append("**incomplete run**")
    return "_" + "; ".join(p for p in parts if p) + "_"


def _ppl(results: Dict) -> str:
    s = results.get("settings", {})
    fp16 = next((r for r in results["records"] if r["label"] == "fp16" and r.get("perplexity")), None)
    rows = []
    for r in results["records"]:
        ppl = r.get("perplexity")
        delta = (f"{100 * (ppl / fp16['perplexity'] - 1):+.2f}%" if ppl is not None and fp16 else "—")
        rows.append([
            f"`{r['label']}`" + (" (mlx-lm)" if r.get("kind") == "baseline" else ""),
            _num(r.get("bits_per_coord")),
            _mib(r.get("kv_bytes")),
            _num(r.get("compression_vs_fp16"), 2, "x"),
            _num(ppl, 2),
            delta,
            _num(r.get("kl_mean"), 4),
            _num(r.get("kl_p99"), 4),
            _num(None if r.get("top1_agreement") is None else 100 * r["top1_agreement"], 1, "%"),
            _status(r),
        ])
    text = (
        f"Perplexity on `{s.get('text_source', '?')}`: {s.get('windows')} window(s) of {s.get('ctx')} tokens, "
        f"fed in chunks of {s.get('chunk')}, second half of each window scored "
        f"({s.get('scored_tokens', '?')} tokens). KL and top-1 are against the fp16 run; "
        "bits/coord and MiB are the bytes the caches' tokens hold at the end of a window (spare capacity left "
        "out, floating-point elements at 2 bytes: fp16 = 16.00); vs fp16 is fp16's bytes over these."
    )
    table = _table(["method", "bits/coord", "KV MiB", "vs fp16", "PPL", "ΔPPL", "KL mean", "KL p99",
                    "top-1", "status"], rows)
    return f"{text}\n\n{table}"


def _needle(results: Dict) -> str:
    s = results.get("settings", {})
    lengths = s.get("lengths", [])
    rows = []
    for r in results["records"]:
        by_length = []
        grid = r.get("grid", {})
        for j, _ in enumerate(grid.get("lengths", [])):
            column = [row[j] for row in grid.get("accuracy", []) if row[j] is not None]
            by_length.append(_num(sum(column) / len(column), 2) if column else "—")
        rows.append([f"`{r['label']}`" + (" (mlx-lm)" if r.get("kind") == "baseline" else ""),
                     _num(r.get("accuracy"), 2), *by_length, _num(r.get("bits_per_coord")), _status(r)])
    text = (
        f"Needle in a haystack: depths {', '.join(f'{d:g}' for d in s.get('depths', []))}, "
        f"{s.get('trials', 1)} trial(s) per cell, greedy decoding; score = share of answers "
        "containing the passcode."
    )
    table = _table(["method", "accuracy", *[f"{n} tok" for n in lengths], "bits/coord", "status"], rows)
    return f"{text}\n\n{table}"


def _benchmark(results: Dict) -> str:
    s = results.get("settings", {})
    fp16 = {r.get("context"): r for r in results["records"] if r.get("label") == "fp16" and r.get("status") == "ok"}

    def ratio(r, key):
        base = fp16.get(r.get("context"), {}).get(key)
        return f"{r[key] / base:.2f}x" if r.get(key) and base else "—"

    def round_ratios(r, key):
        """fp16's time over this method's, round by round (the methods take turns, so round i of
        each ran next to the other's): the spread that a median of a noisy machine hides."""
        base = fp16.get(r.get("context"), {}).get("runs") or []
        runs = r.get("runs") or []
        ratios = [b[key] / m[key] for m, b in zip(runs, base) if m.get(key) and b.get(key)]
        if r.get("status") != "ok" or len(ratios) < 2 or len(runs) != len(base):
            return "—"
        return f"{min(ratios):.2f}-{max(ratios):.2f}x"

    def step_ms(r):
        """Median decode step and, of it, the host's share (building the next step's graph and
        launching it, with the step before still running): equal when the host is the limit."""
        runs = [m for m in (r.get("runs") or []) if m.get("decode_build_s")]
        if r.get("status") != "ok" or not runs:
            return "—"
        step = statistics.median(t for m in runs for t in m["decode_token_intervals_s"][1:])
        host = statistics.median(b + d for m in runs for b, d in zip(m["decode_build_s"], m["decode_dispatch_s"]))
        return f"{1000 * step:.2f} / {1000 * host:.2f}"

    with_paths = any(r.get("decode_paths") for r in results["records"])
    with_rounds = any(len(r.get("runs") or []) > 1 for r in results["records"])
    with_host = any(m.get("decode_build_s") for r in results["records"] for m in (r.get("runs") or []))
    rows = []
    for r in results["records"]:
        row = [
            f"`{r['label']}`" + (" (mlx-lm)" if r.get("kind") == "baseline" else ""),
            str(r.get("context")),
            _num(r.get("prefill_tokens_per_s"), 1),
            ratio(r, "prefill_tokens_per_s"),
            _num(r.get("decode_tokens_per_s"), 1),
            ratio(r, "decode_tokens_per_s"),
            *([round_ratios(r, "decode_s")] if with_rounds else []),
            *([step_ms(r)] if with_host else []),
            _mib(r.get("kv_bytes")),
            _num(r.get("bits_per_coord")),
            _mib(r.get("peak_memory_bytes")),
            str(r.get("repeats_done", 0)),
        ]
        if with_paths:
            row.append(", ".join(r.get("decode_paths") or []) or ("mlx-lm" if r.get("kind") == "baseline" else "—"))
        rows.append(row + [_status(r)])
    batch = s.get("batch", 1)
    text = (
        f"Speed and memory, {s.get('model_source', '?')}, activations {s.get('dtype', '?')}, "
        f"weights {s.get('weights', '?')}" + (f", batch {batch} (tok/s count every row)" if batch and batch > 1 else "")
        + f"; median of up to {s.get('repeats')} runs after "
        f"{s.get('warmup', 1)} untimed warm-up run(s) of the same shapes, methods taking turns; "
        f"decode = {s.get('decode_tokens')} tokens after the prompt; peak memory includes the weights; "
        "ratios against the fp16 row of the same context and run"
        + ("; 'per round': the lowest and highest of the decode ratios of each round's turns" if with_rounds else "")
        + ("; 'step / host ms': the median decode step and the median host time of one (building and launching "
           "the next step while this one runs; when the two are equal, the host is the limit)" if with_host else "")
        + "."
    )
    header = (["method", "context", "prefill tok/s", "vs fp16", "decode tok/s", "vs fp16"]
              + (["per round"] if with_rounds else []) + (["step / host ms"] if with_host else [])
              + ["KV MiB", "bits/coord", "peak MiB", "runs"] + (["decode path"] if with_paths else []) + ["status"])
    return f"{text}\n\n{_table(header, rows)}"


RENDERERS = {"eval ppl": _ppl, "eval needle": _needle, "benchmark": _benchmark}


def render_markdown(results: Dict, results_dir=None, link_dir=None) -> str:
    """Markdown table(s) and figure links for one results document. Figure paths are
    written relative to `link_dir` (where the Markdown will live)."""
    renderer = RENDERERS.get(results.get("command"))
    if renderer is None:
        raise ValueError(f"no report for command {results.get('command')!r}")
    parts = [renderer(results), _context_line(results)]
    if results_dir is not None:
        for name in results.get("figures", []):
            path = Path(results_dir) / name
            link = os.path.relpath(path, link_dir) if link_dir is not None else str(path)
            parts.append(f"![{Path(name).stem}]({Path(link).as_posix()})")
    return "\n\n".join(parts)


def save_results(out_dir, results: Dict[str, Any]) -> Path:
    """Write results.json (atomically) and results.md; safe to call after every record."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / RESULTS_JSON
    staging = path.with_suffix(".json.tmp")
    staging.write_text(json.dumps(_jsonable(results), indent=2, allow_nan=False) + "\n")
    staging.replace(path)
    (out_dir / RESULTS_MD).write_text(render_markdown(results, out_dir, out_dir) + "\n")
    return path


def markers(name: str):
    return f"<!-- results:{name}:start -->", f"<!-- results:{name}:end -->"


def replace_section(document: str, name: str, content: str) -> str:
    start, end = markers(name)
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    if not pattern.search(document):
        raise ValueError(f"markers {start} ... {end} not found")
    return pattern.sub(lambda _: f"{start}\n{content.strip()}\n{end}", document, count=1)


def update_readme(readme, name: str, content: str) -> None:
    readme = Path(readme)
    if not readme.is_file():
        raise FileNotFoundError(f"README not found: {readme}")
    readme.write_text(replace_section(readme.read_text(), name, content))


def report(results_dirs: List[str], readme: Optional[str] = None, name: Optional[str] = None) -> str:
    """Markdown for one or more results folders; with `readme`, also written between the
    `<!-- results:NAME:start/end -->` markers there (NAME defaults to the command, e.g. ppl)."""
    link_dir = Path(readme).resolve().parent if readme else Path.cwd()
    sections, commands = [], []
    for directory in results_dirs:
        results = load_results(directory)
        results_dir = Path(directory) if Path(directory).is_dir() else Path(directory).parent
        sections.append(render_markdown(results, results_dir.resolve(), link_dir))
        commands.append(results["command"].split()[-1])
    markdown = "\n\n".join(sections)
    if readme:
        update_readme(readme, name or "-".join(dict.fromkeys(commands)), markdown)
    return markdown
