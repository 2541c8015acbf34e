"""One rank of tests/test_distributed.py (run by `mlx.launch`), or the single-process reference
(run directly): greedy decoding with compressed caches, written as JSON to OUT/rank{R}.json."""

import argparse
import json
import os
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step

from veloxquant_mlx.config import KVCacheConfig
from veloxquant_mlx.integration import KVCacheBuilder
from veloxquant_mlx.models import load_model
from veloxquant_mlx.presets import KV_PRESETS, preset_config
from veloxquant_mlx.prompt_cache import prefill
from veloxquant_mlx.sharded_files import load_sharded_prompt_cache, save_sharded_prompt_cache
from veloxquant_mlx.sharding import RankLostError, rank_loss_is_an_error

VOCAB_USED = 1000  # prompt tokens drawn below this id


CALIBRATED = "spectralquant:4"  # per-head calibrated bases: a tensor-parallel rank keeps its heads' slice
ARTIFACTS = "artifacts"  # a model folder's artifact dir for CALIBRATED (test_distributed.py writes it)


def spec_config(spec: str, model_dir=None) -> KVCacheConfig:
    if spec in KV_PRESETS:
        return preset_config(spec)
    method, bits = spec.split(":")
    artifact_dir = str(Path(model_dir) / ARTIFACTS) if spec == CALIBRATED else None
    return KVCacheConfig(method=method, bits=int(bits), artifact_dir=artifact_dir)


def prompt_tokens(count: int) -> mx.array:
    return mx.random.randint(0, VOCAB_USED, (count,), key=mx.random.key(7))


def greedy(model, caches, prompt, max_tokens: int, die_after=None, rank: int = 0):
    """(tokens, log-probabilities) of greedy decoding from `prompt` over `caches`."""
    tokens, logprobs = [], []
    steps = generate_step(prompt, model, max_tokens=max_tokens, prompt_cache=caches,
                          sampler=lambda x: mx.argmax(x, axis=-1))
    for token, logprob in steps:
        tokens.append(int(token))
        logprobs.append(logprob.astype(mx.float32).tolist())
        if die_after is not None and rank == 1 and len(tokens) == die_after:
            sys.stdout.flush()
            os._exit(3)
    return tokens, logprobs


def run_spec(model, spec: str, args, rank: int, model_dir=None) -> dict:
    config = spec_config(spec, model_dir)
    prompt = prompt_tokens(args.prompt_tokens)
    caches = KVCacheBuilder(config).for_model(model).build()
    tokens, logprobs = greedy(model, caches, prompt, args.max_tokens, args.die_after, rank)
    record = {"tokens": tokens, "logprobs": logprobs, "nbytes": sum(c.nbytes for c in caches),
              "layers": len(caches), "kv_heads": [c.kv_heads for c in caches]}
    if args.roundtrip is not None:
        saved = KVCacheBuilder(config).for_model(model).build()
        prefill(model, saved, prompt[:-1].tolist())
        directory = Path(args.roundtrip) / spec.replace(":", "-")
        save_sharded_prompt_cache(directory, saved, model, {"spec": spec})
        loaded, metadata = load_sharded_prompt_cache(directory, model, config)
        record["roundtrip"] = dict(zip(("tokens", "logprobs"), greedy(model, loaded, prompt[-1:], args.max_tokens)))
        record["roundtrip"]["metadata"] = metadata
    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run", action="append", required=True, metavar="PARALLEL=MODEL_DIR",
                        help="shard MODEL_DIR this way (tensor or pipeline) and run every spec; repeatable")
    parser.add_argument("--specs", default="vq4,kivi:4")
    parser.add_argument("--prompt-tokens", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--roundtrip", default=None, help="also save the prompt's cache here, load it and decode")
    parser.add_argument("--die-after", type=int, default=None, help="rank 1 exits after this many tokens")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    group = mx.distributed.init()
    try:
        with rank_loss_is_an_error(group):
            records = {}
            for run in args.run:
                parallel, model_dir = run.split("=", 1)
                model, _ = load_model(model_dir, group=group, parallel=parallel)
                roundtrip = args.roundtrip
                args.roundtrip = None if roundtrip is None else str(Path(roundtrip) / parallel)
                records[parallel] = {spec: run_spec(model, spec, args, group.rank(), model_dir)
                                     for spec in args.specs.split(",")}
                args.roundtrip = roundtrip
    except RankLostError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{group.rank()}.json").write_text(json.dumps({"rank": group.rank(), "size": group.size(),
                                                               "runs": records}))


if __name__ == "__main__":
    main()
