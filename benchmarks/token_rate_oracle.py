"""Would rates that differ by token move the presets toward the quality targets?

The rate-distortion floor (`rate_distortion_floor.py`, docs/calibrated.md) showed that no code giving every
encoded token the same rate meets the 3- and 2-bit perplexity targets on SmolLM2. The fp16 sinks and window
are the one per-token rate the presets have: full precision for the first and the last tokens. This measures
what a finer choice would buy: a set S of tokens per layer and kv head, besides the sinks and window, kept in
fp16 (keys and values), the rest coded by the presets' own Lloyd-Max codes (`MSECodec`: renorm keys, unbiased
values, centred as the cache centres them). The choice of S:

* `attention`: the tokens that receive the most attention from every query of the window (H2O's criterion,
  Zhang et al. 2023, arXiv 2306.14048, Sec. 3, here with the future queries too: an oracle no cache has; it
  bounds what any choice by attention could buy);
* `window`: the most attention received from the W queries that see the token while it is in the fp16
  window (positions j..j+W-1). A cache could accumulate this before the token leaves the window;
* `window_share`: the same, with each query's attention normalised over its fp16 tokens only (sinks and
  window), which a cache can compute from the query and the tokens it holds in fp16, whatever path scores
  the codes;
* `window_share_layer`: the same tokens for every kv head of a layer, by their `window_share` summed over the
  heads (one set of positions per layer);
* `key_norm`: the largest centred key norms, known when the token arrives;
* `wider_window`: no set; the same fp16 tokens spent on a longer window instead;
* `window_share >= T` (`--thresholds`): every token whose `window_share` reaches T, a rule applied to each token
  as it leaves the window and never revised (the top-count choices above use the whole window's ranking, which a
  cache learns only at its end); the kept count is then the mean over layers and heads.

It runs as fake quantization: the model's attention function is replaced by one that scores each query
against the coded or the fp16 key, as the cache's rule says (query i sees key j in fp16 when j is a sink,
j > i - W, or j in S), on one 2048-token window of WikiText-2, second half scored, against the fp16 model.
Bits per coordinate are nominal, counted at 2048 tokens as the presets' are: codes and fp16 norms of the
coded tokens, 16 bits for every fp16 token, and 16 bits a kept token and head for its position.

    PYTHONPATH=. python benchmarks/token_rate_oracle.py --out benchmarks/results/token-rate-oracle
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx

from rate_distortion_floor import TestChannelCodec  # this script's folder is on sys.path
from veloxquant_mlx.methods.turboquant_mse import MSECodec
from veloxquant_mlx.models import load_model

SINKS = 4
CHUNK = 512  # the evaluation's chunk: the first chunk's encoded tokens set the centring means


def layout(bits, value_bits, window):
    return {"bits": bits, "value_bits": value_bits, "window": window}


LAYOUTS = {"vq4": layout(4, 3, 32), "vq3": layout(3, 2, 32), "vq2": layout(2, 1, 24)}


def parse_layout(name):
    """A preset's name, or KEY_BITS/VALUE_BITS/WINDOW (e.g. 3/2/16)."""
    if name in LAYOUTS:
        return LAYOUTS[name]
    bits, value_bits, window = name.split("/")
    return layout(float(bits), float(value_bits), int(window))


class Experiment:
    """The model's attention, in fp16 (recording each layer's attention statistics) or fake-quantized."""

    def __init__(self, model, tokens, code="lloyd"):
        self.model, self.tokens, self.code = model, tokens, code
        self.mode, self.layer, self.stats = "fp16", 0, []
        self.codecs = {}

    def __call__(self, queries, keys, values, cache=None, scale=1.0, mask=None, sinks=None):
        layer, self.layer = self.layer, self.layer + 1
        B, Hq, L, D = queries.shape
        H = keys.shape[1]
        q = queries.astype(mx.float32).reshape(B, H, Hq // H, L, D) * scale
        k, v = keys.astype(mx.float32)[:, :, None], values.astype(mx.float32)[:, :, None]
        causal = mx.arange(L)[None] <= mx.arange(L)[:, None]  # [i, j]: j <= i
        scores = q @ k.swapaxes(-1, -2)
        if self.mode == "fp16":
            probs = mx.softmax(mx.where(causal, scores, -mx.inf), axis=-1)
            self.stats.append(self._statistics(probs, scores, k))
            out = probs @ v
        else:
            out = self._fake_quantized(layer, q, k, v, scores, causal)
        return out.reshape(B, Hq, L, -1).astype(queries.dtype)

    def _statistics(self, probs, scores, k):
        L = probs.shape[-1]
        received = mx.sum(probs, axis=(2, 3))[0]  # (H, L): mass each key gets from all queries and q heads
        i, j = mx.arange(L)[:, None], mx.arange(L)[None]
        in_window = {w: ((i - j) < w) & (i >= j) for w in (16, 24, 32)}
        window_mass = {w: mx.sum(mx.where(m, probs, 0), axis=(2, 3))[0] for w, m in in_window.items()}
        # the share of each query's attention over its fp16 tokens only (sinks and window): what a cache can
        # compute from the query and its own fp16 tokens, whichever path scores the codes
        window_share = {}
        for w, m in in_window.items():
            seen = m | ((j < SINKS) & (i >= j))
            share = mx.softmax(mx.where(seen, scores, -mx.inf), axis=-1)
            window_share[w] = mx.sum(mx.where(m & (j >= SINKS), share, 0), axis=(2, 3))[0]
        centred = k[0, :, 0] - self._first_chunk_mean(k[0, :, 0])
        key_norm = mx.sqrt(mx.sum(centred * centred, axis=-1))
        mx.eval(received, key_norm, *window_mass.values(), *window_share.values())
        return {"attention": received, "key_norm": key_norm, **{f"window{w}": m for w, m in window_mass.items()},
                **{f"window_share{w}": m for w, m in window_share.items()}}

    @staticmethod
    def _first_chunk_mean(x):
        """The cache's centring mean: over the first update's encoded tokens (after the sinks, before the
        window), here with the largest window of the layouts."""
        return mx.mean(x[..., SINKS : CHUNK - 32, :], axis=-2, keepdims=True)

    def _coded(self, role, x, bits):
        mean = self._first_chunk_mean(x)
        D, seed, unbiased = x.shape[-1], int(role == "values"), role == "values"  # KVCacheConfig's seeds: 0, 0 + 1
        key = (role, bits, D)
        if key not in self.codecs:
            if self.code == "bound":  # the floor's test channel, with the presets' stored scales
                self.codecs[key] = TestChannelCodec(D, bits, seed, "unbiased" if unbiased else "renorm")
            else:
                self.codecs[key] = MSECodec(D, int(bits), seed, renorm=True, unbiased=unbiased)
        codec = self.codecs[key]
        return codec.from_domain(codec.decode(codec.encode(x - mean))) + mean  # decode gives the rotated domain

    def _fake_quantized(self, layer, q, k, v, scores, causal):
        L = q.shape[-2]
        k_hat = self._coded("keys", k, self.config["bits"])
        v_hat = self._coded("values", v, self.config["value_bits"])
        i, j = mx.arange(L)[:, None], mx.arange(L)[None]
        fp16 = (j < SINKS) | ((i - j) < self.config["window"])  # (L, L)
        kept = self.kept[layer]  # (H, L) bool or None
        if kept is not None:
            fp16 = fp16[None] | kept[:, None, :]  # (H, L, L)
            fp16 = fp16[None, :, None]
        coded_scores = q @ k_hat.swapaxes(-1, -2)
        scores = mx.where(fp16, scores, coded_scores)
        probs = mx.softmax(mx.where(causal, scores, -mx.inf), axis=-1)
        return mx.where(fp16, probs, 0) @ v + mx.where(fp16, 0, probs) @ v_hat

    def logits(self, mode, config=None, kept=None):
        self.mode, self.config, self.kept, self.layer = mode, config, kept, 0
        out = self.model(self.tokens[None]).astype(mx.float32)
        mx.eval(out)
        return out[0]


def _scores(s, criterion, window, shared):
    """One layer's (H, L) scores (summed over the kv heads when `shared`) and which tokens may be kept: neither
    sinks nor, at the end of the window, still in the fp16 window."""
    score = s[criterion]
    if shared:
        score = mx.broadcast_to(mx.sum(score, axis=0, keepdims=True), score.shape)
    L = score.shape[-1]
    return score, ((mx.arange(L) >= SINKS) & (mx.arange(L) < L - window))[None]


def choose(stats, criterion, count, window, shared=False):
    """Per layer, the (H, L) mask of the `count` highest-scoring tokens per kv head that may be kept;
    `shared`: the same tokens for every kv head, by their scores summed over the heads."""
    masks = []
    for s in stats:
        score, eligible = _scores(s, criterion, window, shared)
        score = mx.where(eligible, score, -mx.inf)
        threshold = mx.sort(score, axis=-1)[:, -count][:, None]
        masks.append((score >= threshold) & eligible)
    return masks


def over_threshold(stats, criterion, threshold, window, shared=False):
    """Per layer, the (H, L) mask of the tokens whose score reaches `threshold`: a rule a cache can apply to
    each token as it leaves the window, with no later change, so no query sees a choice made after it."""
    masks = []
    for s in stats:
        score, eligible = _scores(s, criterion, window, shared)
        masks.append((score >= threshold) & eligible)
    return masks


def scored_log_probs(logits, scored):
    """Log-probabilities at the scored positions (scored..L-1)."""
    logits = logits[scored:]
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def mean_nll(log_probs, targets):
    """Mean negative log-likelihood of `targets`, the tokens after positions scored..L-2."""
    return float(mx.mean(-log_probs[:-1][mx.arange(len(targets)), targets]))


def nominal_bits(cfg, kept_tokens, L, D):
    coded = L - SINKS - cfg["window"] - kept_tokens
    code_bits = (cfg["bits"] + cfg["value_bits"]) / 2 + 16 / D  # two fp16 norms over 2D coordinates
    fp16_tokens = SINKS + cfg["window"] + kept_tokens
    return (coded * code_bits + fp16_tokens * 16 + kept_tokens * 16 / (2 * D)) / L


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", default="../shared/data/wikitext2-test.txt")
    parser.add_argument("--skip-tokens", type=int, default=0)
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--layouts", default="vq3,vq4,vq2", help="preset names or KEY_BITS/VALUE_BITS/WINDOW")
    parser.add_argument("--code", choices=("lloyd", "bound"), default="lloyd",
                        help="the presets' Lloyd-Max codes, or the rate-distortion bound's test channel "
                        "(rate_distortion_floor.TestChannelCodec)")
    parser.add_argument("--noise-seed", type=int, default=0, help="the bound channel's noise")
    parser.add_argument("--fractions", default="0.01,0.02,0.04", help="shares of the window's tokens kept in fp16")
    parser.add_argument("--criteria", default="attention,window,window_share,key_norm,wider_window")
    parser.add_argument("--thresholds", default="", help="also keep every token whose window_share reaches "
                        "each of these (comma-separated)")
    parser.add_argument("--threshold-criterion", choices=("window_share", "window_share_layer"), default="window_share",
                        help="the thresholds' score: per kv head, or summed over a layer's kv heads (one set per layer)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import mlx_lm.models.llama as llama

    model, tokenizer = load_model("smollm2")
    ids = tokenizer.encode(Path(args.text).read_text())[args.skip_tokens : args.skip_tokens + args.ctx]
    tokens = mx.array(ids)
    mx.random.seed(args.noise_seed)
    experiment = Experiment(model, tokens, args.code)
    llama.scaled_dot_product_attention = experiment
    L, scored = len(ids), len(ids) // 2
    D = model.layers[0].self_attn.head_dim
    reference = scored_log_probs(experiment.logits("fp16"), scored)
    targets = tokens[scored + 1 :]
    ref_nll = mean_nll(reference, targets)
    stats = experiment.stats

    rows = []

    def run(name, cfg, criterion, count, kept):
        start = time.time()
        log_probs = scored_log_probs(experiment.logits("fake", cfg, kept), scored)
        kl = float(mx.mean(mx.sum(mx.exp(reference) * (reference - log_probs), axis=-1)))
        nll = mean_nll(log_probs, targets)
        if kept[0] is not None:  # the mean over layers and kv heads (a threshold keeps different counts)
            count = float(mx.mean(mx.stack([mx.sum(m, axis=-1).astype(mx.float32) for m in kept])))
        row = {"layout": name, "criterion": criterion, "kept_tokens": count, "window": cfg["window"],
               "bits": nominal_bits(cfg, count, L, D), "ppl_change": float(mx.exp(mx.array(nll - ref_nll))) - 1,
               "kl": kl, "top1": float(mx.mean(mx.argmax(reference, -1) == mx.argmax(log_probs, -1))),
               "seconds": time.time() - start}
        rows.append(row)
        print(f"{name:4s} {criterion:13s} kept {count:6.1f} window {cfg['window']:4d} bits {row['bits']:.3f} "
              f"dPPL {100 * row['ppl_change']:+.2f}% KL {kl:.4f} top1 {100 * row['top1']:.1f}%", flush=True)

    for name in args.layouts.split(","):
        base = parse_layout(name)
        run(name, base, "none", 0, [None] * len(stats))
        for fraction in (float(f) for f in args.fractions.split(",") if f):
            count = round(fraction * L)
            for criterion in args.criteria.split(","):
                if criterion == "wider_window":
                    run(name, {**base, "window": base["window"] + count}, criterion, 0, [None] * len(stats))
                    continue
                shared = criterion.endswith("_layer")
                key = criterion.removesuffix("_layer")
                key = f"{key}{base['window']}" if key.startswith("window") else key
                run(name, base, criterion, count, choose(stats, key, count, base["window"], shared))
        for threshold in (float(t) for t in args.thresholds.split(",") if t):
            key, shared = f"window_share{base['window']}", args.threshold_criterion == "window_share_layer"
            run(name, base, f"{args.threshold_criterion} >= {threshold:g}", 0,
                over_threshold(stats, key, threshold, base["window"], shared))

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"text": args.text, "skip_tokens": args.skip_tokens, "ctx": L, "scored_from": scored, "code": args.code,
            "fp16_ppl": float(mx.exp(mx.array(ref_nll))), "command": " ".join(sys.argv)}
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = [f"SmolLM2-135M, {args.text}: tokens {args.skip_tokens}-{args.skip_tokens + L - 1}, second half scored, "
             f"fake quantization ({args.code} codes) against the fp16 model (fp16 perplexity {meta['fp16_ppl']:.2f}). Bits nominal at "
             f"{L} tokens.", "",
             "| layout | kept in fp16 by | kept tokens per head | window | bits/coord | ΔPPL | KL | top-1 |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| `{r['layout']}` | {r['criterion']} | {r['kept_tokens']:.4g} | {r['window']} | {r['bits']:.3f} | "
                     f"{100 * r['ppl_change']:+.2f}% | {r['kl']:.4f} | {100 * r['top1']:.1f}% |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    figure(rows, out / "kl-vs-bits.png")
    print("\n".join(lines))


def figure(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for criterion in sorted({r["criterion"] for r in rows}):
        for layout in sorted({r["layout"] for r in rows}):
            pts = sorted((r["bits"], r["kl"]) for r in rows
                         if r["layout"] == layout and r["criterion"] in (criterion, "none"))
            if criterion != "none" and len(pts) > 1:
                ax.plot(*zip(*pts), marker="o", label=f"{layout}: {criterion}")
    ax.set_xlabel("bits per coordinate (nominal, 2048 tokens)")
    ax.set_ylabel("KL to fp16 (second half)")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
