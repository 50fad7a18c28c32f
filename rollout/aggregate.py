"""Master-side aggregation of one iteration's rollouts into a training batch.

    pass 1, for each rank (one at a time):
        manifest.json --rank/iteration fence, id check against the plan-->
            assigned ids each present exactly once, none foreign, finalized
        each chunk --SHA-256 of the bytes read--> torch.load(weights_only=True, mmap)
            --> every group exactly group_size samples, indices 0..n-1
        --> metrics accumulated; which samples to keep decided from the
            per-sample tensors; the chunk's token tensors kept, still mapped
    lay out the batch file (per-sample arrays now, token arrays reserved)
    pass 2, for each kept chunk: its kept token ranges written in place, the
        chunk unmapped
    --> train batch published atomically; metrics returned

Nothing is trusted before it is checked: a rank whose output is incomplete,
duplicated, foreign, altered or not loadable as plain tensors stops the
aggregation with an AggregationError naming the rank and the ids, before any
batch is published.  Pass 1 touches only the small per-sample tensors of the
mapped chunks, so token data is read into memory once, in pass 2, one chunk at
a time: the master's memory stays near one chunk file however big the batch.
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from coordinator.errors import MalformedRecordError as CoordinatorMalformed
from rollout.errors import AggregationError, MalformedRecordError
from rollout.manifest import RankManifest, read_manifest
from rollout.train_batch import (
    TrainBatch,
    TrainBatchError,
    TrainBatchWriter,
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

logger = logging.getLogger(__name__)

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


@dataclass(frozen=True, eq=False)
class _KeptTokens:
    """A verified chunk's token tensors (still file-mapped) and the sample runs to keep."""

    prompt_tokens: torch.Tensor
    prompt_offsets: torch.Tensor
    response_tokens: torch.Tensor
    response_offsets: torch.Tensor
    response_logprobs: torch.Tensor
    runs: tuple[tuple[int, int], ...]  # [first, end) sample ranges, in order
    rank: int
    path: Path


def _runs(keep: torch.Tensor) -> tuple[tuple[int, int], ...]:
    """The [first, end) ranges where keep is True: one per stretch between dropped samples."""
    padded = torch.zeros(keep.numel() + 2, dtype=torch.int8)
    padded[1:-1] = keep.to(torch.int8)
    edges = padded.diff()
    starts = torch.nonzero(edges == 1).flatten().tolist()
    ends = torch.nonzero(edges == -1).flatten().tolist()
    return tuple(zip(starts, ends, strict=True))


class _Accumulator:
    """Running sums over chunks; float64 so thousands of chunks do not drift.

    With `collect`, also the batch's per-sample arrays (small) and, per chunk
    with survivors, its mapped token tensors for pass 2.
    """

    def __init__(self, group_size: int, collect: bool) -> None:
        self.group_size = group_size
        self.collect = collect
        self.tasks = self.samples = self.failed = self.correct = self.dropped = 0
        self.reward_sum = self.reward_sq = 0.0
        self.length_sum = 0
        self.length_max: int | None = None
        self.kept_samples = 0
        self.group_task_ids: list[str] = []
        self.group_index: list[torch.Tensor] = []
        self.prompt_lengths: list[torch.Tensor] = []
        self.response_lengths: list[torch.Tensor] = []
        self.rewards: list[torch.Tensor] = []
        self.tokens: deque[_KeptTokens] = deque()

    def add(self, chunk: Chunk, *, rank: int, path: Path) -> None:
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
            self._collect(chunk, ok, rank=rank, path=path)

    def _collect(self, chunk: Chunk, ok: torch.Tensor, *, rank: int, path: Path) -> None:
        t = chunk.tensors
        group = t["sample_group"]
        survivors = torch.bincount(group[ok], minlength=len(chunk.task_ids))
        kept_groups = survivors >= min_group_samples(self.group_size)
        self.dropped += int((~kept_groups).sum())
        keep = ok & kept_groups[group]
        if not bool(keep.any()):
            return
        # Chunk groups are sorted, so numbering the kept ones in order keeps
        # the batch's groups contiguous and in chunk order.
        batch_group = kept_groups.cumsum(0) - 1 + len(self.group_task_ids)
        self.group_index.append(batch_group[group[keep]])
        self.group_task_ids.extend(
            chunk.task_ids[g] for g in torch.nonzero(kept_groups).flatten().tolist()
        )
        self.prompt_lengths.append(t["prompt_offsets"].diff()[keep])
        self.response_lengths.append(t["response_offsets"].diff()[keep])
        self.rewards.append(t["rewards"][keep])
        self.kept_samples += int(keep.sum())
        self.tokens.append(
            _KeptTokens(
                prompt_tokens=t["prompt_tokens"],
                prompt_offsets=t["prompt_offsets"],
                response_tokens=t["response_tokens"],
                response_offsets=t["response_offsets"],
                response_logprobs=t["response_logprobs"],
                runs=_runs(keep),
                rank=rank,
                path=path,
            )
        )

    def layout(self) -> dict[str, torch.Tensor]:
        """The batch's per-sample arrays, for TrainBatchWriter."""

        def cat(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
            return torch.cat(parts).to(dtype) if parts else torch.zeros(0, dtype=dtype)

        def offsets(lengths: list[torch.Tensor]) -> torch.Tensor:
            out = torch.zeros(self.kept_samples + 1, dtype=torch.int64)
            out[1:] = cat(lengths, torch.int64).cumsum(0)
            return out

        return {
            "group_index": cat(self.group_index, torch.int64),
            "prompt_offsets": offsets(self.prompt_lengths),
            "response_offsets": offsets(self.response_lengths),
            "rewards": cat(self.rewards, torch.float32),
        }

    def write_tokens(self, writer: TrainBatchWriter) -> None:
        """Pass 2: each kept chunk's kept token ranges, then the chunk is released."""
        while self.tokens:
            part = self.tokens.popleft()  # the last reference: unmapped after this loop body
            po, ro = part.prompt_offsets, part.response_offsets
            for first, end in part.runs:
                p0, p1, r0, r1 = int(po[first]), int(po[end]), int(ro[first]), int(ro[end])
                try:
                    writer.append(
                        samples=end - first,
                        prompt_tokens=part.prompt_tokens[p0:p1],
                        response_tokens=part.response_tokens[r0:r1],
                        response_logprobs=part.response_logprobs[r0:r1],
                    )
                except TrainBatchError as exc:  # token values are first read here
                    raise AggregationError(
                        f"rank {part.rank}: chunk {part.path}, samples {first}..{end - 1}: {exc}",
                        rank=part.rank,
                        path=part.path,
                    ) from exc
            del part

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
            num_train_samples=self.kept_samples,
            num_dropped_groups=self.dropped,
        )


def _check_manifest(
    rank: int, directory: Path, assigned: Sequence[str], iteration: int
) -> RankManifest:
    try:
        manifest = read_manifest(directory)
    except (MalformedRecordError, CoordinatorMalformed) as exc:
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
                chunk = read_verified_chunk(directory / entry.file, entry)
            except (MalformedRecordError, CoordinatorMalformed) as exc:
                raise AggregationError(f"rank {rank}: {exc}", rank=rank, path=exc.path) from exc
            _check_chunk(
                chunk,
                rank=rank,
                iteration=iteration,
                task_ids=entry.task_ids,
                group_size=group_size,
            )
            acc.add(chunk, rank=rank, path=directory / entry.file)
            # Released now unless its token tensors wait, mapped, for pass 2.
            del chunk
        if manifest.rollout_seconds > 0:
            speeds[rank] = manifest.num_samples / manifest.rollout_seconds
        logger.info(
            "iteration %d: rank %d output verified (%d tasks, %d chunks)",
            iteration,
            rank,
            len(assignments[rank]),
            len(manifest.chunks),
        )
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
    with TrainBatchWriter(
        Path(out_path),
        iteration=iteration,
        group_size=group_size,
        group_task_ids=acc.group_task_ids,
        **acc.layout(),
    ) as writer:
        acc.write_tokens(writer)
        writer.publish()
    logger.info(
        "iteration %d: train batch %s published (%d samples in %d groups)",
        iteration,
        out_path,
        acc.kept_samples,
        len(acc.group_task_ids),
    )
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
