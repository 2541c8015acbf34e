"""Aggregate decode throughput of `veloxquant serve` against mlx-lm's server with its own caches.

Both servers are mlx-lm's server code (`mlx_lm.server`) on the same loaded model (the
project's loader: float32 weights on the CPU) and the same prompts; the only difference
is the cache: mlx-lm's `KVCache` (its activations' dtype, float32 on the CPU) or compressed
caches (`--kv`/cache flags). For each client count N, N threads each send `--requests`
chat requests through the `openai` client, one after another; aggregate tok/s is all
completion tokens over the wall time of the round. Configurations alternate round by round.

    python benchmarks/serve_throughput.py --clients 1,4,8 --max-tokens 24 --requests 2 \
        --configs "mlx-lm,vq4,turboquant_mse:3" --out benchmarks/results/serve-throughput-smollm2-cpu
"""

from __future__ import annotations

import argparse
import json
import platform
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import mlx_lm

from veloxquant_mlx.cli import build_parser, config_from_args
from veloxquant_mlx.server import make_server, server_arguments


def prompts_from(text_path: str, count: int, words: int):
    words_list = Path(text_path).read_text().split()
    return [" ".join(words_list[i * words : (i + 1) * words]) for i in range(count)]


def kv_config(name: str):
    """`mlx-lm` (its own caches), a preset (`vq4`) or `method:bits`."""
    if name == "mlx-lm":
        return None
    argv = ["serve", "--kv", name] if ":" not in name else ["serve", "--method", name.split(":")[0],
                                                              "--bits", name.split(":")[1]]
    return config_from_args(build_parser().parse_args(argv))


def start(model: str, config, max_tokens: int):
    args = build_parser().parse_args(["serve", "--model", model, "--port", "0", "--max-tokens", str(max_tokens),
                                      "--log-level", "WARNING", "--prompt-cache-size", "0"])
    httpd, generator = make_server(server_arguments(args, config), config)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, generator


def run_round(port: int, prompts, clients: int, requests: int, max_tokens: int):
    import openai  # a test extra; imported here so that --help works without it

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=900)

    def worker(index):
        tokens = 0
        for r in range(requests):
            prompt = prompts[(index * requests + r) % len(prompts)]
            reply = client.chat.completions.create(
                model="default_model", messages=[{"role": "user", "content": f"Summarise: {prompt}"}],
                max_tokens=max_tokens, temperature=0.0)
            tokens += reply.usage.completion_tokens
        return tokens

    start_time = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        tokens = sum(pool.map(worker, range(clients)))
    seconds = time.perf_counter() - start_time
    return {"clients": clients, "requests": clients * requests, "completion_tokens": tokens,
            "seconds": seconds, "tok_per_s": tokens / seconds}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="model (default: smollm2)")
    parser.add_argument("--configs", default="mlx-lm,vq4", help="caches to compare (default: mlx-lm,vq4)")
    parser.add_argument("--clients", default="1,4,8", help="concurrent clients per round (default: 1,4,8)")
    parser.add_argument("--requests", type=int, default=2, help="requests per client (default: 2)")
    parser.add_argument("--max-tokens", type=int, default=24, help="max tokens per request (default: 24)")
    parser.add_argument("--prompt-words", type=int, default=60, help="words per prompt (default: 60)")
    parser.add_argument("--text", default="../shared/data/wikitext2-test.txt",
                        help="text the prompts come from (default: ../shared/data/wikitext2-test.txt)")
    parser.add_argument("--out", required=True, help="results folder (required)")
    args = parser.parse_args()

    clients = [int(c) for c in args.clients.split(",")]
    names = args.configs.split(",")
    prompts = prompts_from(args.text, 64, args.prompt_words)
    servers = {name: start(args.model, kv_config(name), args.max_tokens) for name in names}
    rows = []
    try:
        for name, (httpd, _) in servers.items():  # warm-up: load the model, compile
            run_round(httpd.server_address[1], prompts[-4:], 1, 1, 4)
        for n in clients:
            for name, (httpd, _) in servers.items():
                row = run_round(httpd.server_address[1], prompts, n, args.requests, args.max_tokens)
                row["cache"] = name
                config = kv_config(name)
                row["cache_config"] = "mlx-lm KVCache" if config is None else config.describe()
                rows.append(row)
                print(f"{name:>20s} clients={n}: {row['completion_tokens']} tokens in {row['seconds']:.1f} s "
                      f"= {row['tok_per_s']:.2f} tok/s", flush=True)
    finally:
        for httpd, generator in servers.values():
            httpd.shutdown()
            httpd.server_close()
            generator.stop_and_join()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"model": args.model, "requests_per_client": args.requests, "max_tokens": args.max_tokens,
            "prompt_words": args.prompt_words, "device": str(mx.default_device()), "machine": platform.processor(),
            "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                     time.gmtime())}
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    base = {r["clients"]: r["tok_per_s"] for r in rows if r["cache"] == "mlx-lm"}
    lines = [f"Aggregate decode throughput, mlx-lm's server code, model `{args.model}`, {args.requests} requests "
             f"per client of up to {args.max_tokens} tokens, greedy; one run ({meta['device']}, mlx {meta['mlx']}, "
             f"mlx-lm {meta['mlx_lm']}, {meta['when']}).", "",
             "| cache | clients | requests | completion tokens | seconds | tok/s | vs mlx-lm |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['tok_per_s'] / base[r['clients']]:.2f}x" if r["clients"] in base else "-"
        lines.append(f"| {r['cache_config']} | {r['clients']} | {r['requests']} | {r['completion_tokens']} | "
                     f"{r['seconds']:.1f} | {r['tok_per_s']:.2f} | {ratio} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
