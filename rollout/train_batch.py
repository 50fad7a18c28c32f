"""Writing and loading training batch files (the format is rollout/batch_format.py).

Writing streams: TrainBatchWriter lays the file out first (torch.save under
skip_data reserves each tensor's bytes without writing them), then writes the
token arrays piece by piece at their offsets, so the master never holds the
whole batch in memory.  The file appears under its name only when complete.

Loading maps the file where it can and validates it strictly; a file that
torch.load(weights_only=True) refuses, or that breaks the schema, is a
TrainBatchError naming it.  The format's names are re-exported here, where
the trainer and the tests have always imported them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Final

import torch

from coordinator.errors import MalformedRecordError
from coordinator.storage import beneath
from coordinator.storage.fsio import (
    FILE_MODE,
    STATS,
    ensure_dir,
    fsync_dir,
    open_regular,
    remove,
    rename,
    temp_name,
)
from coordinator.storage.verified import read_verified
from rollout.batch_format import (
    FLAT,
    PER_SAMPLE,
    TRAIN_BATCH_SCHEMA,
    TRAIN_BATCH_VERSION,
    TrainBatch,
    TrainBatchError,
    check_flat,
    check_layout,
    decode_train_batch,
)
from rollout.tensor_files import load_tensors

_MAX_WRITE: Final = 1 << 30  # Linux writes at most ~2 GiB per call; stay well below


class TrainBatchWriter:
    """Streams one batch file: per-sample arrays up front, token arrays in sample order.

        with TrainBatchWriter(path, iteration=.., group_size=.., group_task_ids=..,
                              group_index=.., prompt_offsets=.., response_offsets=..,
                              rewards=..) as writer:
            writer.append(samples=k, prompt_tokens=.., response_tokens=..,
                          response_logprobs=.., response_mask=..)  # the next k; repeat
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
        check_layout(
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
        # Beneath the run directory, never through a symlink (coordinator/storage/beneath.py).
        self._fd = beneath.open_file(self._tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, FILE_MODE)
        try:
            self._lay_out(self._tmp, payload, tensors)
        except BaseException:
            self.abort()
            raise

    def _lay_out(
        self, tmp: Path, payload: dict[str, Any], tensors: dict[str, torch.Tensor]
    ) -> None:
        """The whole file with token arrays reserved, and the per-sample arrays written."""
        with (
            os.fdopen(self._fd, "wb", closefd=False) as handle,
            torch.serialization.skip_data(),
        ):
            torch.save(payload, handle)
        self._where = self._locate(tmp, tensors)
        for name in PER_SAMPLE:
            self._write_at(tensors[name], self._where[name])

    def _bad(self, problem: str) -> TrainBatchError:
        return TrainBatchError(self.path, problem)

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
                    self.path,
                    f"cannot locate {name} in the laid-out batch {laid_out} (offset {offset!r}, "
                    f"file size {size}): this torch {torch.__version__} lays out skip_data "
                    "files differently; pin the torch version the tests pass with",
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
        response_mask: torch.Tensor | None = None,
    ) -> None:
        """Write the token arrays of the next `samples` samples (`response_mask` None:
        every response token is the model's)."""
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
            "response_mask": torch.ones(response_tokens.numel(), dtype=torch.bool)
            if response_mask is None else response_mask,
        }
        spans = {}  # name -> (first token, end token) in the batch
        for name, (_, offsets) in FLAT.items():
            spans[name] = int(self._offsets[offsets][first]), int(self._offsets[offsets][last])
            check_flat(
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
    file is loaded only if it is exactly that file (coordinator/storage/verified.py);
    an altered one raises TrainBatchError.  FileNotFoundError when there is
    no file, so callers can tell "not yet" from "bad".
    """
    path = Path(path)
    try:
        if size is not None and sha256 is not None:
            with read_verified(path, size=size, sha256=sha256) as file:
                obj = load_tensors(path, file.source(), mmap=file.mapped)
        else:  # unchecked (tests, standalone use): read through a safe descriptor
            with os.fdopen(open_regular(path), "rb") as handle:
                obj = load_tensors(path, handle, mmap=False)
    except MalformedRecordError as exc:  # altered, not a regular file, refused by torch.load
        raise TrainBatchError(path, exc.problem) from exc
    return decode_train_batch(obj, path=path)
