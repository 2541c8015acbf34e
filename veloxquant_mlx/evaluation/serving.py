"""`veloxquant benchmark serve`: the operator's benchmark of `veloxquant serve`.

Each cache gets its own server process (`veloxquant serve`, mlx-lm's server code on the project's
loader): `none` is mlx-lm's own fp16 caches (the activations' dtype), `mlx-q4` / `mlx-q8` mlx-lm's
QuantizedKVCache (`--kv none --kv-bits`, which mlx-lm's server serves one request at a time), any
other name a preset (`vq4`, `mlxq4`) or `method:bits`. Real HTTP clients (one thread each) send
streamed completions of prompts of the given token lengths; rounds alternate between the caches,
concurrency level by concurrency level. Per round: aggregate decode tok/s (the tokens after each
stream's first, over the span from the round's first first token to its last token) and end-to-end tok/s
(every completion token over the round's wall time, prefills included), time to first token and
inter-token latency (p50/p95, from the stream's chunk arrivals), the server's peak resident memory and
MLX's peak memory (the accelerator's on a GPU), the admitted concurrency (the most streams the clients
saw decoding at once) and the requests a KV budget queued. Each server first runs one unmeasured round at
each concurrency and prompt length (prompts `--warmup-prompt-tokens` long, by default the round's; 8 tokens
per completion), so that first-use compilation is not timed. With a budget (`--kv-memory-gb`, or
`--budget-fp16-sequences N`: N sequences of mlx-lm's fp16 caches at the longest prompt), every cache is
run once more at the highest concurrency under it.
"""

from __future__ import annotations

import json
import platform
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional, Tuple

BASELINES = {"none": [], "fp16": [], "mlx-q4": ["--kv-bits", "4"], "mlx-q8": ["--kv-bits", "8"]}


def cache_flags(name: str) -> List[str]:
    """The `veloxquant serve` flags of a cache name."""
    if name in BASELINES:
        return ["--kv", "none", *BASELINES[name]]
    if ":" in name:
        method, bits = name.split(":", 1)
        return ["--method", method, "--bits", bits]
    return ["--kv", name]


def percentile(values: List[float], q: float) -> Optional[float]:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_health(port: int, process: subprocess.Popen, timeout: float, what: str):
    """Return once the server on `port` answers /health; an error naming `what` if `process` exits first or
    `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with status {process.returncode}: {what}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.5)
    raise TimeoutError(f"server not ready after {timeout:.0f} s: {what}")


class ServerProcess:
    """One `veloxquant serve` process, its log in `log_path`."""

    def __init__(self, model: str, flags: List[str], log_path: Path, max_tokens: int, concurrency: int,
                 prompt_concurrency: int):
        self.port = free_port()
        command = [sys.executable, "-m", "veloxquant_mlx.cli", "serve", "--model", model, "--port", str(self.port),
                   "--served-model-name", "bench", "--prompt-cache-size", "0", "--max-tokens", str(max_tokens),
                   "--decode-concurrency", str(max(concurrency, 1)), "--prompt-concurrency", str(prompt_concurrency),
                   "--log-level", "INFO", *flags]
        self.command = command
        self.log = open(log_path, "w")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 900.0):
        wait_for_health(self.port, self.process, timeout, f"{' '.join(self.command)} (log: {self.log.name})")

    def stats(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/veloxquant/stats", timeout=30) as reply:
            return json.loads(reply.read())

    def stop(self):
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


class StreamFailed(RuntimeError):
    """A completion stream that ended in an error or before its end marker."""


def stream_completion(port: int, prompt: str, max_tokens: int) -> dict:
    """One streamed completion: its start, first-token and per-chunk arrival times and its token count."""
    body = json.dumps({"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    start, arrivals, tokens, done = time.perf_counter(), [], None, False
    with urllib.request.urlopen(request, timeout=3600) as reply:
        for raw in reply:
            line = raw.decode().strip()
            if line == "data: [DONE]":  # the server keeps the connection open: the stream ends here
                done = True
                break
            if not line.startswith("data:"):
                continue
            chunk = json.loads(line[5:])
            error = chunk.get("error")  # the server ends a stream that failed after its 200 with the error
            if error:
                raise StreamFailed(error.get("message", str(error)) if isinstance(error, dict) else str(error))
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices"):
                arrivals.append(time.perf_counter())
    if not done:
        raise StreamFailed("the stream ended without [DONE]")
    return {"start": start, "arrivals": arrivals, "tokens": tokens if tokens is not None else len(arrivals),
            "end": time.perf_counter()}


def run_round(port: int, prompts: List[str], clients: int, requests: int, max_tokens: int) -> dict:
    results, errors = [], []

    def client(index):
        for r in range(requests):
            try:
                results.append(stream_completion(port, prompts[(index * requests + r) % len(prompts)], max_tokens))
            except Exception as error:  # noqa: BLE001  (counted and reported)
                errors.append(f"{type(error).__name__}: {error}")

    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"clients": clients, "requests": clients * requests, "failed": len(errors), "errors": errors[:3],
            **round_summary(results, time.perf_counter() - started)}


def round_summary(streams: List[dict], seconds: float) -> dict:
    """A round's figures from its streams (`stream_completion`'s records). Two throughputs: end to end (every
    completion token over the round's wall time, prefills included) and decode (the tokens after each stream's
    first, over the span from the round's first first token to its last token; TTFT reports the prefill)."""
    tokens = sum(r["tokens"] for r in streams)
    answered = [r for r in streams if r["arrivals"]]
    ttft = [r["arrivals"][0] - r["start"] for r in answered]
    itl = [b - a for r in answered for a, b in zip(r["arrivals"], r["arrivals"][1:])]
    decode_tokens = sum(max(0, r["tokens"] - 1) for r in answered)
    decode_span = (max(r["arrivals"][-1] for r in answered) - min(r["arrivals"][0] for r in answered)
                   if answered else 0.0)
    return {"completion_tokens": tokens, "seconds": seconds, "tok_per_s": tokens / seconds,
            "decode_tokens": decode_tokens, "decode_seconds": decode_span,
            "decode_tok_per_s": decode_tokens / decode_span if decode_span > 0 else None,
            "ttft_p50_s": percentile(ttft, 0.5), "ttft_p95_s": percentile(ttft, 0.95),
            "itl_p50_s": percentile(itl, 0.5), "itl_p95_s": percentile(itl, 0.95),
            "most_decoding_at_once": _most_overlapping([(r["arrivals"][0], r["arrivals"][-1]) for r in answered])}


POOL_SYSTEM = "You are a helpful assistant who answers in one short sentence about the topic asked."
# Longer than the presets' sinks and centring span (4 + 256 tokens), so that a pooled cache trimmed to it keeps
# its means and is reused (`prompt_cache.FreshPromptCache`); the short one is not.
POOL_SYSTEM_LONG = " ".join([
    "You are a helpful assistant for a public library's information desk.",
    "Visitors ask you about everyday things: animals, places, foods, tools, materials, weather and the sky.",
    "Answer in one short sentence that a curious ten-year-old could follow, and never use lists or headings.",
    "Prefer a concrete fact to a general remark: a size, a date, a place, a number or a name.",
    "If a topic has a surprising detail, lead with it; if it has a common misconception, correct it gently.",
    "Do not greet the visitor, do not repeat the question, and do not end with an offer of further help.",
    "Avoid jargon; when a technical word is unavoidable, explain it in the same sentence with plain words.",
    "Keep measurements in metric units, and give years as numbers rather than in words.",
    "Stay neutral on matters of taste, and never invent a source, a quotation or a statistic.",
    "When a topic names several different things, choose the most common meaning and answer about that one.",
    "If the topic is a living thing, say where it lives or what it eats; if it is a made thing, say what it is for.",
    "If the topic is a place or a natural feature, say where one can be found or how it formed.",
    "If the topic is a food or a drink, say what it is made from or where it was first made.",
    "If the topic is a material, say what it is made of or what it is used for.",
    "If the topic is a tool or an instrument, say how it works or who uses it.",
    "If the topic is weather or something in the sky, say what causes it or when it can be seen.",
    "Write plainly, warmly and briefly, as a good librarian would speak to a young reader at the desk.",
    "Remember that many visitors read your answers aloud, so avoid symbols, abbreviations and parentheses.",
    "Every answer must be true today, must stand on its own, and must make sense without any picture.",
])
POOL_TOPICS = ["lighthouses", "bees", "volcanoes", "the moon", "bread", "rivers", "chess", "owls", "glass", "tides",
               "maps", "salt", "clocks", "bridges", "coffee", "whales", "deserts", "paper", "kites", "snow",
               "copper", "rain", "ants", "violins", "caves", "wheat", "comets", "sails", "honey", "fog", "trains",
               "ink"]


def greedy_chat_answer(port: int, topic: str, max_tokens: int, system: str,
                       timeout: float = 3600) -> Tuple[List[int], int]:
    """(token ids of the greedy answer, prompt tokens the server took from its prompt-cache pool)."""
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    body = {"messages": [{"role": "system", "content": system},
                         {"role": "user", "content": f"Tell me about {topic}."}],
            "max_tokens": max_tokens, "temperature": 0, "logprobs": True}
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    reply = json.loads(connection.getresponse().read())
    cached = reply.get("usage", {}).get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return [entry["id"] for entry in reply["choices"][0]["logprobs"]["content"]], cached


def pooled_answers(port: int, max_tokens: int, system: str = POOL_SYSTEM):
    """Greedy token ids of 32 chat requests sharing a system prompt, asked of the server at `port` first one at a
    time (filling mlx-lm's prompt-cache pool) and then all at once (reusing the pooled caches, trimmed to each
    prompt): `(alone, together, reused)`, one list of ids per topic in each, and how many of the concurrent
    requests the server served from a pooled cache."""
    from concurrent.futures import ThreadPoolExecutor

    alone = [greedy_chat_answer(port, topic, max_tokens, system)[0] for topic in POOL_TOPICS]
    with ThreadPoolExecutor(len(POOL_TOPICS)) as pool:
        together = list(pool.map(lambda topic: greedy_chat_answer(port, topic, max_tokens, system), POOL_TOPICS))
    return alone, [ids for ids, _ in together], sum(cached > 0 for _, cached in together)


def _most_overlapping(spans) -> int:
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans], key=lambda e: (e[0], e[1]))
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def make_prompts(tokenizer, text: str, tokens: int, count: int) -> List[str]:
    """`count` prompts of about `tokens` tokens each: consecutive windows of `text` (repeated if short)."""
    ids = tokenizer.encode(text)
    while len(ids) < tokens * count:
        ids = ids + ids
    return [f"[{i}] " + tokenizer.decode(ids[i * tokens : (i + 1) * tokens - 8]) for i in range(count)]


def fp16_sequence_bytes(model, tokens: int) -> int:
    """Bytes of one sequence of mlx-lm's own caches at `tokens` tokens, as `--kv-memory-gb` counts them."""
    from mlx_lm.models.cache import make_prompt_cache

    from ..server_admission import CacheBytes

    return CacheBytes(model, lambda: make_prompt_cache(model))(tokens)


def fp16_budget_bytes(model, tokenizer, prompts: List[str], max_tokens: int, sequences: int) -> int:
    """A KV budget of `sequences` of mlx-lm's own caches for the longest of `prompts`, sized as the server's
    admission sizes a completion request (its prompt's tokens plus `max_tokens`), so that exactly `sequences`
    such requests fit in it."""
    longest = max(len(tokenizer.encode(prompt)) for prompt in prompts)
    return sequences * fp16_sequence_bytes(model, longest + max_tokens)


def _round_row(server: ServerProcess, cache: str, prompt_tokens: int, budget_gb, round_result: dict,
               queued_before: int) -> dict:
    """A round's row. `admitted`: the most streams decoding at once, seen by the clients (the server's own
    count of live requests is a peak over its life, warm-up rounds included); `queued`: the requests its KV
    budget held back during this round."""
    stats = server.stats()
    admission = stats.get("admission")
    return {"cache": cache, "prompt_tokens": prompt_tokens, "kv_budget_gb": budget_gb, **round_result,
            "server_peak_rss_bytes": stats.get("peak_rss_bytes"),
            "mlx_peak_memory_bytes": stats.get("mlx_peak_memory_bytes"),
            "admitted": round_result["most_decoding_at_once"],
            "queued": admission["queued"] - queued_before if admission else 0}


def _queued(server: ServerProcess) -> int:
    admission = server.stats().get("admission")
    return admission["queued"] if admission else 0


def run_serve_benchmark(args) -> dict:
    import mlx.core as mx
    import mlx_lm

    from ..models import load_model
    from ..texts import load_text, sample_text_path

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    caches = [c.strip() for c in args.caches.split(",") if c.strip()]
    levels = [int(c) for c in args.concurrency.split(",")]
    lengths = [int(p) for p in args.prompt_tokens.split(",")]
    model, tokenizer = load_model(args.model)
    text = load_text(args.text) if args.text else sample_text_path().read_text()
    def warmup_length(length: int) -> int:
        return min(length, args.warmup_prompt_tokens or length)

    prompts = {p: make_prompts(tokenizer, text, p, max(levels) * args.requests)
               for p in {*lengths, *map(warmup_length, lengths)}}
    budget_gb = args.kv_memory_gb
    if args.budget_fp16_sequences:
        budget_gb = fp16_budget_bytes(model, tokenizer, prompts[max(lengths)], args.max_tokens,
                                      args.budget_fp16_sequences) / 1e9
    del model
    mx.clear_cache()

    if args.budget_only and not budget_gb:
        raise ValueError("--budget-only needs --kv-memory-gb or --budget-fp16-sequences")
    plan = [] if args.budget_only else [(cache, None, clients, length) for clients in levels for length in lengths
                                        for cache in caches]
    if budget_gb:
        plan += [(cache, budget_gb, max(levels), max(lengths)) for cache in caches]
    if args.sequential:  # one server process at a time (a large model): each cache's rounds together
        plan.sort(key=lambda step: (caches.index(step[0]), step[1] is not None))
    last_use = {(cache, budget): i for i, (cache, budget, _, _) in enumerate(plan)}
    servers: Dict[tuple, ServerProcess] = {}
    rows = []
    signal.signal(signal.SIGTERM, _interrupted)  # stop the servers on the way out
    complete = False
    try:
        if not args.sequential:  # every server up (and loading in parallel) before the first round
            for cache, budget in dict.fromkeys(last_use):
                servers[(cache, budget)] = _start(args, out, cache, budget, max(levels))
        warm = set()
        for i, (cache, budget, clients, length) in enumerate(plan):
            if (cache, budget) not in servers:
                servers[(cache, budget)] = _start(args, out, cache, budget, max(levels))
            server = servers[(cache, budget)]
            if (cache, budget, clients, length) not in warm:  # first use of these shapes: compiles, unmeasured
                run_round(server.port, prompts[warmup_length(length)], clients, 1, min(args.max_tokens, 8))
                warm.add((cache, budget, clients, length))
            queued_before = _queued(server)
            row = _round_row(server, cache, length, budget,
                             run_round(server.port, prompts[length], clients, args.requests, args.max_tokens),
                             queued_before)
            rows.append(row)
            _progress(row)
            if args.sequential and last_use[(cache, budget)] == i:
                servers.pop((cache, budget)).stop()
        complete = True
    finally:
        for server in servers.values():
            server.stop()
        # An interrupted run keeps the rounds it finished, marked incomplete.
        results = {"command": "benchmark serve",
                   "settings": {"model": args.model, "caches": caches, "concurrency": levels,
                                "prompt_tokens": lengths, "max_tokens": args.max_tokens,
                                "requests_per_client": args.requests, "kv_budget_gb": budget_gb,
                                "prompt_concurrency": args.prompt_concurrency,
                                "warmup_prompt_tokens": args.warmup_prompt_tokens,
                                "budget_fp16_sequences": args.budget_fp16_sequences, "interleaved": not args.sequential},
                   "environment": {"device": str(mx.default_device()), "machine": platform.machine(),
                                   "processor": platform.processor(), "mlx": mx.__version__,
                                   "mlx_lm": mlx_lm.__version__,
                                   "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
                   "complete": complete, "rows": rows}
        if rows:
            (out / "results.json").write_text(json.dumps(results, indent=2))
            (out / "results.md").write_text(markdown(results))
            plot(results, out / "throughput_vs_concurrency.png")
    print(markdown(results))
    return results


def _start(args, out: Path, cache: str, budget, concurrency: int) -> ServerProcess:
    """A ready, warmed-up server of `cache` (under `budget` GB of KV, or none)."""
    flags = cache_flags(cache) + (["--kv-memory-gb", repr(budget)] if budget else [])
    label = cache.replace(":", "-") + ("-budget" if budget else "")
    server = ServerProcess(args.model, flags, out / f"server-{label}.log", args.max_tokens, concurrency,
                           args.prompt_concurrency)
    try:
        server.wait_ready()
        run_round(server.port, ["Warm up: compile the model's graphs."], 1, 1, 4)
    except BaseException:
        server.stop()
        raise
    return server


def _interrupted(signum, frame):
    raise KeyboardInterrupt


def _progress(row):
    budget = f" budget {row['kv_budget_gb']:.4g} GB" if row["kv_budget_gb"] else ""
    print(f"{row['cache']:>10s} clients={row['clients']} prompt={row['prompt_tokens']}{budget}: "
          f"decode {_fmt(row.get('decode_tok_per_s'))} tok/s, end to end {row['tok_per_s']:.2f} tok/s, admitted {row['admitted']}, failed {row['failed']}", flush=True)


def _fmt(value, scale=1.0, digits=2):
    return "-" if value is None else f"{value * scale:.{digits}f}"


def markdown(results: dict) -> str:
    rows, s, env = results["rows"], results["settings"], results["environment"]
    base = {(r["clients"], r["prompt_tokens"], r["kv_budget_gb"]): r for r in rows if r["cache"] in ("none", "fp16")}

    def versus(r, key):
        ref = base.get((r["clients"], r["prompt_tokens"], r["kv_budget_gb"]), {}).get(key)
        return f"{r[key] / ref:.2f}x" if ref and r.get(key) else "-"

    lines = [f"`veloxquant benchmark serve`: model `{s['model']}`, {s['requests_per_client']} streamed completion(s) "
             f"per client of up to {s['max_tokens']} tokens, greedy, prompts prefilled "
             f"{s.get('prompt_concurrency', 8)} at a time; one {'interleaved ' if s.get('interleaved', True) else ''}run ({env['device']}, mlx "
             f"{env['mlx']}, mlx-lm {env['mlx_lm']}, {env['when']}). `none` is mlx-lm's own caches; `mlx-qN` its "
             "QuantizedKVCache (served one request at a time by mlx-lm's server). Decode tok/s: the tokens after each "
             "stream's first, over the span from the round's first first token to its last token; end-to-end tok/s: "
             "every completion token over the round's wall time, prefills included."
             + ("" if results.get("complete", True) else " **Incomplete run**: interrupted after these rounds."), "",
             "| cache | KV budget GB | clients | prompt tokens | decode tok/s | vs none | end-to-end tok/s | vs none "
             "| TTFT p50/p95 s | ITL p50/p95 ms | admitted | queued | server peak RSS GB | MLX peak GB | failed |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['cache']} | {_fmt(r['kv_budget_gb'], digits=4)} | {r['clients']} | {r['prompt_tokens']} | "
                     f"{_fmt(r.get('decode_tok_per_s'))} | {versus(r, 'decode_tok_per_s')} | "
                     f"{r['tok_per_s']:.2f} | {versus(r, 'tok_per_s')} | {_fmt(r['ttft_p50_s'])}/{_fmt(r['ttft_p95_s'])} | "
                     f"{_fmt(r['itl_p50_s'], 1e3, 0)}/{_fmt(r['itl_p95_s'], 1e3, 0)} | {r['admitted']} | {r['queued']} | "
                     f"{_fmt(r['server_peak_rss_bytes'], 1e-9)} | {_fmt(r['mlx_peak_memory_bytes'], 1e-9)} | "
                     f"{r['failed']} |")
    failures = [f"- `{r['cache']}`, {r['clients']} clients, {r['prompt_tokens']}-token prompts: {r['errors'][0]}"
                for r in rows if r["failed"] and r.get("errors")]
    if failures:
        lines += ["", "First error of each round with failed requests:", *failures]
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["rows"] if r["kv_budget_gb"] is None]
    fig, ax = plt.subplots(figsize=(6, 4))
    for cache in results["settings"]["caches"]:
        for length in results["settings"]["prompt_tokens"]:
            points = sorted((r["clients"], r["decode_tok_per_s"]) for r in rows
                            if r["cache"] == cache and r["prompt_tokens"] == length and r.get("decode_tok_per_s"))
            if points:
                ax.plot(*zip(*points), marker="o", label=f"{cache}, {length}-token prompts")
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("aggregate decode tok/s")
    ax.set_title(f"veloxquant serve, {results['settings']['model']}")
    if ax.lines:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def register_serve_benchmark(benchmark_parser) -> None:
    """`veloxquant benchmark serve` under the `benchmark` command."""
    sub = benchmark_parser.add_subparsers(dest="benchmark_command", metavar="serve",
                                         help="`serve`: the operator's benchmark (without it: the cache benchmark)")
    serve = sub.add_parser("serve", help="concurrent serving: throughput, latency, memory and admitted requests "
                                         "per cache, real servers and HTTP clients")
    serve.add_argument("--model", default="smollm2",
                       help="model: local mlx folder, .gguf, hub id or 'smollm2' (default: smollm2)")
    serve.add_argument("--caches", default="none,vq4,vq3,mlxq4,mlx-q4,mlx-q8",
                       help="caches, comma-separated: none (mlx-lm's fp16), mlx-q4/mlx-q8 (its QuantizedKVCache), "
                            "a preset or method:bits (default: none,vq4,vq3,mlxq4,mlx-q4,mlx-q8)")
    serve.add_argument("--concurrency", default="1,4,8", help="concurrent clients per round (default: 1,4,8)")
    serve.add_argument("--prompt-tokens", default="2048", help="prompt lengths in tokens (default: 2048)")
    serve.add_argument("--max-tokens", type=int, default=64, help="tokens per completion (default: 64)")
    serve.add_argument("--requests", type=int, default=1, help="requests per client per round (default: 1)")
    serve.add_argument("--prompt-concurrency", type=int, default=8,
                       help="prompts each server prefills in one batch (serve's flag; default: 8, mlx-lm's)")
    budget = serve.add_mutually_exclusive_group()
    budget.add_argument("--kv-memory-gb", type=float, default=None,
                        help="also run every cache at the highest concurrency under this KV budget (default: none)")
    budget.add_argument("--budget-fp16-sequences", type=int, default=None,
                        help="the same with a budget of N sequences of mlx-lm's fp16 caches at the longest prompt "
                             "(default: none)")
    serve.add_argument("--budget-only", action="store_true",
                       help="only the rounds under the budget (where the caches at every concurrency would not fit)")
    serve.add_argument("--sequential", action="store_true",
                       help="one server process at a time, each cache's rounds together (a model too large for "
                            "one process per cache at once); default: all up, rounds alternating between caches")
    serve.add_argument("--warmup-prompt-tokens", type=int, default=None,
                       help="prompt length of the unmeasured warm-up round before each cache's first round at a "
                            "concurrency and length (default: that length; shorter saves a long prompt's prefill, "
                            "and leaves the longer shapes' first compiles in the measured round)")
    serve.add_argument("--text", default=None, help="text the prompts come from (default: the packaged sample)")
    serve.add_argument("--out", default="results/benchmark-serve", help="results folder (default: "
                                                                        "results/benchmark-serve)")
    serve.set_defaults(func=lambda args: run_serve_benchmark(args) and None)
