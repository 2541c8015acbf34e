"""What storing one decode token costs, per layer, and whether MLX updates the buffer in place.

    python benchmarks/store_profile.py --contexts 4096,32768 --out benchmarks/results/gpu/run10

A one-row slice update is free when MLX donates the old buffer to the result (the
update then writes one row); otherwise it copies the whole buffer (30 MB per layer for
K3/V4 rows at 32K). This times, per layer over 32 layers (one eval per round):
the fp16 step (KVCache update + SDPA) and its store alone; our fused step; a row store
at an array-valued position (`mx.slice_update(rows, row, start_array)`) alone; a reader
(a sum over the buffer) alone; that store before or after the reader in the same graph;
and a store at a constant position (`rows[..., n:n+1, :] = row`), alone and after the reader. If "read, then store" costs much more than "read alone" + "store
alone", reading and updating a buffer in one step forces a copy.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from host_profile import filled_layers  # noqa: E402
from kernel_bench import timed  # noqa: E402
from veloxquant_mlx import kernels  # noqa: E402

ROUNDS = 15


def profile(T: int, L: int):
    caches, fp16 = filled_layers(L, T)
    q = mx.random.normal((1, 32, 1, 128)).astype(mx.float16)
    new = mx.random.normal((1, 8, 1, 128)).astype(mx.float16)
    rows = [c.store.rows + 0 for c in caches]  # separate buffers for the store variants
    row = rows[0][..., :1, :] + 0
    start = mx.array([T - 1])  # inside the buffer: dynamic slice updates are not bounds-checked
    mx.eval(q, new, rows, row)

    def fp16_step(i):
        k, v = fp16[i].update_and_fetch(new, new)
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=0.088)

    def fp16_store(i):
        return fp16[i].update_and_fetch(new, new)

    def packed_step(i):
        caches[i].update_and_fetch(new, new)
        return caches[i].attend(q, scale=0.088)

    def store(i):
        rows[i] = mx.slice_update(rows[i], row, start, axes=(2,))
        return rows[i]

    def read(i):
        return mx.sum(rows[i], axis=(2, 3))

    def store_then_read(i):
        rows[i] = mx.slice_update(rows[i], row, start, axes=(2,))
        return [rows[i], mx.sum(rows[i], axis=(2, 3))]

    def static_store(i):
        rows[i][..., T - 1 : T, :] = row
        return rows[i]

    def read_then_static_store(i):
        s = mx.sum(rows[i], axis=(2, 3))
        rows[i][..., T - 1 : T, :] = row
        return [rows[i], s]

    def read_then_store(i):
        s = mx.sum(rows[i], axis=(2, 3))
        rows[i] = mx.slice_update(rows[i], row, start, axes=(2,))
        return [rows[i], s]

    out = {}
    for name, fn in [("fp16 step", fp16_step), ("fp16 store only", fp16_store), ("packed fused step", packed_step),
                     ("row store alone", store), ("reader alone", read), ("store, then read", store_then_read),
                     ("read, then store", read_then_store), ("static store alone", static_store),
                     ("read, then static store", read_then_static_store)]:
        t = timed(fn, L, ROUNDS)
        out[name] = None if t is None else t * 1e6
        print(f"T={T} {name}: {out[name]:.1f} us/layer" if t else f"T={T} {name}: failed", flush=True)
        for c in caches:
            c.flush()
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", default="4096,32768")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result = {"backend": kernels.backend(), "mlx": mx.__version__, "layers": args.layers,
              "us_per_layer": {T: profile(int(T), args.layers) for T in args.contexts.split(",")}}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "store_profile.json").write_text(json.dumps(result, indent=1))
        lines = ["| variant | " + " | ".join(f"{T} tokens" for T in result["us_per_layer"]) + " |",
                 "|---|" + "---:|" * len(result["us_per_layer"])]
        names = next(iter(result["us_per_layer"].values())).keys()
        for name in names:
            cells = [result["us_per_layer"][T][name] for T in result["us_per_layer"]]
            lines.append(f"| {name} | " + " | ".join("—" if c is None else f"{c:.1f} us" for c in cells) + " |")
        (Path(args.out) / "store_profile.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))


if __name__ == "__main__":
    main()
