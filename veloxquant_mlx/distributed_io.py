"""The commands under `mlx.launch`: every rank runs the model, rank 0 alone reads and writes, as
mlx-lm's server and chat do. Lines read on rank 0 reach the others through `mx.distributed`."""

from __future__ import annotations

import os
import sys
from typing import Optional

import mlx.core as mx

from .sharding import before_own_collective


def world():
    """This process's group: `mx.distributed.init()` (one rank when not started by mlx.launch)."""
    return mx.distributed.init()


def load_for_args(args):
    """(model, tokenizer) of `args.model`, this rank's shard when launched on several ranks."""
    from .models import load_model

    group = world()
    if group.size() == 1:
        if getattr(args, "pipeline", False):
            raise ValueError("--pipeline splits the model over the ranks of mlx.launch; this run has one rank")
        return load_model(args.model)
    return load_model(args.model, group=group, parallel="pipeline" if getattr(args, "pipeline", False) else "tensor")


def rank_zero_stdout():
    """stdout on rank 0; a sink on every other rank (their text is rank 0's)."""
    return sys.stdout if world().rank() == 0 else open(os.devnull, "w")


def share_text(text: Optional[str], group=None) -> Optional[str]:
    """Rank 0's `text` (None included) on every rank; a collective."""
    group = group or world()
    if group.size() == 1:
        return text
    before_own_collective()
    if group.rank() == 0:
        data = mx.array(list(text.encode()) if text is not None else [], dtype=mx.uint8)
        size = mx.distributed.all_sum(mx.array(data.size + 1 if text is not None else 0), stream=mx.cpu).item()
        if size > 1:
            mx.eval(mx.distributed.all_sum(data, stream=mx.cpu))
        return text
    size = mx.distributed.all_sum(mx.array(0), stream=mx.cpu).item()
    if size == 0:
        return None
    if size == 1:
        return ""
    data = mx.distributed.all_sum(mx.zeros((size - 1,), dtype=mx.uint8), stream=mx.cpu)
    return bytes(data.tolist()).decode()


class SharedStdin:
    """A stdin that rank 0 reads and every rank sees: each `readline` is a collective."""

    def __init__(self, stdin=None):
        self.stdin = stdin or sys.stdin
        self.group = world()

    def isatty(self) -> bool:
        return self.group.rank() == 0 and self.stdin.isatty()

    def readline(self) -> str:
        line = self.stdin.readline() if self.group.rank() == 0 else None
        return share_text(line, self.group) or ""


def rank_label() -> str:
    group = world()
    return "" if group.size() == 1 else f" (rank {group.rank()} of {group.size()})"


def caches_nbytes_per_rank(caches) -> list:
    """Each rank's cache bytes (`nbytes`), gathered over the group; a collective."""
    mine = sum(getattr(c, "nbytes", 0) for c in caches)
    group = world()
    if group.size() == 1:
        return [mine]
    from .sharding import gather_ints

    return gather_ints(mine, group)

