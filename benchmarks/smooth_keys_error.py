"""What `smooth_keys` does to the codes' errors on SmolLM2's real activations, layer by layer.

    PYTHONPATH=. python benchmarks/smooth_keys_error.py --text ../shared/data/wikitext2-test.txt --skip-tokens 200000 \
        --artifacts benchmarks/results/kv-quality-sweep/artifacts/k3v8-s05 --bits 3 --out benchmarks/results/smooth-keys-error

Keys, queries and values of one 1024-token span are captured (`calibration.capture`); keys are centred on the
span's first 64 tokens (as a centred cache does on its first chunk). For each layer:
* score error: mean over all (query, key) pairs of (q . (k - k^))^2, k^ the reconstruction by the cache's own key
  codec, plain `turboquant_mse` (renorm) and the same codec smoothed with the artifact's scales;
* value bound: sum_j w_j^2 s_j^2 * sum_j v_j^2 / s_j^2 over sum_j w_j^2 * sum_j v_j^2, the isotropic-error bound
  of per-channel value scales s (values smoothed the way `smooth_keys` smooths keys), for s_j^2 = v_j (value RMS
  only) and for the bound's optimum s_j^2 = v_j / w_j, w_j the norm of `o_proj`'s columns that read channel j.
"""

import argparse
import json
from pathlib import Path

import mlx.core as mx

from veloxquant_mlx.artifacts import CodecSet, model_fingerprint
from veloxquant_mlx.calibration import calibration_tokens, capture
from veloxquant_mlx.config import KVCacheConfig
from veloxquant_mlx.methods.turboquant_mse import MSECodec
from veloxquant_mlx.models import load_model


def score_error(codec, queries, keys):
    heads = keys.shape[0]
    rec = codec.reconstruct(codec.encode(keys[None]))[0]
    grouped = queries.reshape(heads, queries.shape[0] // heads, -1, keys.shape[-1])
    return float(mx.mean((grouped @ (rec - keys)[:, None].swapaxes(-1, -2)) ** 2).item())


def value_bounds(values, o_proj):
    heads, _, dim = values.shape
    v = values - mx.mean(values, axis=1, keepdims=True)
    v = mx.sqrt(mx.mean(v * v, axis=1))  # (H, D) channel RMS
    weight = o_proj.weight.astype(mx.float32)
    rep = weight.shape[1] // dim // heads
    w2 = mx.sum(weight.reshape(-1, heads, rep, dim) ** 2, axis=(0, 2))  # (H, D)
    plain = mx.sum(w2, -1) * mx.sum(v * v, -1)
    rms_only = mx.sum(w2 * v, -1) * mx.sum(v, -1)
    optimum = mx.sum(mx.sqrt(w2) * v, -1) ** 2
    return (rms_only / plain).tolist(), (optimum / plain).tolist()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--text", required=True)
    parser.add_argument("--skip-tokens", type=int, default=200000)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--bits", type=int, default=3)
    parser.add_argument("--artifacts", required=True, help="a turboquant_mse smooth_keys artifact dir at --bits")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    model, tokenizer = load_model(args.model)
    layers = capture(model, calibration_tokens(tokenizer, Path(args.text).read_text(), 1, args.tokens, args.skip_tokens),
                     progress=False)
    meta = json.loads((Path(args.artifacts) / "artifacts.json").read_text())
    config = KVCacheConfig.from_json(json.dumps(meta["config"])).replace(artifact_dir=args.artifacts)
    if config.bits != args.bits or not config.options.get("smooth_keys"):
        raise SystemExit(f"{args.artifacts} holds {config.describe()}, not smoothed {args.bits}-bit keys")
    codecs = CodecSet.for_config(config, model_fingerprint(model))
    plain = MSECodec(layers[0]["keys"].shape[-1], args.bits, config.seed, renorm=True)
    rows = []
    for i, layer in enumerate(layers):
        keys = layer["keys"] - mx.mean(layer["keys"][:, :64], axis=1, keepdims=True)
        smoothed = codecs.layer(i).get("keys", keys.shape[-1])
        rms_only, optimum = value_bounds(layer["values"], model.layers[i].self_attn.o_proj)
        rows.append({"layer": i, "score_error_plain": score_error(plain, layer["queries"], keys),
                     "score_error_smoothed": score_error(smoothed, layer["queries"], keys),
                     "value_bound_rms_only": rms_only, "value_bound_optimum": optimum})
    total = {k: sum(r[k] for r in rows) for k in ("score_error_plain", "score_error_smoothed")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "config": config.describe(), "total": total,
                                                  "layers": rows}, indent=2) + "\n")
    lines = [f"SmolLM2, {args.tokens} tokens of `{Path(args.text).name}` from token {args.skip_tokens}; keys coded at "
             f"{args.bits} bits (`turboquant_mse`, renorm), smoothed with `{args.artifacts}`. Score error: mean "
             "(q . (k - k^))^2 over all query-key pairs. Value bound: error of per-channel value scales over none "
             "(per kv head; 1.00 = no gain).", "",
             "| layer | score error plain | smoothed | ratio | value bound, RMS only | value bound, optimum |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layer']} | {r['score_error_plain']:.3f} | {r['score_error_smoothed']:.3f} | "
                     f"{r['score_error_smoothed'] / r['score_error_plain']:.2f} | "
                     + ", ".join(f"{x:.2f}" for x in r["value_bound_rms_only"]) + " | "
                     + ", ".join(f"{x:.2f}" for x in r["value_bound_optimum"]) + " |")
    lines.append(f"| all | {total['score_error_plain']:.2f} | {total['score_error_smoothed']:.2f} | "
                 f"{total['score_error_smoothed'] / total['score_error_plain']:.2f} | | |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
