"""The training batch file: what the master hands the trainer for one iteration.

Schema version 2, a torch.save'd dict of flat tensors plus offsets (like the
rank chunk files), so that torch.load(weights_only=True) runs at disk speed:

    {
        "schema": "coordinator/train-batch", "version": 2,
        "iteration": int, "group_size": int,
        "group_task_ids": list[str],          # one per group, each task once
        "group_index": int64[S],              # 0,0,..,1,1,..: contiguous groups
        "prompt_tokens": int32[P],            # sample s: [prompt_offsets[s], prompt_offsets[s+1])
        "prompt_offsets": int64[S+1],
        "response_tokens": int32[R],          # sample s: [response_offsets[s], response_offsets[s+1])
        "response_offsets": int64[S+1],
        "response_logprobs": float32[R],      # the engine's log-prob of each response token
        "rewards": float32[S],
    }

Failed samples are not in the batch.  A group keeps its place if at least
min(2, group_size) of its samples remain, because a group-relative advantage
needs two samples to compare; smaller remnants are dropped whole.  So a group
has between min(2, group_size) and group_size samples, and S may be 0.

Version 1 stored list[list[int]]; the weights_only unpickler reads those at
about a million Python ints per second (30 s for a 71 MiB batch), so version
1 files are refused rather than read.

Writing streams: TrainBatchWriter lays the file out first (torch.save under
skip_data reserves each tensor's bytes without writing them), then writes the
token arrays piece by piece at their offsets, so the master never holds the
whole batch in memory.  The file appears under its name only when complete.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from types import TracebackType
from typing import Any, Final

import torch

from coordinator import beneath
from coordinator.errors import MalformedRecordError as CoordinatorMalformed
from coordinator.fsio import (
    FILE_MODE,
    STATS,
    ensure_dir,
    fsync_dir,
    open_regular,
    remove,
    rename,
    temp_name,
)
from coordinator.verified import read_verified
from rollout.errors import MalformedRecordError

TRAIN_BATCH_SCHEMA: Final = "coordinator/train-batch"
TRAIN_BATCH_VERSION: Final = 2
PER_SAMPLE: Final = ("group_index", "prompt_offsets", "response_offsets", "rewards")
FLAT: Final = {  # name -> (dtype, the offsets that delimit it)
    "prompt_tokens": (torch.int32, "prompt_offsets"),
    "response_tokens": (torch.int32, "response_offsets"),
    "response_logprobs": (torch.float32, "response_offsets"),
}
_DTYPES: Final = {
    "group_index": torch.int64,
    "prompt_offsets": torch.int64,
    "response_offsets": torch.int64,
    "rewards": torch.float32,
    **{name: dtype for name, (dtype, _) in FLAT.items()},
}
_MAX_WRITE: Final = 1 << 30  # Linux writes at most ~2 GiB per call; stay well below


class TrainBatchError(MalformedRecordError):
    """A training batch violates its schema (in memory or on disk)."""


def min_group_samples(group_size: int) -> int:
    """Fewest surviving samples for a group to stay in the batch."""
    return min(2, group_size)


def _min_max(t: torch.Tensor) -> tuple[float, float]:
    """Both extremes of a non-empty CPU tensor; NaN if it holds any NaN.

    numpy rather than torch: torch starts an OpenMP region per reduction, and
    on busy cores each region waits for a thread to be scheduled, which made
    checking a batch piece by piece 100x slower than the check itself.
    """
    values = t.detach().numpy()
    return float(values.min()), float(values.max())


def _finite(t: torch.Tensor) -> bool:
    # min/max propagate NaN and need no temporary, unlike isfinite(t).all().
    return t.numel() == 0 or all(math.isfinite(v) for v in _min_max(t))


def _check_layout(
    bad: Callable[[str], TrainBatchError],
    *,
    iteration: Any,
    group_size: Any,
    group_task_ids: Any,
    tensors: dict[str, Any],
) -> None:
    """Everything but the flat token arrays, vectorised: O(samples), no per-token work."""
    for name, value, lowest in (("iteration", iteration, 0), ("group_size", group_size, 1)):
        if type(value) is not int or value < lowest:
            raise bad(f"{name}={value!r} is not a valid integer (>= {lowest})")
    if not isinstance(group_task_ids, tuple | list) or not all(
        isinstance(t, str) and t for t in group_task_ids
    ):
        raise bad("group_task_ids must be a list of non-empty strings, one per group")
    first = tensors.get("group_index")
    s = first.numel() if isinstance(first, torch.Tensor) else 0
    for name in PER_SAMPLE:
        t, dtype = tensors.get(name), _DTYPES[name]
        shape = (s + 1,) if name.endswith("offsets") else (s,)
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.shape != shape:
            raise bad(f"{name} must be a {dtype} tensor of shape {shape} for {s} samples")
    for name in ("prompt_offsets", "response_offsets"):
        steps = tensors[name].diff()
        lowest = 1 if name == "prompt_offsets" else 0  # a response may be empty, a prompt not
        if int(tensors[name][0]) != 0 or (s and int(steps.min()) < lowest):
            raise bad(
                f"{name} must start at 0 and rise by >= {lowest} per sample "
                f"({'non-empty prompts' if lowest else 'monotonic'})"
            )
    if s == 0:
        if group_task_ids:
            raise bad(f"{len(group_task_ids)} group_task_ids for an empty batch")
        return
    if not _finite(tensors["rewards"]):
        raise bad("rewards must be finite")
    gi = tensors["group_index"]
    steps = gi.diff()
    if int(gi[0]) != 0 or bool(((steps != 0) & (steps != 1)).any()):
        raise bad("group_index must count groups contiguously from 0 (0,0,1,1,2,...)")
    if int(gi[-1]) + 1 != len(group_task_ids):
        raise bad(
            f"group_index names {int(gi[-1]) + 1} groups, group_task_ids {len(group_task_ids)}"
        )
    sizes = torch.bincount(gi)
    lowest = min_group_samples(group_size)
    if int(sizes.min()) < lowest or int(sizes.max()) > group_size:
        raise bad(f"every group must hold {lowest}..{group_size} samples")
    if len(set(group_task_ids)) != len(group_task_ids):
        raise bad("group_task_ids repeats a task: each task must be exactly one group")


def _check_flat(bad: Callable[[str], TrainBatchError], name: str, t: Any, numel: int) -> None:
    dtype = FLAT[name][0]
    if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != 1 or t.numel() != numel:
        raise bad(f"{name} must be a 1-D {dtype} tensor of {numel} entries, as its offsets say")
    if t.device.type != "cpu":
        raise bad(f"{name} is on {t.device}: give CPU tensors")
    if dtype == torch.int32 and numel and (lowest := _min_max(t)[0]) < 0:
        raise bad(f"{name} holds a negative token id ({int(lowest)})")
    if dtype == torch.float32 and not _finite(t):
        raise bad(f"{name} must be finite (clamp -inf log-probs before recording)")


def _rows(flat: torch.Tensor, offsets: torch.Tensor) -> list[list[Any]]:
    values, off = flat.tolist(), offsets.tolist()  # C-speed conversions, then list slicing
    return [values[a:b] for a, b in itertools.pairwise(off)]


@dataclass(frozen=True, kw_only=True, eq=False)
class TrainBatch:
    """A validated batch in flat tensors, with per-sample list views for the trainer.

    The list views (task_ids, prompt_ids, response_ids, old_logprobs) are built
    once on first use and must be treated as read-only.
    """

    iteration: int
    group_size: int
    group_task_ids: tuple[str, ...]
    group_index: torch.Tensor
    prompt_tokens: torch.Tensor
    prompt_offsets: torch.Tensor
    response_tokens: torch.Tensor
    response_offsets: torch.Tensor
    response_logprobs: torch.Tensor
    rewards: torch.Tensor

    def __post_init__(self) -> None:
        def bad(problem: str) -> TrainBatchError:
            return TrainBatchError(f"train batch of iteration {self.iteration!r}: {problem}")

        tensors = {name: getattr(self, name) for name in _DTYPES}
        _check_layout(
            bad,
            iteration=self.iteration,
            group_size=self.group_size,
            group_task_ids=self.group_task_ids,
            tensors=tensors,
        )
        object.__setattr__(self, "group_task_ids", tuple(self.group_task_ids))
        for name, (_, offsets) in FLAT.items():
            _check_flat(bad, name, tensors[name], int(tensors[offsets][-1]))

    @classmethod
    def from_lists(
        cls,
        *,
        iteration: int,
        group_size: int,
        task_ids: Sequence[str],
        group_index: torch.Tensor,
        prompt_ids: Sequence[Sequence[int]],
        response_ids: Sequence[Sequence[int]],
        old_logprobs: Sequence[Sequence[float]],
        rewards: torch.Tensor,
    ) -> TrainBatch:
        """Build from per-sample lists (tests, small producers); per-element Python work."""

        def bad(problem: str) -> TrainBatchError:
            return TrainBatchError(f"train batch of iteration {iteration!r}: {problem}")

        s = len(task_ids)
        for name, rows in (
            ("prompt_ids", prompt_ids),
            ("response_ids", response_ids),
            ("old_logprobs", old_logprobs),
        ):
            if len(rows) != s:
                raise bad(f"{name} has {len(rows)} rows for {s} task_ids: give one per sample")
        for i in range(s):
            prompt, response, logprobs = prompt_ids[i], response_ids[i], old_logprobs[i]
            if not prompt or not all(type(x) is int for x in prompt):
                raise bad(f"prompt_ids[{i}] must be a non-empty list of ints")
            if not all(type(x) is int for x in response):
                raise bad(f"response_ids[{i}] must be a list of ints")
            if len(logprobs) != len(response):
                raise bad(
                    f"old_logprobs[{i}] must hold one float per response token ({len(response)})"
                )
        if not isinstance(group_index, torch.Tensor) or group_index.shape != (s,):
            raise bad(f"group_index must be a tensor of shape ({s},), one entry per sample")
        first: dict[int, str] = {}  # group -> its first sample's task; checked after the layout
        for i, g in enumerate(group_index.tolist()):
            first.setdefault(g, task_ids[i])

        def flat(rows: Sequence[Sequence[Any]], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor([v for row in rows for v in row], dtype=dtype)

        def offsets(rows: Sequence[Sequence[Any]]) -> torch.Tensor:
            return torch.tensor([0, *(len(r) for r in rows)], dtype=torch.int64).cumsum(0)

        try:
            batch = cls(
                iteration=iteration,
                group_size=group_size,
                group_task_ids=tuple(first[g] for g in sorted(first)),
                group_index=group_index,
                prompt_tokens=flat(prompt_ids, torch.int32),
                prompt_offsets=offsets(prompt_ids),
                response_tokens=flat(response_ids, torch.int32),
                response_offsets=offsets(response_ids),
                response_logprobs=flat(old_logprobs, torch.float32),
                rewards=rewards,
            )
        except (RuntimeError, TypeError) as exc:  # ids beyond int32, non-numbers
            raise bad(f"token ids and log-probs must be int32 ints and floats: {exc}") from exc
        for i, (task, g) in enumerate(zip(task_ids, group_index.tolist(), strict=True)):
            if task != batch.group_task_ids[g]:
                raise bad(f"group {g} must be the samples of one task (sample {i} is {task!r})")
        return batch

    @property
    def num_samples(self) -> int:
        return int(self.group_index.numel())

    @property
    def num_groups(self) -> int:
        return len(self.group_task_ids)

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.response_offsets.diff()

    @cached_property
    def task_ids(self) -> list[str]:
        ids = self.group_task_ids
        return [ids[g] for g in self.group_index.tolist()]

    @cached_property
    def prompt_ids(self) -> list[list[int]]:
        return _rows(self.prompt_tokens, self.prompt_offsets)

    @cached_property
    def response_ids(self) -> list[list[int]]:
        return _rows(self.response_tokens, self.response_offsets)

    @cached_property
    def old_logprobs(self) -> list[list[float]]:
        return _rows(self.response_logprobs, self.response_offsets)

    def to_payload(self) -> dict[str, Any]:
        """The dict torch.save writes (the streaming writer lays out the same dict)."""
        return {
            "schema": TRAIN_BATCH_SCHEMA,
            "version": TRAIN_BATCH_VERSION,
            "iteration": self.iteration,
            "group_size": self.group_size,
            "group_task_ids": list(self.group_task_ids),
            **{name: getattr(self, name) for name in _DTYPES},
        }


class TrainBatchWriter:
    """Streams one batch file: per-sample arrays up front, token arrays in sample order.

        with TrainBatchWriter(path, iteration=.., group_size=.., group_task_ids=..,
                              group_index=.., prompt_offsets=.., response_offsets=..,
                              rewards=..) as writer:
            writer.append(samples=k, prompt_tokens=.., response_tokens=..,
                          response_logprobs=..)      # the next k samples; repeat
            writer.publish()                         # fsync, rename, fsync dir

    Each piece is checked (dtype, length against the offsets, ids >= 0, finite
    log-probs) before it is written.  Leaving the block without publish()
    removes the temporary file, so a failed aggregation publishes nothing.
    """

    def __init__(
        self,
        path: Path,
        *,
        iteration: int,
        group_size: int,
        group_task_ids: Sequence[str],
        group_index: torch.Tensor,
        prompt_offsets: torch.Tensor,
        response_offsets: torch.Tensor,
        rewards: torch.Tensor,
    ) -> None:
        self.path = Path(path)
        small = {
            "group_index": group_index,
            "prompt_offsets": prompt_offsets,
            "response_offsets": response_offsets,
            "rewards": rewards,
        }
        _check_layout(
            self._bad,
            iteration=iteration,
            group_size=group_size,
            group_task_ids=group_task_ids,
            tensors=small,
        )
        # Own copies: the caller's tensors may be views of bigger storages,
        # which torch.save would write whole.
        tensors = {name: t.contiguous().clone() for name, t in small.items()}
        self._offsets = {name: tensors[name] for name in ("prompt_offsets", "response_offsets")}
        self._num_samples = group_index.numel()
        self._next_sample = 0
        # Placeholders: torch.empty only reserves address space, and skip_data
        # never reads them, so laying out a huge batch costs no memory.
        for name, (dtype, offsets) in FLAT.items():
            tensors[name] = torch.empty(int(self._offsets[offsets][-1]), dtype=dtype)
        payload = {
            "schema": TRAIN_BATCH_SCHEMA,
            "version": TRAIN_BATCH_VERSION,
            "iteration": iteration,
            "group_size": group_size,
            "group_task_ids": list(group_task_ids),
            **tensors,
        }
        ensure_dir(self.path.parent)
        self._tmp: Path | None = temp_name(self.path)
        STATS.count("open")
        # Beneath the run directory, never through a symlink (coordinator/beneath.py).
        self._fd = beneath.open_file(self._tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, FILE_MODE)
        try:
            with (
                os.fdopen(self._fd, "wb", closefd=False) as handle,
                torch.serialization.skip_data(),
            ):
                torch.save(payload, handle)
            self._where = self._locate(self._tmp, tensors)
            for name in PER_SAMPLE:
                self._write_at(tensors[name], self._where[name])
        except BaseException:
            self.abort()
            raise

    def _bad(self, problem: str) -> TrainBatchError:
        return TrainBatchError(f"train batch {self.path}: {problem}", path=self.path)

    def _locate(self, laid_out: Path, tensors: dict[str, torch.Tensor]) -> dict[str, int]:
        """File offset of each tensor's bytes, as torch.load itself finds them."""
        meta = torch.load(laid_out, weights_only=True, map_location="meta")
        size = os.fstat(self._fd).st_size
        where = {}
        for name, t in tensors.items():
            stored = meta[name]
            offset = getattr(stored.untyped_storage(), "_checkpoint_offset", None)
            nbytes = t.numel() * t.element_size()
            if (
                not isinstance(offset, int)
                or stored.storage_offset() != 0
                or stored.untyped_storage().nbytes() != nbytes
                or offset + nbytes > size
            ):
                raise TrainBatchError(
                    f"cannot locate {name} in the laid-out batch {laid_out} (offset {offset!r}, "
                    f"file size {size}): this torch {torch.__version__} lays out skip_data "
                    "files differently; pin the torch version the tests pass with",
                    path=self.path,
                )
            where[name] = offset
        return where

    def _write_at(self, t: torch.Tensor, offset: int) -> None:
        t = t.contiguous()
        nbytes = t.numel() * t.element_size()
        if nbytes == 0:
            return
        view = t.detach().numpy().data.cast("B")  # zero-copy
        done = 0
        while done < nbytes:
            STATS.count("write")
            done += os.pwrite(self._fd, view[done : done + _MAX_WRITE], offset + done)

    def append(
        self,
        *,
        samples: int,
        prompt_tokens: torch.Tensor,
        response_tokens: torch.Tensor,
        response_logprobs: torch.Tensor,
    ) -> None:
        """Write the token arrays of the next `samples` samples."""
        if self._tmp is None:
            raise self._bad("append after publish or abort")
        first = self._next_sample
        if type(samples) is not int or not 0 <= samples <= self._num_samples - first:
            raise self._bad(
                f"samples={samples!r} after {first} of {self._num_samples}: give the count of "
                "the next samples in the batch"
            )
        last = first + samples
        pieces = {
            "prompt_tokens": prompt_tokens,
            "response_tokens": response_tokens,
            "response_logprobs": response_logprobs,
        }
        spans = {}  # name -> (first token, end token) in the batch
        for name, (_, offsets) in FLAT.items():
            spans[name] = int(self._offsets[offsets][first]), int(self._offsets[offsets][last])
            _check_flat(
                lambda problem: self._bad(f"samples {first}..{last - 1}: {problem}"),
                name,
                pieces[name],
                spans[name][1] - spans[name][0],
            )
        for name, (dtype, _) in FLAT.items():
            self._write_at(pieces[name], self._where[name] + spans[name][0] * dtype.itemsize)
        self._next_sample = last

    def publish(self) -> None:
        """Make the complete file durable and visible under its name."""
        if self._tmp is None:
            raise self._bad("publish after publish or abort")
        if self._next_sample != self._num_samples:
            raise self._bad(
                f"only {self._next_sample} of {self._num_samples} samples were written: "
                "append every sample before publishing"
            )
        tmp, self._tmp = self._tmp, None  # from here on, publish cleans up by itself
        try:
            try:
                STATS.count("fsync")
                os.fsync(self._fd)
            finally:
                os.close(self._fd)  # exactly once: Linux frees the fd even when close fails
            rename(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                remove(tmp)
            raise
        fsync_dir(self.path.parent)

    def abort(self) -> None:
        """Drop the unfinished file; idempotent."""
        if self._tmp is None:
            return
        tmp, self._tmp = self._tmp, None
        with contextlib.suppress(OSError):  # a close error cannot matter for a dropped file
            os.close(self._fd)
        remove(tmp)

    def __enter__(self) -> TrainBatchWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.abort()


def save_train_batch(path: Path, batch: TrainBatch) -> None:
    """Publish the batch atomically (temp file, fsync, rename), without copying it."""
    with TrainBatchWriter(
        path,
        iteration=batch.iteration,
        group_size=batch.group_size,
        group_task_ids=batch.group_task_ids,
        **{name: getattr(batch, name) for name in PER_SAMPLE},
    ) as writer:
        writer.append(
            samples=batch.num_samples,
            **{name: getattr(batch, name) for name in FLAT},
        )
        writer.publish()


def load_train_batch(path: Path, *, size: int | None = None,
                     sha256: str | None = None) -> TrainBatch:
    """Load with weights_only=True and validate strictly; TrainBatchError naming path.

    With `size` and `sha256` (what the master recorded in the train job), the
    file is loaded only if it is exactly that file (coordinator/verified.py);
    an altered one raises TrainBatchError.  FileNotFoundError when there is
    no file, so callers can tell "not yet" from "bad".
    """
    path = Path(path)
    try:
        if size is not None and sha256 is not None:
            with read_verified(path, size=size, sha256=sha256) as file:
                obj = _load(path, file.source(), mmap=file.mapped)
        else:  # unchecked (tests, standalone use): read through a safe descriptor
            with os.fdopen(open_regular(path), "rb") as handle:
                obj = _load(path, handle, mmap=False)
    except CoordinatorMalformed as exc:  # altered, or not a regular file
        raise TrainBatchError(f"train batch {exc}", path=path) from exc
    return decode_train_batch(obj, path=path)


def _load(path: Path, source: Any, *, mmap: bool) -> Any:
    try:
        STATS.count("read")
        return torch.load(source, weights_only=True, mmap=mmap, map_location="cpu")
    except Exception as exc:  # UnpicklingError (forbidden global), RuntimeError (bad zip)
        raise TrainBatchError(
            f"train batch {path} was refused by torch.load(weights_only=True): "
            f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}",
            path=path,
        ) from exc


def decode_train_batch(obj: Any, *, path: Path) -> TrainBatch:
    """Validate a loaded payload into a TrainBatch; TrainBatchError naming path."""

    def bad(problem: str) -> TrainBatchError:
        return TrainBatchError(f"train batch {path} {problem}", path=path)

    if not isinstance(obj, dict):
        raise bad(f"is a {type(obj).__name__}, not a dict")
    schema, version = obj.get("schema"), obj.get("version")
    if schema == TRAIN_BATCH_SCHEMA and version == 1:
        raise bad(
            "has schema version 1 (lists of lists, too slow to load), which this reader no "
            f"longer accepts: re-run the aggregation of iteration {obj.get('iteration')!r} "
            f"to write version {TRAIN_BATCH_VERSION}"
        )
    if schema != TRAIN_BATCH_SCHEMA or version != TRAIN_BATCH_VERSION:
        raise bad(
            f"has schema {schema!r} version {version!r}: expected {TRAIN_BATCH_SCHEMA!r} "
            f"version {TRAIN_BATCH_VERSION}"
        )
    fields = ("iteration", "group_size", "group_task_ids", *_DTYPES)
    missing = [f for f in fields if f not in obj]
    if missing:
        raise bad(f"lacks fields {missing}")
    try:
        return TrainBatch(**{f: obj[f] for f in fields})
    except TrainBatchError as exc:
        raise TrainBatchError(f"{path}: {exc}", path=path) from exc
