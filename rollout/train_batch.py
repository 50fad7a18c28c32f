"""The training batch file: what the master hands the trainer for one iteration.

    torch.save({
        "schema": "coordinator/train-batch", "version": 1,
        "iteration": int, "group_size": int,
        "task_ids": list[str],            # one per sample
        "group_index": LongTensor[S],     # 0,0,..,1,1,..: contiguous groups, one task each
        "prompt_ids": list[list[int]],
        "response_ids": list[list[int]],
        "old_logprobs": list[list[float]],  # one per response token
        "rewards": FloatTensor[S],
    })

Failed samples are not in the batch.  A group keeps its place if at least
min(2, group_size) of its samples remain, because a group-relative advantage
needs two samples to compare; smaller remnants are dropped whole.  So a group
has between min(2, group_size) and group_size samples, and S may be 0 when
every group failed.

Loading uses torch.load(weights_only=True), whose pure-Python unpickler reads
list[list[int]] at roughly a million ints per second; the flat-tensor chunk
files are the fast path, this schema is the trainer's contract.
"""

from __future__ import annotations

import dataclasses
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch

from coordinator.fsio import publish_bytes, read_bytes
from rollout.errors import MalformedRecordError

TRAIN_BATCH_SCHEMA: Final = "coordinator/train-batch"
TRAIN_BATCH_VERSION: Final = 1


class TrainBatchError(MalformedRecordError):
    """A training batch violates its schema (in memory or on disk)."""


def min_group_samples(group_size: int) -> int:
    """Fewest surviving samples for a group to stay in the batch."""
    return min(2, group_size)


@dataclass(frozen=True, kw_only=True)
class TrainBatch:
    iteration: int
    group_size: int
    task_ids: list[str]
    group_index: torch.Tensor
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    old_logprobs: list[list[float]]
    rewards: torch.Tensor

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def num_samples(self) -> int:
        return len(self.task_ids)

    @property
    def num_groups(self) -> int:
        return int(self.group_index[-1]) + 1 if self.num_samples else 0

    def to_payload(self) -> dict[str, Any]:
        return {
            "schema": TRAIN_BATCH_SCHEMA,
            "version": TRAIN_BATCH_VERSION,
            "iteration": self.iteration,
            "group_size": self.group_size,
            "task_ids": self.task_ids,
            "group_index": self.group_index,
            "prompt_ids": self.prompt_ids,
            "response_ids": self.response_ids,
            "old_logprobs": self.old_logprobs,
            "rewards": self.rewards,
        }


def _validate(b: TrainBatch) -> None:
    def bad(problem: str) -> TrainBatchError:
        return TrainBatchError(f"train batch of iteration {b.iteration!r}: {problem}")

    for name in ("iteration", "group_size"):
        value = getattr(b, name)
        if type(value) is not int or value < (0 if name == "iteration" else 1):
            raise bad(f"{name}={value!r} is not a valid integer")
    s = len(b.task_ids) if isinstance(b.task_ids, list) else -1
    if s < 0 or not all(isinstance(t, str) and t for t in b.task_ids):
        raise bad("task_ids must be a list of non-empty strings")
    for name, dtype in (("group_index", torch.int64), ("rewards", torch.float32)):
        t = getattr(b, name)
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.shape != (s,):
            raise bad(f"{name} must be a {dtype} tensor of shape ({s},), one entry per sample")
    for name in ("prompt_ids", "response_ids", "old_logprobs"):
        rows = getattr(b, name)
        if not isinstance(rows, list) or len(rows) != s:
            raise bad(f"{name} must be a list of {s} lists, one per sample")
    for i in range(s):
        prompt, response, logprobs = b.prompt_ids[i], b.response_ids[i], b.old_logprobs[i]
        if not isinstance(prompt, list) or not prompt or not all(type(x) is int for x in prompt):
            raise bad(f"prompt_ids[{i}] must be a non-empty list of ints")
        if not isinstance(response, list) or not all(type(x) is int for x in response):
            raise bad(f"response_ids[{i}] must be a list of ints")
        if not isinstance(logprobs, list) or len(logprobs) != len(response):
            raise bad(f"old_logprobs[{i}] must hold one float per response token ({len(response)})")
        if not all(type(x) is float and math.isfinite(x) for x in logprobs):
            raise bad(f"old_logprobs[{i}] must be finite floats")
    if s == 0:
        return
    if not bool(torch.isfinite(b.rewards).all()):
        raise bad("rewards must be finite")
    gi = b.group_index
    steps = gi.diff()
    if int(gi[0]) != 0 or bool(((steps != 0) & (steps != 1)).any()):
        raise bad("group_index must count groups contiguously from 0 (0,0,1,1,2,...)")
    sizes = torch.bincount(gi)
    lowest = min_group_samples(b.group_size)
    if int(sizes.min()) < lowest or int(sizes.max()) > b.group_size:
        raise bad(f"every group must hold {lowest}..{b.group_size} samples")
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)[:-1]]).tolist()
    seen: set[str] = set()
    for g, (start, size) in enumerate(zip(starts, sizes.tolist(), strict=True)):
        task = b.task_ids[start]
        if task in seen or any(t != task for t in b.task_ids[start : start + size]):
            raise bad(f"group {g} must be the samples of one task, and each task one group")
        seen.add(task)


def save_train_batch(path: Path, batch: TrainBatch) -> None:
    """Publish the batch atomically (temp file, fsync, rename)."""
    buffer = io.BytesIO()
    torch.save(batch.to_payload(), buffer)
    publish_bytes(Path(path), buffer.getvalue())


def load_train_batch(path: Path) -> TrainBatch:
    """Load with weights_only=True and validate strictly; TrainBatchError naming path."""
    path = Path(path)
    try:
        obj = torch.load(io.BytesIO(read_bytes(path)), weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise
    except Exception as exc:  # UnpicklingError (forbidden global), RuntimeError (bad zip), OSError
        raise TrainBatchError(
            f"train batch {path} was refused by torch.load(weights_only=True): "
            f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}",
            path=path,
        ) from exc
    if not isinstance(obj, dict):
        raise TrainBatchError(
            f"train batch {path} is a {type(obj).__name__}, not a dict", path=path
        )
    if obj.get("schema") != TRAIN_BATCH_SCHEMA or obj.get("version") != TRAIN_BATCH_VERSION:
        raise TrainBatchError(
            f"train batch {path} has schema {obj.get('schema')!r} version {obj.get('version')!r}: "
            f"expected {TRAIN_BATCH_SCHEMA!r} version {TRAIN_BATCH_VERSION}",
            path=path,
        )
    fields = tuple(f.name for f in dataclasses.fields(TrainBatch))
    missing = [f for f in fields if f not in obj]
    if missing:
        raise TrainBatchError(f"train batch {path} lacks fields {missing}", path=path)
    try:
        return TrainBatch(**{f: obj[f] for f in fields})
    except TrainBatchError as exc:
        raise TrainBatchError(f"{path}: {exc}", path=path) from exc
