"""Prompt-cache files of a sharded model: one file per rank, each the library's checked prompt-cache
file (`integration.save_prompt_cache`), and a manifest naming the world size, the sharding and each
file's SHA-256. Every rank writes its own file and the same manifest, so ranks on other hosts each
keep a complete copy of what they need. Loading at another world size or sharding is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Optional, Tuple


from .cache import CacheFormatError
from .integration import load_prompt_cache, save_prompt_cache
from .sharding import gather_small_ints, model_sharding

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1


def rank_file(directory, rank: int, size: int) -> Path:
    return Path(directory) / f"rank{rank}-of-{size}.safetensors"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _gathered_digests(digest: str, sharding) -> list:
    """Every rank's file digest (hex), gathered over the group."""
    if sharding is None:
        return [digest]
    return [bytes(row).hex() for row in gather_small_ints(list(bytes.fromhex(digest)), sharding.group)]


def save_sharded_prompt_cache(directory, caches: list, model, metadata: Optional[dict] = None,
                              force: bool = True) -> Path:
    """Write this rank's caches to DIRECTORY/rank{R}-of-{N}.safetensors and the manifest (a
    collective: every rank calls it together). Returns the manifest's path. Without `force`, a
    DIRECTORY that exists on any rank's host is refused on every rank, before any rank writes."""
    sharding = model_sharding(model)
    rank, size = (sharding.rank, sharding.size) if sharding else (0, 1)
    kind = sharding.kind if sharding else "none"
    directory = Path(directory)
    if not force:
        exists = int(directory.exists())
        if sharding is not None:
            exists = sum(row[0] for row in gather_small_ints([exists], sharding.group))
        if exists:
            raise FileExistsError(f"{directory} exists; pass --force to replace it")
    path = rank_file(directory, rank, size)
    shard_metadata = {**(metadata or {}), "shard_rank": str(rank), "shard_size": str(size), "shard_kind": kind}

    def write():
        directory.mkdir(parents=True, exist_ok=True)
        save_prompt_cache(path, caches, shard_metadata)
        return _sha256(path)

    digests = _gathered_digests(on_every_rank(write, sharding, f"write {directory}"), sharding)
    manifest = {"format": MANIFEST_FORMAT, "world_size": size, "sharding": kind,
                "files": [{"rank": r, "file": rank_file(directory, r, size).name, "sha256": d}
                          for r, d in enumerate(digests)],
                "metadata": metadata or {}}
    temp = directory / f".{MANIFEST}.{rank}.tmp"
    temp.write_text(json.dumps(manifest, indent=2))
    os.replace(temp, directory / MANIFEST)  # ranks sharing a folder write the same bytes
    return directory / MANIFEST


def read_manifest(directory) -> dict:
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise CacheFormatError(f"{directory} has no {MANIFEST}: not a sharded prompt cache "
                               "(save_sharded_prompt_cache writes one)") from None
    except ValueError as error:
        raise CacheFormatError(f"{path} is unreadable: {error}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise CacheFormatError(f"{path} is not a format-{MANIFEST_FORMAT} sharded prompt-cache manifest")
    return manifest


def load_sharded_prompt_cache(directory, model, config=None) -> Tuple[list, dict]:
    """(caches, metadata) of this rank's file in DIRECTORY, refusing a cache saved at another world
    size or sharding, a file that fails the manifest's digest, and anything `load_prompt_cache` refuses,
    on every rank where any rank refuses (a collective)."""
    sharding = model_sharding(model)
    return on_every_rank(lambda: _load_rank_file(directory, model, config, sharding), sharding, f"load {directory}")


def on_every_rank(action, sharding, what: str):
    """`action()`'s result where it succeeds on every rank of `sharding`; its error on the rank where it failed,
    and on the others an error naming that rank, so that no rank goes on while another does not (one all_sum)."""
    try:
        result, error = action(), None
    except Exception as failure:  # noqa: BLE001 (re-raised below, on this rank and, named, on the others)
        result, error = None, failure
    if sharding is not None:
        failed = [r for r, row in enumerate(gather_small_ints([int(error is not None)], sharding.group)) if row[0]]
        if failed and error is None:
            raise CacheFormatError(f"could not {what}: rank(s) {', '.join(map(str, failed))} failed (their error "
                                   "is on their own output)")
    if error is not None:
        raise error
    return result


def _load_rank_file(directory, model, config, sharding) -> Tuple[list, dict]:
    rank, size = (sharding.rank, sharding.size) if sharding else (0, 1)
    kind = sharding.kind if sharding else "none"
    manifest = read_manifest(directory)
    saved_size, saved_kind = manifest.get("world_size"), manifest.get("sharding")
    if saved_size != size or saved_kind != kind:
        raise CacheFormatError(
            f"{directory} was saved by {saved_size} rank(s) ({saved_kind} sharding), and this run has {size} "
            f"({kind}): each rank's file holds only its own heads or layers, so relaunch with "
            f"mlx.launch -n {saved_size}{' --pipeline' if saved_kind == 'pipeline' else ''}, or prefill again")
    entry = next((f for f in manifest.get("files", []) if f.get("rank") == rank), None)
    if entry is None:
        raise CacheFormatError(f"{directory}/{MANIFEST} lists no file for rank {rank}")
    path = Path(directory) / entry["file"]
    if not path.is_file():
        raise CacheFormatError(f"{path} (rank {rank}'s file) is missing")
    if _sha256(path) != entry["sha256"]:
        raise CacheFormatError(f"{path} fails the manifest's SHA-256: corrupted, or another save's file")
    caches, metadata = load_prompt_cache(path, config, return_metadata=True, model=model)
    if metadata.pop("shard_rank", None) != str(rank) or metadata.pop("shard_size", None) != str(size):
        raise CacheFormatError(f"{path} is not rank {rank}'s file of {size}")
    metadata.pop("shard_kind", None)
    return caches, metadata
