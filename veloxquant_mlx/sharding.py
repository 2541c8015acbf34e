"""Compressed caches for models sharded by mlx-lm over `mx.distributed` (`mlx_lm.utils.sharded_load`).

A tensor-parallel rank (`model.shard(group)`) holds a contiguous block of each layer's KV heads;
a pipeline rank (`model.model.pipeline(group)`) holds a contiguous block of layers. `model_sharding`
reads which from the model itself, so a model sharded by mlx-lm directly works as one loaded by
`models.load_model(..., group=...)`.

Codecs shared by every head and layer (a seed's rotations and codebooks) are the same on every
rank. An artifact dir holds the whole model's codecs; a rank loads it checked against the whole
model's fingerprint and keeps its slice: its heads (axis 0 of a calibrated layer's per-head
arrays) and its layers, renumbered from 0 as the rank's caches are. One artifact dir so serves
every world size, and each rank's cache equals the single-process cache's heads and layers.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream

from .artifacts import CodecSet, load_artifacts, model_fingerprint, model_identity
from .cache import DecodedReads

TENSOR, PIPELINE = "tensor", "pipeline"
PER_HEAD_PARAMS = ("heads.", "outliers.", "smooth.")  # calibrated per-head arrays: kv heads on axis 0


@dataclass(frozen=True)
class Sharding:
    """How a model is split over a group: `kind` (tensor or pipeline), this rank and the world size."""

    kind: str
    rank: int
    size: int
    group: object

    def describe(self) -> str:
        return f"{self.kind}-parallel rank {self.rank} of {self.size}"


def model_sharding(model) -> Optional[Sharding]:
    """The model's sharding over a group of more than one rank, or None for a whole model."""
    inner = getattr(model, "model", None)
    pipelined = getattr(inner, "pipeline_size", 1) > 1
    tensor_group = _tensor_group(model)
    if pipelined and tensor_group is not None:
        raise ValueError("a model both pipelined and tensor-sharded is not supported by compressed caches: "
                         "shard it one way (load_model(..., parallel='tensor' or 'pipeline'))")
    if pipelined:
        return Sharding(PIPELINE, inner.pipeline_rank, inner.pipeline_size, mx.distributed.init())
    if tensor_group is not None and tensor_group.size() > 1:
        return Sharding(TENSOR, tensor_group.rank(), tensor_group.size(), tensor_group)
    return None


def _tensor_group(model):
    sharded = (nn.AllToShardedLinear, nn.QuantizedAllToShardedLinear)
    for layer in getattr(model, "layers", []) or []:
        if layer is None:
            continue
        for _, module in layer.named_modules():
            if isinstance(module, sharded):
                return module.group
    return None


def first_layer(model) -> int:
    """Index in the whole model of this rank's first layer (0 unless pipelined)."""
    inner = getattr(model, "model", None)
    return getattr(inner, "start_idx", 0) if getattr(inner, "pipeline_size", 1) > 1 else 0


SMALL_INT_LIMIT = 1 << 24  # integers a float32 sum holds exactly


def before_own_collective() -> None:
    """Wait for mlx-lm's generation stream. It evaluates a generation step ahead, and a sharded model's step holds
    collectives: one of ours issued beside them gets paired by the other rank with one of the step's (a gather
    summed to zeros), so every collective outside the model waits for the stream first."""
    mx.synchronize(generation_stream)


def gather_small_ints(values: list, group) -> list:
    """Every rank's list of `values` (ints in [0, 2**24), the same length on every rank), rank by rank.
    Gathered as a float32 `all_sum` of one row per rank: the sum every back end has (the ring back
    end's `all_gather` of integer arrays came back wrong in a test on this machine)."""
    if any(not 0 <= v < SMALL_INT_LIMIT for v in values):
        raise ValueError(f"gather_small_ints takes ints in [0, 2**24), got {values}")
    rows = mx.zeros((group.size(), len(values)), dtype=mx.float32)
    rows[group.rank()] = mx.array(values, dtype=mx.float32)
    before_own_collective()
    summed = mx.distributed.all_sum(rows, group=group, stream=mx.cpu)
    return [[int(v) for v in row] for row in summed.tolist()]


def gather_ints(value: int, group) -> list:
    """Every rank's non-negative `value` (any size), in 20-bit pieces through `gather_small_ints`."""
    pieces = [(value >> shift) & 0xFFFFF for shift in (60, 40, 20, 0)]
    return [(a << 60) | (b << 40) | (c << 20) | d for a, b, c, d in gather_small_ints(pieces, group)]


def whole_model_fingerprint(model, sharding: Sharding) -> dict:
    """`artifacts.model_fingerprint` of the whole model a rank holds a shard of: every rank's
    layer shapes gathered over the group (a collective: every rank calls it together)."""
    local = model_fingerprint(model)
    shapes = local["layer_shapes"]
    start = first_layer(model)
    total = max(end for _, end in gather_small_ints([start, start + len(shapes)], sharding.group))
    own = [[0, 0, 0, 0] for _ in range(total)]
    for i, s in enumerate(shapes):
        own[start + i] = [*(s or (0, 0, 0)), 1 if s else 0]
    gathered = [[row[4 * layer : 4 * layer + 4] for layer in range(total)]
                for row in gather_small_ints([v for row in own for v in row], sharding.group)]
    whole = []
    for layer in range(total):
        seen = [g[layer] for g in gathered if g[layer][3] or sharding.kind == TENSOR]
        if sharding.kind == TENSOR:
            present = {tuple(r[1:3]) for r in seen if r[3]}
            whole.append((sum(r[0] for r in seen), *present.pop()) if present else None)
        else:
            whole.append(tuple(seen[0][:3]) if seen else None)
    identity = model_identity(model)
    identity["num_layers"] = total
    return {**identity, "layer_shapes": whole}


def head_block(model, sharding: Sharding) -> tuple:
    """(first, count) of this tensor-parallel rank's kv heads in each layer of the whole model."""
    shapes = [s for s in model_fingerprint(model)["layer_shapes"] if s]
    heads = shapes[0][0] if shapes else 0
    return sharding.rank * heads, heads


def codecs_for_model(config, model) -> CodecSet:
    """The codecs of `model`'s caches under `config`: the whole model's for an unsharded model,
    this rank's slice of them for a sharded one."""
    sharding = model_sharding(model)
    if sharding is None or config.artifact_dir is None:
        return CodecSet.for_config(config, model_fingerprint(model) if config.artifact_dir else None)
    codecs = load_artifacts(config, whole_model_fingerprint(model, sharding))
    if not codecs.per_layer:
        return codecs
    start, count = first_layer(model), len(model.layers)
    heads = head_block(model, sharding) if sharding.kind == TENSOR else None
    params = {}
    for key, arrays in codecs._params.items():
        if len(key) == 3 and not start <= key[2] < start + count:
            continue
        if len(key) == 3:
            key = (*key[:2], key[2] - start)
            if heads is not None:
                first, n = heads
                arrays = {name: value[first : first + n] if name.startswith(PER_HEAD_PARAMS) else value
                          for name, value in arrays.items()}
        params[key] = arrays
    return CodecSet(config, params, source=codecs.source)


def refuse_first_use_calibration(config, model) -> None:
    """A sharded rank cannot calibrate the whole model on first use: it sees only its shard."""
    from .calibration import AUTO

    sharding = model_sharding(model)
    if sharding is not None and config.artifact_dir == AUTO:
        raise ValueError(f"{config.describe()} calibrates on first use, which a {sharding.describe()} cannot do "
                         "for the whole model: calibrate once in one process (`veloxquant calibrate --model M "
                         "--out DIR`) and pass --artifact-dir DIR; every world size uses that one dir")


class _PipelineTail:
    """Mixin for a pipeline rank's last cache. mlx-lm's pipelined models tie the send of the
    hidden state to the next rank onto `cache[-1].keys` (`mx.depends`), so that evaluating the
    caches during prefill also sends; a compressed cache's `keys` is a decoded copy, so it keeps that
    array instead and evaluates it whenever its state is read."""

    _pipeline_marker = None

    @property
    def keys(self):
        return self._pipeline_marker if self._pipeline_marker is not None else mx.array(0)

    @keys.setter
    def keys(self, value):
        self._pipeline_marker = value

    @property
    def state(self):
        if self._pipeline_marker is not None:
            mx.eval(self._pipeline_marker)
            self._pipeline_marker = None
        return super().state

    @state.setter
    def state(self, value):
        super(_PipelineTail, type(self)).state.fset(self, value)

    @classmethod
    def merge(cls, caches):
        """mlx-lm's batch generator merges each layer's rows through the first row's `merge`: the batch
        of the last layer's rows is the tail the model then sends through."""
        return _as_tail(super().merge(caches))


_TAIL_CLASSES = {}


def _as_tail(cache):
    base = type(cache)
    # The caches whose `keys` is decoded rather than held (an MLA latent cache's `keys` is its newest array).
    if not isinstance(cache, _PipelineTail) and isinstance(cache, DecodedReads):
        tail = _TAIL_CLASSES.get(base)
        if tail is None:  # named as its base: a saved file names the base class, which mlx-lm loads
            tail = _TAIL_CLASSES[base] = type(base.__name__, (_PipelineTail, base), {"__module__": base.__module__})
        cache.__class__ = tail
    return cache


def mark_pipeline_tail(model, caches: list) -> list:
    """`caches` with the last one made a `_PipelineTail` on a pipeline rank that sends (rank > 0)."""
    sharding = model_sharding(model)
    if sharding is None or sharding.kind != PIPELINE or sharding.rank == 0 or not caches:
        return caches
    _as_tail(caches[-1])
    return caches


class RankLostError(ConnectionError):
    """Another rank of the group stopped (exited or crashed), so this one cannot go on."""


PEER_LOSS_MARKS = ("connection to a peer was lost", "closed by the peer", "Failing pending tasks",
                   "Connection reset", "Broken pipe")


@contextmanager
def rank_loss_is_an_error(group=None):
    """Turn the back end's error on a lost peer into a `RankLostError` that says what happened
    (the ring back end raises "[ring] connection to a peer was lost" in whichever call waits on it)."""
    try:
        yield
    except RuntimeError as error:
        group = group or mx.distributed.init()
        if group.size() > 1 and any(mark in str(error) for mark in PEER_LOSS_MARKS):
            raise RankLostError(f"rank {group.rank()} of {group.size()}: another rank stopped (exited or crashed), "
                                f"so this one stops too ({error})") from None
        raise
