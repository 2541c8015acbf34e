"""Reservoir and quantize_model costs on SmolLM2: quantize time and peak memory, reservoir size,
load time, bit-identical logits, and page sharing between two processes loading one reservoir.

    python benchmarks/weights_reservoir.py --bits 2,3,4 --out benchmarks/results/weights-reservoir-smollm2

Times are wall-clock and CPU (process) time: on a shared machine the wall-clock ratio moves with
the load, the CPU-time one much less. Peak memory is MLX's allocator peak (`mx.get_peak_memory`, reset before quantizing) against the
model's parameter bytes before quantizing; `ru_maxrss` is the process's whole resident peak.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from veloxquant_mlx.models import load_model
from veloxquant_mlx.weights import graft_reservoir, load_reservoir, quantize_model, quantized_layers, save_reservoir
from veloxquant_mlx.weights.model import linear_paths

_CHILD = r"""
import mmap, sys, time, mlx.core as mx, numpy as np
from veloxquant_mlx.weights import load_reservoir
from veloxquant_mlx.weights.reservoir import _NUMPY, read_header
mode = sys.argv[3]
if mode == "copied":  # load_reservoir
    layers, _ = load_reservoir(sys.argv[1])
    mx.eval([l.parameters() for l in layers.values()])
elif mode == "mapped":  # the candidate zero-copy path: mx.from_dlpack of views of a file mapping
    header, start = read_header(sys.argv[1])
    f = open(sys.argv[1], "rb")
    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    arrays = [mx.from_dlpack(np.frombuffer(mm, dtype=_NUMPY[t["dtype"]], count=t["nbytes"] // np.dtype(_NUMPY[t["dtype"]]).itemsize,
                                           offset=start + t["offset"]))
              for e in header["layers"].values() for t in e["tensors"].values()]
    mx.eval(arrays)
# "none": the baseline, same imports, nothing loaded
print("loaded", flush=True)
time.sleep(float(sys.argv[2]))
"""


def _param_bytes(model) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def _smaps(pid: int) -> dict:
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        fields[key] = int(value.split()[0]) * 1024
    return fields


def page_sharing(path: Path, hold: float = 6.0) -> dict:
    """Start two processes that load the same reservoir and a baseline one that loads nothing;
    read their smaps while all hold on."""
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    modes = ("mapped", "mapped", "copied", "copied", "none")
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD, str(path), str(hold), mode], stdout=subprocess.PIPE,
                              env=env) for mode in modes]
    for p in procs:
        assert p.stdout.readline().strip() == b"loaded"
    stats = [_smaps(p.pid) for p in procs]
    for p in procs:
        p.wait()
    keys = ("Rss", "Pss", "Shared_Clean", "Shared_Dirty", "Private_Clean", "Private_Dirty")
    return {"file_bytes": path.stat().st_size,
            "processes": [{"mode": m, **{k: s.get(k, 0) for k in keys}} for m, s in zip(modes, stats)]}


def run(bits: int, args, workdir: Path) -> dict:
    model, _ = load_model(args.model)
    mx.eval(model.parameters())
    model_bytes = _param_bytes(model)
    modules = dict(model.named_modules())
    largest_layer = max(modules[p].weight.nbytes for p in linear_paths(model))
    del modules
    mx.reset_peak_memory()
    start, cpu_start = time.perf_counter(), time.process_time()
    quantize_model(model, bits, seed=args.seed, progress=False)
    mx.eval(model.parameters())
    quantize_s, quantize_cpu = time.perf_counter() - start, time.process_time() - cpu_start
    peak = mx.get_peak_memory()
    tokens = mx.array([list(range(1, 65))])
    logits = model(tokens)
    mx.eval(logits)
    path = workdir / f"smollm2-{bits}bit.vqw"
    start = time.perf_counter()
    save_reservoir(model, path)
    save_s = time.perf_counter() - start
    layers = quantized_layers(model)
    codes_bytes = sum(l.codes.nbytes for _, l in layers)
    stored_bytes = sum(l.storage_nbytes() for _, l in layers)
    weights = sum(l.in_features * l.out_features for _, l in layers)
    del model, layers

    load_times, graft_times, graft_cpu, identical = [], [], [], True
    for _ in range(args.repeats):  # the median: one timing on a shared CPU can be several times off
        start = time.perf_counter()
        loaded, _ = load_reservoir(path)
        mx.eval([l.parameters() for l in loaded.values()])
        load_times.append(time.perf_counter() - start)
        del loaded
        fresh, _ = load_model(args.model)
        mx.eval(fresh.parameters())
        start, cpu_start = time.perf_counter(), time.process_time()
        graft_reservoir(fresh, path)
        mx.eval(fresh.parameters())
        graft_times.append(time.perf_counter() - start)
        graft_cpu.append(time.process_time() - cpu_start)
        identical = identical and bool(mx.array_equal(fresh(tokens), logits).item())
        del fresh
    load_s, graft_s = statistics.median(load_times), statistics.median(graft_times)
    file_bytes = path.stat().st_size
    return {
        "bits": bits, "layers": len(load_reservoir(path, verify=False)[0]), "weights": weights,
        "quantize_seconds": round(quantize_s, 3), "save_seconds": round(save_s, 3),
        "load_reservoir_seconds": round(load_s, 3), "graft_seconds": round(graft_s, 3),
        "graft_speedup_vs_quantize": round(quantize_s / graft_s, 1),
        "quantize_cpu_seconds": round(quantize_cpu, 3), "graft_cpu_seconds": round(statistics.median(graft_cpu), 3),
        "graft_cpu_speedup": round(quantize_cpu / statistics.median(graft_cpu), 1),
        "file_bytes": file_bytes, "packed_code_bytes": codes_bytes, "file_over_codes": round(file_bytes / codes_bytes, 4),
        "stored_bytes": stored_bytes, "file_over_stored": round(file_bytes / stored_bytes, 4),
        "bits_per_weight": round(8 * stored_bytes / weights, 4),
        "model_bytes_before": model_bytes, "largest_layer_bytes": largest_layer, "peak_bytes_quantize": peak,
        "peak_over_model_plus_layer": round(peak / (model_bytes + largest_layer), 4),
        "ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "logits_bit_identical": identical, "path": str(path),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--bits", default="2,3,4")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="load/graft timings (median)")
    parser.add_argument("--render", action="store_true", help="only rewrite results.md from OUT/results.json")
    parser.add_argument("--out", default="benchmarks/results/weights-reservoir-smollm2")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.render:
        saved = json.loads((out / "results.json").read_text())
        render(out, saved["rows"], saved["page_sharing"])
        return
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        for b in args.bits.split(","):
            row = run(int(b), args, Path(tmp))
            print(json.dumps(row), flush=True)
            rows.append(row)
        sharing = page_sharing(Path(rows[-1]["path"]))
        print(json.dumps(sharing), flush=True)
    (out / "results.json").write_text(json.dumps({"rows": rows, "page_sharing": sharing,
                                                   "device": str(mx.default_device())}, indent=2))
    render(out, rows, sharing)


def render(out: Path, rows, sharing) -> None:
    mb = 1e6
    lines = ["| bits | bits/weight | quantize s | graft s (load + verify + swap, median) | speedup | CPU-time speedup "
             "| reservoir MB | packed codes MB | file / codes | logits bit-identical | model MB before | largest layer MB "
             "| peak MB while quantizing |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['bits']} | {r['bits_per_weight']:.3f} | {r['quantize_seconds']:.2f} | {r['graft_seconds']:.3f} | "
                     f"{r['graft_speedup_vs_quantize']:.0f}x | {r['graft_cpu_speedup']:.0f}x | {r['file_bytes'] / mb:.2f} | {r['packed_code_bytes'] / mb:.2f} | "
                     f"{r['file_over_codes']:.3f} | {r['logits_bit_identical']} | {r['model_bytes_before'] / mb:.1f} | "
                     f"{r['largest_layer_bytes'] / mb:.2f} | {r['peak_bytes_quantize'] / mb:.1f} |")
    lines += ["", f"Page sharing: five processes at once on the same {sharing['file_bytes'] / mb:.1f} MB reservoir: "
              "two `mapped` (mx.from_dlpack of NumPy views of a file mapping, the candidate zero-copy path), "
              "two `copied` (load_reservoir), and a baseline with the same imports that loads nothing "
              "(smaps_rollup while all hold on):", "",
              "| process | Rss MB | Pss MB | Shared_Clean MB | Private_Dirty MB |", "|---|---|---|---|---|"]
    for i, p in enumerate(sharing["processes"]):
        lines.append(f"| {p['mode']} {i} | {p['Rss'] / mb:.1f} | {p['Pss'] / mb:.1f} | {p['Shared_Clean'] / mb:.1f} | "
                     f"{p['Private_Dirty'] / mb:.1f} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
