"""What the aggregation accumulates over verified chunks: metrics and the kept samples.

    Accumulator.add(chunk)   per chunk of every rank, in order (pass 1):
        running sums for AggregateMetrics (float64, so thousands of chunks
        do not drift); with `collect`, which samples the training batch keeps
        and the chunk's token tensors, still file-mapped
    Accumulator.layout()     the batch's per-sample arrays, for TrainBatchWriter
    Accumulator.write_tokens(writer)   pass 2: each kept chunk's token ranges
    Accumulator.metrics()    the iteration's AggregateMetrics

The checks that make a chunk safe to add, and the merge that drives this,
are in rollout/aggregate.py.
"""

from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from rollout.batch_format import TrainBatchError, min_group_samples
from rollout.chunk_format import Chunk
from rollout.errors import AggregationError
from rollout.train_batch import TrainBatchWriter

# AggregateMetrics' fields that describe the training batch: an eval makes none.
BATCH_KEYS = ("num_train_samples", "num_dropped_groups", "policy_versions", "staleness_max",
              "staleness_mean", "stale_groups_dropped")


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
    # Samples per policy version; staleness = iteration - version (train split).
    policy_versions: dict[int, int] = field(default_factory=dict)
    staleness_max: int = 0
    staleness_mean: float = 0.0
    stale_groups_dropped: int = 0  # groups of too old a policy, generated again
    # Calls of a reward with a time limit (the math reward) over the ranks' tries,
    # and those that ran out of it and scored 0 (rollout/reward_tally.py).
    reward_calls: int = 0
    reward_timeouts: int = 0
    # The numbers the reward reported beside its score (a reward file's dict), each
    # averaged over the samples that did not fail and reported it.
    reward_extra: dict[str, float] = field(default_factory=dict)

    def to_json(self, *, batch: bool = True) -> str:
        """The metrics file's text; `batch` False (eval, which makes no batch) leaves
        out the keys that describe a training batch rather than report 0 for them."""
        data = asdict(self)
        data["samples_per_second"] = {str(r): v for r, v in self.samples_per_second.items()}
        data["policy_versions"] = {str(v): n for v, n in self.policy_versions.items()}
        if not batch:
            for key in BATCH_KEYS:
                del data[key]
        return json.dumps(data, allow_nan=False, sort_keys=True)


@dataclass(frozen=True, eq=False)
class _KeptTokens:
    """A verified chunk's token tensors (still file-mapped) and the sample runs to keep."""

    prompt_tokens: torch.Tensor
    prompt_offsets: torch.Tensor
    response_tokens: torch.Tensor
    response_offsets: torch.Tensor
    response_logprobs: torch.Tensor
    response_mask: torch.Tensor  # bool: the model's tokens
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


class Accumulator:
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
        self.kept_versions: dict[int, int] = {}  # policy version -> the batch's samples of it
        self.group_task_ids: list[str] = []
        self.group_index: list[torch.Tensor] = []
        self.prompt_lengths: list[torch.Tensor] = []
        self.response_lengths: list[torch.Tensor] = []
        self.rewards: list[torch.Tensor] = []
        self.tokens: deque[_KeptTokens] = deque()
        self.first_error = ""  # the first failed sample's error (it names its task)
        self.extra_sums: dict[str, tuple[float, int]] = {}  # name -> (sum, samples)

    def add(self, chunk: Chunk, *, rank: int, path: Path, version: int = 0) -> None:
        """One chunk, of policy `version` (its manifest entry's)."""
        t = chunk.tensors
        ok = ~t["failed"]
        rewards = t["rewards"].double()[ok]
        lengths = t["response_offsets"].diff()[ok]
        self.tasks += len(chunk.task_ids)
        self.samples += chunk.num_samples
        failed = int((~ok).sum())
        if failed and not self.first_error:
            first = int(torch.nonzero(~ok).flatten()[0])
            self.first_error = (chunk.errors[first].splitlines() or ["?"])[0]
        self.failed += failed
        self.correct += int((rewards == 1.0).sum())
        self.reward_sum += float(rewards.sum())
        self.reward_sq += float((rewards * rewards).sum())
        if lengths.numel():
            self.length_sum += int(lengths.sum())
            self.length_max = max(self.length_max or 0, int(lengths.max()))
        for name, values in chunk.reward_extra.items():
            good = values.double()[ok]
            good = good[torch.isfinite(good)]  # NaN: this sample's reward did not report it
            total, count = self.extra_sums.get(name, (0.0, 0))
            self.extra_sums[name] = (total + float(good.sum()), count + int(good.numel()))
        if self.collect:
            self._collect(chunk, ok, rank=rank, path=path, version=version)

    def _collect(self, chunk: Chunk, ok: torch.Tensor, *, rank: int, path: Path,
                 version: int) -> None:
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
        kept = int(keep.sum())
        self.kept_samples += kept
        self.kept_versions[version] = self.kept_versions.get(version, 0) + kept
        self.tokens.append(
            _KeptTokens(
                prompt_tokens=t["prompt_tokens"],
                prompt_offsets=t["prompt_offsets"],
                response_tokens=t["response_tokens"],
                response_offsets=t["response_offsets"],
                response_logprobs=t["response_logprobs"],
                response_mask=t["response_mask"],
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
                        response_mask=part.response_mask[r0:r1],
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
            reward_extra={name: total / count for name, (total, count)
                          in sorted(self.extra_sums.items()) if count},
        )

