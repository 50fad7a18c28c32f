"""The resumable training state of one iteration: weights, optimizer and step.

A resident trainer keeps these in memory from one iteration to the next and
writes them to the run directory only every `train.save_interval`
iterations and at the run's last one (the policy checkpoint, which the
engines need, is published every iteration regardless):

    <state root>/iter-<NNNNNN>/shard-<K>.pt    torch.save of a versioned dict:
        schema, version, iteration, shard, shards, world_size, strategy, step,
        weights {parameter name: fp32 tensor}  the master weights (this shard's
                                               slices under FSDP2)
        optimizer                              torch.optim state_dict (moments)
    <state root>/iter-<NNNNNN>/shard-<K>.json  its index: the same numbers plus
                                               the .pt's size and SHA-256,
                                               published after it

Shards: one for a single process or DDP (replicas are equal, so trainer rank
0 writes the only one and every rank of any world size loads it), one per
rank under FSDP2 (each rank's own slices; they fit only a group of the same
size).  A state is complete when every shard's index is readable and they
agree; a shard is loaded only if its file still has the size and SHA-256 its
index gives (coordinator/storage/verified.py) and passes torch.load(weights_only=True).
Reading a state never trusts a directory listing: a listing only proposes
candidates, each checked by opening its indexes.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

import torch
from torch import Tensor

from coordinator.errors import IntegrityError, MalformedRecordError
from coordinator.storage import fsio, trees
from coordinator.storage.store import read_document
from coordinator.storage.verified import read_verified
from rollout.errors import CheckpointError
from rollout.tensor_files import load_tensors

log = logging.getLogger("trainer")

SCHEMA: Final = "coordinator/train-state"
INDEX_SCHEMA: Final = "coordinator/train-state-index"
VERSION: Final = 1
_DIR = re.compile(r"iter-(\d{6})")


def state_dir(root: Path, iteration: int) -> Path:
    return root / f"iter-{iteration:06d}"


def _shard_file(directory: Path, shard: int, suffix: str) -> Path:
    return directory / f"shard-{shard}.{suffix}"


@dataclass(frozen=True, kw_only=True)
class ShardIndex:
    """What `shard-<K>.json` says of its `.pt` file."""

    iteration: int
    shard: int
    shards: int
    world_size: int
    strategy: str
    step: int  # optimizer steps taken by the end of `iteration`, over the run
    size: int  # bytes
    sha256: str

    @classmethod
    def parse(cls, raw: bytes, where: Path) -> ShardIndex:
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise MalformedRecordError(where, f"is not JSON: {exc}") from exc
        if not isinstance(data, dict) or data.get("schema") != INDEX_SCHEMA \
                or data.get("version") != VERSION:
            raise MalformedRecordError(where, f"is not a {INDEX_SCHEMA} v{VERSION} record")
        numbers = {}
        for key in ("iteration", "shard", "shards", "world_size", "step", "size"):
            value = data.get(key)
            if type(value) is not int or value < 0:
                raise MalformedRecordError(where, f"field {key}={value!r} must be an int >= 0")
            numbers[key] = value
        sha, strategy = data.get("sha256"), data.get("strategy")
        if not isinstance(sha, str) or not re.fullmatch(r"[0-9a-f]{64}", sha):
            raise MalformedRecordError(where, f"field sha256={sha!r} is not 64 hex digits")
        if not isinstance(strategy, str):
            raise MalformedRecordError(where, f"field strategy={strategy!r} is not a string")
        index = cls(**numbers, sha256=sha, strategy=strategy)
        if not index.shard < index.shards <= index.world_size:
            raise MalformedRecordError(where, f"shard {index.shard} of {index.shards} in a "
                                              f"world of {index.world_size} is impossible")
        return index

    def to_bytes(self) -> bytes:
        return (json.dumps({"schema": INDEX_SCHEMA, "version": VERSION, **asdict(self)},
                           indent=2) + "\n").encode()


@dataclass(frozen=True, kw_only=True)
class Shard:
    """One loaded shard: its index, the master weights by name, the optimizer's state."""

    index: ShardIndex
    weights: dict[str, Tensor]
    optimizer: dict[str, Any]


def save_shard(directory: Path, *, iteration: int, shard: int, shards: int, world_size: int,
               strategy: str, step: int, weights: dict[str, Tensor],
               optimizer: dict[str, Any]) -> ShardIndex:
    """Publish one shard, then its index (the index's presence means the .pt is whole)."""
    buffer = io.BytesIO()
    torch.save({"schema": SCHEMA, "version": VERSION, "iteration": iteration, "shard": shard,
                "shards": shards, "world_size": world_size, "strategy": strategy, "step": step,
                "weights": weights, "optimizer": optimizer}, buffer)
    data = buffer.getvalue()
    index = ShardIndex(iteration=iteration, shard=shard, shards=shards, world_size=world_size,
                       strategy=strategy, step=step, size=len(data),
                       sha256=hashlib.sha256(data).hexdigest())
    fsio.publish_bytes(_shard_file(directory, shard, "pt"), data)
    fsio.publish_bytes(_shard_file(directory, shard, "json"), index.to_bytes())
    return index


def read_index(directory: Path, shard: int) -> ShardIndex | None:
    """The index of one shard; None when it is missing; CheckpointError when malformed."""
    path = _shard_file(directory, shard, "json")
    try:
        return read_document(path, ShardIndex.parse)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unusable training-state index ({exc})",
                              path=path) from exc


def complete_state(directory: Path) -> tuple[ShardIndex, ...]:
    """Every shard's index of the state in `directory`; CheckpointError saying what lacks."""
    first = read_index(directory, 0)
    if first is None:
        raise CheckpointError(f"{directory}: no training state (shard-0.json is missing)",
                              path=directory)
    found = [first]
    for shard in range(1, first.shards):
        index = read_index(directory, shard)
        if index is None:
            raise CheckpointError(f"{directory}: incomplete training state: shard {shard} of "
                                  f"{first.shards} is missing", path=directory)
        found.append(index)
    for index in found:
        same = (index.iteration, index.shards, index.world_size, index.strategy, index.step)
        if same != (first.iteration, first.shards, first.world_size, first.strategy,
                    first.step) or index.iteration != _iteration_of(directory):
            raise CheckpointError(f"{directory}: shard {index.shard} belongs to another state "
                                  f"(iteration {index.iteration}, step {index.step})",
                                  path=directory)
    return tuple(found)


def _iteration_of(directory: Path) -> int | None:
    match = _DIR.fullmatch(directory.name)
    return int(match.group(1)) if match else None


def saved_iterations(root: Path) -> list[int]:
    """Iterations a directory listing shows a state for, newest first (a hint only)."""
    names = trees.listdir(root)
    found = (_DIR.fullmatch(name) for name in names)
    return sorted((int(m.group(1)) for m in found if m), reverse=True)


def newest_complete(root: Path, *, before: int) -> tuple[int, tuple[ShardIndex, ...]] | None:
    """The newest complete state of an iteration before `before`, checked by reading."""
    for iteration in saved_iterations(root):
        if iteration >= before:
            continue
        try:
            return iteration, complete_state(state_dir(root, iteration))
        except CheckpointError as exc:
            log.warning("skipping the training state of iteration %d: %s", iteration, exc)
    return None


def load_shard(directory: Path, index: ShardIndex) -> Shard:
    """Shard `index.shard` of the state in `directory`, exactly as its index describes it."""
    path = _shard_file(directory, index.shard, "pt")
    try:
        with read_verified(path, size=index.size, sha256=index.sha256) as file:
            data = load_tensors(path, file.source(), mmap=False)
    except (OSError, IntegrityError, MalformedRecordError) as exc:
        raise CheckpointError(f"{path}: unusable training state ({exc})", path=path) from exc
    if not isinstance(data, dict) or data.get("schema") != SCHEMA \
            or data.get("version") != VERSION:
        raise CheckpointError(f"{path}: not a {SCHEMA} v{VERSION} file", path=path)
    if any(data.get(k) != getattr(index, k) for k in ("iteration", "shard", "step")):
        raise CheckpointError(f"{path}: its numbers differ from its index", path=path)
    weights, optimizer = data.get("weights"), data.get("optimizer")
    if not isinstance(weights, dict) or not all(
            isinstance(k, str) and isinstance(v, Tensor) for k, v in weights.items()):
        raise CheckpointError(f"{path}: field weights is not a name -> tensor map", path=path)
    if not isinstance(optimizer, dict) or set(optimizer) != {"state", "param_groups"}:
        raise CheckpointError(f"{path}: field optimizer is not an optimizer state_dict",
                              path=path)
    return Shard(index=index, weights=weights, optimizer=optimizer)


def prune(root: Path, *, keep: int) -> list[int]:
    """Remove the states of iterations before `keep` (the newest complete one)."""
    removed = []
    for iteration in saved_iterations(root):
        if iteration < keep and fsio.remove_tree(state_dir(root, iteration)):
            removed.append(iteration)
    return removed
