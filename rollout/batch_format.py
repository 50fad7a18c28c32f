"""The training batch format: what the master hands the trainer for one iteration.

Schema version 3, a torch.save'd dict of flat tensors plus offsets (like the
rank chunk files), so that torch.load(weights_only=True) runs at disk speed:

    {
        "schema": "coordinator/train-batch", "version": 3,
        "iteration": int, "group_size": int,
        "group_task_ids": list[str],          # one per group, each task once
        "group_index": int64[S],              # 0,0,..,1,1,..: contiguous groups
        "prompt_tokens": int32[P],            # sample s: [prompt_offsets[s], prompt_offsets[s+1])
        "prompt_offsets": int64[S+1],
        "response_tokens": int32[R],          # sample s: [response_offsets[s], response_offsets[s+1])
        "response_offsets": int64[S+1],
        "response_logprobs": float32[R],      # the engine's log-prob of each response token
        "response_mask": bool[R],             # trained on: the model's tokens (false for the
                                              # environment's and the template's tokens between
                                              # the turns of a multi-turn episode)
        "rewards": float32[S],
    }

Failed samples are not in the batch.  A group keeps its place if at least
min(2, group_size) of its samples remain, because a group-relative advantage
needs two samples to compare; smaller remnants are dropped whole.  So a group
has between min(2, group_size) and group_size samples, and S may be 0.

Version 1 stored list[list[int]]; the weights_only unpickler reads those at
about a million Python ints per second (30 s for a 71 MiB batch), so version
1 files are refused rather than read.  Version 2 had no response_mask.

This module holds the format and its validation (TrainBatch, decode_train_batch,
and the checks the streaming writer applies piece by piece); writing and
loading files is rollout/train_batch.py.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Final

import torch

from coordinator.errors import MalformedRecordError

TRAIN_BATCH_SCHEMA: Final = "coordinator/train-batch"
TRAIN_BATCH_VERSION: Final = 3
PER_SAMPLE: Final = ("group_index", "prompt_offsets", "response_offsets", "rewards")
FLAT: Final = {  # name -> (dtype, the offsets that delimit it)
    "prompt_tokens": (torch.int32, "prompt_offsets"),
    "response_tokens": (torch.int32, "response_offsets"),
    "response_logprobs": (torch.float32, "response_offsets"),
    "response_mask": (torch.bool, "response_offsets"),
}
DTYPES: Final = {
    "group_index": torch.int64,
    "prompt_offsets": torch.int64,
    "response_offsets": torch.int64,
    "rewards": torch.float32,
    **{name: dtype for name, (dtype, _) in FLAT.items()},
}


class TrainBatchError(MalformedRecordError):
    """A training batch violates its schema, in a file (`path`) or in memory (`path` None).

    A batch built in memory has no file to name, so its message is the
    problem alone, which then says which batch it is.
    """

    def __init__(self, path: Path | None, problem: str) -> None:
        super().__init__(path, problem)  # type: ignore[arg-type]
        if path is None:
            self.args = (problem,)  # not "None: ...", which reads like a file named None


Problem = Callable[[str], TrainBatchError]


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


def check_layout(
    bad: Problem,
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
        t, dtype = tensors.get(name), DTYPES[name]
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


def check_flat(bad: Problem, name: str, t: Any, numel: int) -> None:
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


def _check_rows(
    bad: Problem,
    s: int,
    *,
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    old_logprobs: Sequence[Sequence[float]],
) -> None:
    """Per-sample lists for TrainBatch.from_lists: one row per sample, ints, a logprob per token."""
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


def _flat(rows: Sequence[Sequence[Any]], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor([v for row in rows for v in row], dtype=dtype)


def _offsets(rows: Sequence[Sequence[Any]]) -> torch.Tensor:
    return torch.tensor([0, *(len(r) for r in rows)], dtype=torch.int64).cumsum(0)


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
    response_mask: torch.Tensor | None = None  # None: every response token is the model's

    def __post_init__(self) -> None:
        if self.response_mask is None and isinstance(self.response_tokens, torch.Tensor):
            object.__setattr__(self, "response_mask",
                               torch.ones(self.response_tokens.numel(), dtype=torch.bool))

        def bad(problem: str) -> TrainBatchError:
            return TrainBatchError(None, f"train batch of iteration {self.iteration!r}: {problem}")

        tensors = {name: getattr(self, name) for name in DTYPES}
        check_layout(
            bad,
            iteration=self.iteration,
            group_size=self.group_size,
            group_task_ids=self.group_task_ids,
            tensors=tensors,
        )
        object.__setattr__(self, "group_task_ids", tuple(self.group_task_ids))
        for name, (_, offsets) in FLAT.items():
            check_flat(bad, name, tensors[name], int(tensors[offsets][-1]))

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
        response_masks: Sequence[Sequence[int]] | None = None,
    ) -> TrainBatch:
        """Build from per-sample lists (tests, small producers); per-element Python work."""

        def bad(problem: str) -> TrainBatchError:
            return TrainBatchError(None, f"train batch of iteration {iteration!r}: {problem}")

        s = len(task_ids)
        _check_rows(bad, s, prompt_ids=prompt_ids, response_ids=response_ids,
                    old_logprobs=old_logprobs)
        if response_masks is not None and [len(m) for m in response_masks] != [
                len(r) for r in response_ids]:
            raise bad("response_masks must hold one 0 or 1 per response token of each sample")
        if not isinstance(group_index, torch.Tensor) or group_index.shape != (s,):
            raise bad(f"group_index must be a tensor of shape ({s},), one entry per sample")
        first: dict[int, str] = {}  # group -> its first sample's task; checked after the layout
        for i, g in enumerate(group_index.tolist()):
            first.setdefault(g, task_ids[i])
        try:
            batch = cls(
                iteration=iteration,
                group_size=group_size,
                group_task_ids=tuple(first[g] for g in sorted(first)),
                group_index=group_index,
                prompt_tokens=_flat(prompt_ids, torch.int32),
                prompt_offsets=_offsets(prompt_ids),
                response_tokens=_flat(response_ids, torch.int32),
                response_offsets=_offsets(response_ids),
                response_logprobs=_flat(old_logprobs, torch.float32),
                rewards=rewards,
                response_mask=None if response_masks is None
                else _flat(response_masks, torch.bool),
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
    def model_token_counts(self) -> list[int]:
        """Per sample, the response tokens the model generated (response_mask true): what
        the loss is averaged over.  A multi-turn episode's environment and template
        tokens are context: counted in response_lengths, not here."""
        assert self.response_mask is not None  # filled in __post_init__
        # Prefix sums read at the offsets: O(tokens) in C, no per-sample Python slicing.
        ends = torch.cat([torch.zeros(1, dtype=torch.int64), self.response_mask.cumsum(0)])
        return (ends[self.response_offsets[1:]] - ends[self.response_offsets[:-1]]).tolist()

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

    @cached_property
    def response_masks(self) -> list[list[bool]]:
        assert self.response_mask is not None  # filled in __post_init__
        return _rows(self.response_mask, self.response_offsets)

    def to_payload(self) -> dict[str, Any]:
        """The dict torch.save writes (the streaming writer lays out the same dict)."""
        return {
            "schema": TRAIN_BATCH_SCHEMA,
            "version": TRAIN_BATCH_VERSION,
            "iteration": self.iteration,
            "group_size": self.group_size,
            "group_task_ids": list(self.group_task_ids),
            **{name: getattr(self, name) for name in DTYPES},
        }



def decode_train_batch(obj: Any, *, path: Path) -> TrainBatch:
    """Validate a loaded payload into a TrainBatch; TrainBatchError naming path."""

    def bad(problem: str) -> TrainBatchError:
        return TrainBatchError(path, problem)

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
    fields = ("iteration", "group_size", "group_task_ids", *DTYPES)
    missing = [f for f in fields if f not in obj]
    if missing:
        raise bad(f"lacks fields {missing}")
    try:
        return TrainBatch(**{f: obj[f] for f in fields})
    except TrainBatchError as exc:
        raise bad(exc.problem) from exc
