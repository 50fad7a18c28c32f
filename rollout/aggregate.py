"""Master-side aggregation of one iteration's rollouts into a training batch.

    for each rank (one at a time):
        manifest.json --rank/iteration fence, id check against the plan-->
            assigned ids each present exactly once, none foreign, finalized
        each chunk --SHA-256 of the bytes read--> torch.load(weights_only=True)
            --> every group exactly group_size samples, indices 0..n-1
        --> metrics accumulated, kept samples appended, chunk released
    --> train batch published atomically; metrics returned

Nothing is trusted before it is checked: a rank whose output is incomplete,
duplicated, foreign, altered or not loadable as plain tensors stops the
aggregation with an AggregationError naming the rank and the ids.  Chunks are
read one at a time, so besides the growing batch, memory holds one file.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from rollout.errors import AggregationError, MalformedRecordError
from rollout.manifest import RankManifest, read_manifest
from rollout.train_batch import (
    TrainBatch,
    TrainBatchError,
    load_train_batch,
    min_group_samples,
    save_train_batch,
)
from rollout.trajectory import Chunk, read_verified_chunk

__all__ = [
    "AggregateMetrics",
    "AggregationError",
    "TrainBatch",
    "TrainBatchError",
    "aggregate_iteration",
    "load_train_batch",
    "merge_eval_metrics",
    "save_train_batch",
]

_SHOWN_IDS = 10  # ids quoted in an error; the count says how many more


def _ids(ids: Sequence[str]) -> str:
    shown = sorted(ids)[:_SHOWN_IDS]
    return f"{len(ids)} (first {len(shown)}: {', '.join(shown)})"


@dataclass(frozen=True, kw_only=True)
class AggregateMetrics:
    """One iteration's rollout statistics.

    Reward, accuracy and length statistics cover the samples that did not
    fail; `accuracy` is the fraction of those whose reward equals the maximum
    reward, 1.0.  They are None when every sample failed.  Training-batch
    counts are 0 for eval.
    """

    iteration: int
    num_tasks: int
    num_samples: int
    num_failed: int
    reward_mean: float | None
    reward_std: float | None
    accuracy: float | None
    response_length_mean: float | None
    response_length_max: int | None
    samples_per_second: dict[int, float] = field(default_factory=dict)
    num_train_samples: int = 0
    num_dropped_groups: int = 0

    def to_json(self) -> str:
        data = asdict(self)
        data["samples_per_second"] = {str(r): v for r, v in self.samples_per_second.items()}
        return json.dumps(data, allow_nan=False, sort_keys=True)


class _Accumulator:
    """Running sums over chunks; float64 so thousands of chunks do not drift."""

    def __init__(self, group_size: int, collect: bool) -> None:
        self.group_size = group_size
        self.collect = collect
        self.tasks = self.samples = self.failed = self.correct = self.dropped = 0
        self.reward_sum = self.reward_sq = 0.0
        self.length_sum = 0
        self.length_max: int | None = None
        self.task_ids: list[str] = []
        self.group_index: list[int] = []
        self.prompt_ids: list[list[int]] = []
        self.response_ids: list[list[int]] = []
        self.old_logprobs: list[list[float]] = []
        self.rewards: list[float] = []

    def add(self, chunk: Chunk) -> None:
        t = chunk.tensors
        ok = ~t["failed"]
        rewards = t["rewards"].double()[ok]
        lengths = t["response_offsets"].diff()[ok]
        self.tasks += len(chunk.task_ids)
        self.samples += chunk.num_samples
        self.failed += int((~ok).sum())
        self.correct += int((rewards == 1.0).sum())
        self.reward_sum += float(rewards.sum())
        self.reward_sq += float((rewards * rewards).sum())
        if lengths.numel():
            self.length_sum += int(lengths.sum())
            self.length_max = max(self.length_max or 0, int(lengths.max()))
        if self.collect:
            self._collect(chunk, ok)

    def _collect(self, chunk: Chunk, ok: torch.Tensor) -> None:
        t = chunk.tensors
        survivors = torch.bincount(t["sample_group"][ok], minlength=len(chunk.task_ids))
        kept_groups = survivors >= min_group_samples(self.group_size)
        self.dropped += int((~kept_groups).sum())
        keep = ok & kept_groups[t["sample_group"]]
        # One tolist() per tensor, then list slicing: per-element tensor
        # indexing would cost a Python call per token.
        prompt, response = t["prompt_tokens"].tolist(), t["response_tokens"].tolist()
        logprobs = t["response_logprobs"].tolist()
        po, ro = t["prompt_offsets"].tolist(), t["response_offsets"].tolist()
        groups, rewards = t["sample_group"].tolist(), t["rewards"].tolist()
        base = self.group_index[-1] + 1 if self.group_index else 0
        renumber: dict[int, int] = {}  # chunk group -> batch group, in order of first use
        for s in torch.nonzero(keep).flatten().tolist():
            batch_group = renumber.setdefault(groups[s], base + len(renumber))
            self.task_ids.append(chunk.task_ids[groups[s]])
            self.group_index.append(batch_group)
            self.prompt_ids.append(prompt[po[s] : po[s + 1]])
            self.response_ids.append(response[ro[s] : ro[s + 1]])
            self.old_logprobs.append(logprobs[ro[s] : ro[s + 1]])
            self.rewards.append(rewards[s])

    def metrics(self, iteration: int, samples_per_second: dict[int, float]) -> AggregateMetrics:
        good = self.samples - self.failed
        mean = self.reward_sum / good if good else None
        std = math.sqrt(max(0.0, self.reward_sq / good - mean * mean)) if mean is not None else None
        return AggregateMetrics(
            iteration=iteration,
            num_tasks=self.tasks,
            num_samples=self.samples,
            num_failed=self.failed,
            reward_mean=mean,
            reward_std=std,
            accuracy=self.correct / good if good else None,
            response_length_mean=self.length_sum / good if good else None,
            response_length_max=self.length_max,
            samples_per_second=samples_per_second,
            num_train_samples=len(self.task_ids),
            num_dropped_groups=self.dropped,
        )


def _check_manifest(
    rank: int, directory: Path, assigned: Sequence[str], iteration: int
) -> RankManifest:
    try:
        manifest = read_manifest(directory)
    except MalformedRecordError as exc:
        raise AggregationError(f"rank {rank}: {exc}", rank=rank, path=exc.path) from exc
    if manifest is None:
        raise AggregationError(
            f"rank {rank} left no manifest in {directory}: all its assigned task ids are "
            f"missing: {_ids(assigned)}",
            rank=rank,
            path=directory,
            missing=tuple(assigned),
        )
    if manifest.rank != rank or manifest.iteration != iteration:
        raise AggregationError(
            f"manifest in {directory} is from rank {manifest.rank} iteration "
            f"{manifest.iteration}, expected rank {rank} iteration {iteration}: the directory "
            "is stale or belongs to another rank",
            rank=rank,
            path=directory,
        )
    counts = Counter(manifest.task_ids())
    wanted = set(assigned)
    missing = [t for t in wanted if t not in counts]
    duplicated = [t for t, n in counts.items() if n > 1]
    foreign = [t for t in counts if t not in wanted]
    if missing or duplicated or foreign:
        problems = [
            f"{what} task ids: {_ids(ids)}"
            for what, ids in (
                ("missing", missing),
                ("duplicated", duplicated),
                ("foreign", foreign),
            )
            if ids
        ]
        raise AggregationError(
            f"rank {rank} output in {directory} does not match its assignment: "
            + "; ".join(problems),
            rank=rank,
            path=directory,
            missing=tuple(sorted(missing)),
            duplicated=tuple(sorted(duplicated)),
            foreign=tuple(sorted(foreign)),
        )
    if not manifest.complete:
        raise AggregationError(
            f"rank {rank} manifest in {directory} is not marked complete: the rank has not "
            "finalized its rollout; wait for it or redo the rank",
            rank=rank,
            path=directory,
        )
    return manifest


def _check_chunk(
    chunk: Chunk, *, rank: int, iteration: int, task_ids: tuple[str, ...], group_size: int
) -> None:
    def fail(problem: str) -> AggregationError:
        return AggregationError(f"rank {rank}: {problem}", rank=rank)

    if chunk.rank != rank or chunk.iteration != iteration:
        raise fail(f"a chunk says rank {chunk.rank} iteration {chunk.iteration}")
    if chunk.task_ids != task_ids:
        raise fail("a chunk's task ids differ from those its manifest lists")
    t = chunk.tensors
    sizes = torch.bincount(t["sample_group"], minlength=len(task_ids))
    wrong = [task_ids[g] for g in torch.nonzero(sizes != group_size).flatten().tolist()]
    if wrong:
        raise AggregationError(
            f"rank {rank}: task ids without exactly {group_size} samples: {_ids(wrong)}",
            rank=rank,
            missing=tuple(wrong),
        )
    index = t["sample_index"]
    if bool(((index < 0) | (index >= group_size)).any()) or (
        torch.unique(t["sample_group"] * group_size + index).numel() != chunk.num_samples
    ):
        raise fail(f"sample indices within a group must be 0..{group_size - 1}, each once")


def _merge(
    rank_dirs: Mapping[int, Path],
    assignments: Mapping[int, Sequence[str]],
    *,
    iteration: int,
    group_size: int,
    collect: bool,
) -> tuple[_Accumulator, dict[int, float]]:
    if type(group_size) is not int or group_size < 1:
        raise ValueError(f"group_size={group_size!r} is below 1: give the samples per task")
    if set(rank_dirs) != set(assignments):
        raise AggregationError(
            f"rank directories for ranks {sorted(rank_dirs)} but assignments for ranks "
            f"{sorted(assignments)}: give both for the same ranks"
        )
    everywhere = Counter(t for ids in assignments.values() for t in ids)
    twice = [t for t, n in everywhere.items() if n > 1]
    if twice:
        raise AggregationError(f"the plan assigns task ids to several ranks: {_ids(twice)}")
    acc = _Accumulator(group_size, collect)
    speeds: dict[int, float] = {}
    for rank in sorted(rank_dirs):
        directory = Path(rank_dirs[rank])
        manifest = _check_manifest(rank, directory, assignments[rank], iteration)
        for entry in manifest.chunks:
            try:
                chunk = read_verified_chunk(directory / entry.file, entry.sha256)
            except MalformedRecordError as exc:
                raise AggregationError(f"rank {rank}: {exc}", rank=rank, path=exc.path) from exc
            _check_chunk(
                chunk,
                rank=rank,
                iteration=iteration,
                task_ids=entry.task_ids,
                group_size=group_size,
            )
            acc.add(chunk)
            del chunk  # release before reading the next file
        if manifest.rollout_seconds > 0:
            speeds[rank] = manifest.num_samples / manifest.rollout_seconds
    return acc, speeds


def aggregate_iteration(
    rank_dirs: Mapping[int, Path],
    assignments: Mapping[int, Sequence[str]],
    *,
    iteration: int,
    group_size: int,
    out_path: Path,
) -> AggregateMetrics:
    """Check every rank's output against the plan, publish the training batch, give metrics."""
    acc, speeds = _merge(
        rank_dirs, assignments, iteration=iteration, group_size=group_size, collect=True
    )
    batch = TrainBatch(
        iteration=iteration,
        group_size=group_size,
        task_ids=acc.task_ids,
        group_index=torch.tensor(acc.group_index, dtype=torch.int64),
        prompt_ids=acc.prompt_ids,
        response_ids=acc.response_ids,
        old_logprobs=acc.old_logprobs,
        rewards=torch.tensor(acc.rewards, dtype=torch.float32),
    )
    save_train_batch(Path(out_path), batch)
    return acc.metrics(iteration, speeds)


def merge_eval_metrics(
    rank_dirs: Mapping[int, Path],
    assignments: Mapping[int, Sequence[str]],
    *,
    iteration: int,
    group_size: int,
) -> AggregateMetrics:
    """The same checks as aggregate_iteration, for eval: metrics only, no batch."""
    acc, speeds = _merge(
        rank_dirs, assignments, iteration=iteration, group_size=group_size, collect=False
    )
    return acc.metrics(iteration, speeds)
