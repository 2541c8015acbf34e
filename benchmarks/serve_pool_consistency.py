"""Do pooled prompt caches answer as fresh ones?

Starts `veloxquant serve` in-process on 127.0.0.1 and sends 32 greedy chat requests that
share a system prompt, first one at a time (filling mlx-lm's prompt-cache pool), then all
32 at once (reusing the pooled caches, trimmed to each prompt). Prints how many concurrent
answers have the same token ids as their one-at-a-time answer. Extra arguments go to
`veloxquant serve` (e.g. `--kv vq4`, `--prompt-cache-size 0` to turn the pool off). `--out DIR` also
writes the result as `results.json` and `results.md` there.

    python benchmarks/serve_pool_consistency.py --max-tokens 32 --out benchmarks/results/serve-pool-consistency/vq4 -- --kv vq4
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

from veloxquant_mlx.cli import build_parser, config_from_args
from veloxquant_mlx.evaluation.serving import POOL_SYSTEM, POOL_SYSTEM_LONG, pooled_answers
from veloxquant_mlx.server import make_server, server_arguments


def write_results(out: str, record: dict):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json"), "w") as handle:
        json.dump(record, handle, indent=2)
    with open(os.path.join(out, "results.md"), "w") as handle:
        handle.write("| serve arguments | system prompt | max tokens | equal to one-at-a-time | served from the pool |\n"
                     "|---|---|---:|---:|---:|\n"
                     f"| `{' '.join(record['serve_args'])}` | {record['system']} | {record['max_tokens']} | "
                     f"{record['equal']}/{record['requests']} | {record['reused']} |\n")

def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--long-system", action="store_true",
                        help="a system prompt of about 400 tokens (past the presets' centring span) for the short one")
    parser.add_argument("--out", help="folder for results.json and results.md")
    parser.add_argument("serve_args", nargs="*", help="arguments of `veloxquant serve`, after --")
    args = parser.parse_args()
    serve_args = build_parser().parse_args(["serve", "--model", "smollm2", "--port", "0", "--log-level", "ERROR",
                                            *args.serve_args])
    config = config_from_args(serve_args)
    httpd, generator = make_server(server_arguments(serve_args, config), config)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    generator.request_limits()
    port = httpd.server_address[1]
    start = time.time()
    system = POOL_SYSTEM_LONG if args.long_system else POOL_SYSTEM
    alone, together, reused = pooled_answers(port, args.max_tokens, system)
    matches = sum(a == b for a, b in zip(alone, together))
    print(f"serve {' '.join(args.serve_args)}, {args.max_tokens} tokens, {'long' if args.long_system else 'short'} "
          f"system prompt: concurrent answers equal to one-at-a-time "
          f"{matches}/{len(alone)}, {reused} of them from a pooled cache ({time.time() - start:.0f} s)", flush=True)
    if args.out:
        write_results(args.out, {"serve_args": args.serve_args, "system": "long" if args.long_system else "short",
                                 "max_tokens": args.max_tokens, "requests": len(alone), "equal": matches,
                                 "reused": reused, "unequal_topics": [i for i, (a, b) in enumerate(zip(alone, together))
                                                                      if a != b]})
    httpd.shutdown()
    generator.stop_and_join()
    os._exit(0)  # MLX may abort at interpreter exit after the generation thread ran compiled kernels


if __name__ == "__main__":
    main()
