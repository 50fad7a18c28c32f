"""Master-side aggregation of one iteration's rollouts into a training batch.

    pass 1, for each rank (one at a time):
        manifest.json --the digest the rank reported at phase 3 (pinned),
                       rank/iteration fence, id check against the plan-->
            assigned ids each present exactly once, none foreign, finalized
        each chunk --SHA-256 of the bytes read--> torch.load(weights_only=True, mmap)
            --> every group exactly group_size samples, indices 0..n-1
        --> metrics accumulated; which samples to keep decided from the
            per-sample tensors; the chunk's token tensors kept, still mapped
        as soon as the failed samples summed so far exceed what the budget
        allows for all the ranks' samples: BudgetError, the rest not read
    the merged result held to the budget (rollout/budget.py): failed samples,
        the batch's size
    lay out the batch file (per-sample arrays now, token arrays reserved)
    pass 2, for each kept chunk: its kept token ranges written in place, the
        chunk unmapped
    --> train batch published atomically; metrics returned

Nothing is trusted before it is checked: a rank whose output is incomplete,
duplicated, foreign, altered or not loadable as plain tensors stops the
aggregation with an AggregationError naming the rank and the ids, before any
batch is published.  With the digests the ranks reported at phase 3
(`manifest_sha256`), a manifest is parsed from the very bytes whose SHA-256
matched: one that changed since (a writer that outlived its phase) is
refused naming both digests, never merged in its new form.  Pass 1 touches only the small per-sample tensors of the
mapped chunks, so token data is read into memory once, in pass 2, one chunk at
a time: the master's memory stays near one chunk file however big the batch.
The running sums and the kept samples live in rollout/accumulator.py.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from coordinator.errors import MalformedRecordError
from coordinator.storage.store import read_document
from rollout.accumulator import Accumulator, AggregateMetrics
from rollout.budget import check_batch, check_failures, check_failures_so_far
from rollout.chunk_format import Chunk, read_verified_chunk
from rollout.errors import AggregationError
from rollout.manifest import MANIFEST_NAME, RankManifest, read_manifest
from rollout.train_batch import TrainBatchWriter

logger = logging.getLogger(__name__)

_SHOWN_IDS = 10  # ids quoted in an error; the count says how many more


def _ids(ids: Sequence[str]) -> str:
    shown = sorted(ids)[:_SHOWN_IDS]
    return f"{len(ids)} (first {len(shown)}: {', '.join(shown)})"


def manifest_digest(directory: Path) -> str | None:
    """SHA-256 (hex) of the manifest in a rank directory as it reads now; None if there is
    none.  What a rank reports at phase 3 and what phase 4 then aggregates."""
    return read_document(directory / MANIFEST_NAME,
                         lambda raw, _path: hashlib.sha256(raw).hexdigest())


class _ManifestMoved(ValueError):
    """The manifest's bytes are not those whose digest was pinned.  A ValueError, so the
    reader retries it afresh (a client's stale cache) before it is final."""

    def __init__(self, found: str) -> None:
        super().__init__(found)
        self.found = found


def _read_pinned(directory: Path, pinned: str) -> RankManifest | None:
    """The rank's manifest parsed from the bytes whose SHA-256 is `pinned`, read once:
    no second read can see another file than the one checked."""

    def parse(raw: bytes, path: Path) -> RankManifest:
        found = hashlib.sha256(raw).hexdigest()
        if found != pinned:
            raise _ManifestMoved(found)
        return RankManifest.from_bytes(raw, path)

    return read_document(directory / MANIFEST_NAME, parse)


def _check_manifest(
    rank: int, directory: Path, assigned: Sequence[str], iteration: int,
    frozen: Path | None = None, pinned: str | None = None,
) -> RankManifest:
    try:
        if frozen is not None:
            manifest = read_document(frozen, RankManifest.from_bytes)
        elif pinned is not None:
            manifest = _read_pinned(directory, pinned)
        else:
            manifest = read_manifest(directory)
    except _ManifestMoved as exc:
        path = directory / MANIFEST_NAME
        raise AggregationError(
            f"rank {rank}'s manifest {path} has SHA-256 {exc.found} now, but the rank "
            f"reported {pinned} at phase 3: it changed after the rank finished its rollout (a "
            "writer that outlived its phase), and the batch is built only from the manifest "
            "reported; a rerun of the step pins the manifest as it is then (on_failure "
            f"'wait' reruns it; else `coordinator recover --iteration {iteration}` and "
            "restart every node)", rank=rank, path=path) from None
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
    frozen: Mapping[int, Path],
    oldest_version: int = 0,
    pinned: Mapping[int, str] | None = None,
    max_failed_fraction: float = 1.0,
    where: str = "",
) -> tuple[Accumulator, dict[int, float], ManifestTotals]:
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
    unpinned = sorted(set(rank_dirs) - set(frozen) - set(pinned)) if pinned is not None else []
    if unpinned:
        raise AggregationError(
            f"no manifest digest was reported at phase 3 for rank(s) {unpinned}: phase 4 "
            "aggregates only the manifests phase 3 reported; run phases 1-3 again "
            f"(`coordinator recover --iteration {iteration}`)", rank=unpinned[0])
    acc = Accumulator(group_size, collect)
    speeds: dict[int, float] = {}
    totals = ManifestTotals()
    planned = sum(len(ids) for ids in assignments.values()) * group_size
    for rank in sorted(rank_dirs):
        directory = Path(rank_dirs[rank])
        manifest = _check_manifest(rank, directory, assignments[rank], iteration,
                                   frozen.get(rank), (pinned or {}).get(rank))
        stale = [e.file for e in manifest.chunks if e.policy_version < oldest_version]
        if stale:
            raise AggregationError(
                f"rank {rank}'s {', '.join(stale)} in {directory} come from a policy older than "
                f"version {oldest_version} (run.max_off_policy_steps): the rank should have "
                "dropped and regenerated them; rerun the rollout", rank=rank, path=directory)
        totals.add(manifest)
        for entry in manifest.chunks:
            try:
                chunk = read_verified_chunk(directory / entry.file, entry)
            except MalformedRecordError as exc:
                raise AggregationError(f"rank {rank}: {exc}", rank=rank, path=exc.path) from exc
            _check_chunk(
                chunk,
                rank=rank,
                iteration=iteration,
                task_ids=entry.task_ids,
                group_size=group_size,
            )
            acc.add(chunk, rank=rank, path=directory / entry.file, version=entry.policy_version)
            # Released now unless its token tensors wait, mapped, for pass 2.
            del chunk
            check_failures_so_far(acc.failed, seen=acc.samples, planned=planned,
                                  fraction=max_failed_fraction, where=where,
                                  first=acc.first_error)
        if manifest.rollout_seconds > 0:
            speeds[rank] = manifest.num_samples / manifest.rollout_seconds
        logger.info(
            "iteration %d: rank %d output verified (%d tasks, %d chunks)",
            iteration,
            rank,
            len(assignments[rank]),
            len(manifest.chunks),
        )
    return acc, speeds, totals


@dataclass
class ManifestTotals:
    """What the merged ranks' manifests count beside their chunks: the stale groups
    they dropped, their reward calls and timeouts."""

    stale_groups_dropped: int = 0
    reward_calls: int = 0
    reward_timeouts: int = 0

    def add(self, manifest: RankManifest) -> None:
        self.stale_groups_dropped += manifest.stale_groups_dropped
        self.reward_calls += manifest.reward_calls
        self.reward_timeouts += manifest.reward_timeouts

    def rewards(self, metrics: AggregateMetrics) -> AggregateMetrics:
        """`metrics` with the reward calls that had a time limit, and those that ran out."""
        return replace(metrics, reward_calls=self.reward_calls,
                       reward_timeouts=self.reward_timeouts)

    def into(self, metrics: AggregateMetrics, iteration: int,
             versions: Mapping[int, int]) -> AggregateMetrics:
        """`metrics` with the batch's staleness (iteration minus each sample's version,
        over `versions`: policy version -> the batch's samples of it; failed samples and
        dropped groups are in no batch) and the reward counts."""
        batch = {v: n for v, n in sorted(versions.items()) if n}
        total = sum(batch.values())
        lag = {v: max(0, iteration - v) for v in batch}
        return replace(
            self.rewards(metrics),
            policy_versions=batch,
            staleness_max=max(lag.values(), default=0),
            staleness_mean=sum(lag[v] * n for v, n in batch.items()) / total
            if total else 0.0,
            stale_groups_dropped=self.stale_groups_dropped)


def aggregate_iteration(
    rank_dirs: Mapping[int, Path],
    assignments: Mapping[int, Sequence[str]],
    *,
    iteration: int,
    group_size: int,
    out_path: Path,
    frozen: Mapping[int, Path] | None = None,
    max_failed_fraction: float = 1.0,
    min_batch_fraction: float = 0.0,
    oldest_version: int = 0,
    manifest_sha256: Mapping[int, str] | None = None,
) -> AggregateMetrics:
    """Check every rank's output against the plan, publish the training batch, give metrics.

    `frozen`: for a rank that left (ShardPlan.frozen), the master's copy of the
    manifest of what it saved, read instead of the one in its directory.
    `manifest_sha256`: per rank (frozen ones aside), the digest of its manifest
    as reported at phase 3; each is aggregated only in exactly that form
    (AggregationError naming both digests otherwise).
    The merged result is held to the budget before anything is published
    (rollout/budget.py): at most `max_failed_fraction` failed samples, and a
    batch of at least `min_batch_fraction` of the samples (never an empty one);
    otherwise BudgetError.  A chunk of a policy older than `oldest_version`
    (asynchronous runs) is refused: AggregationError."""
    acc, speeds, totals = _merge(
        rank_dirs, assignments, iteration=iteration, group_size=group_size, collect=True,
        frozen=frozen or {}, oldest_version=oldest_version, pinned=manifest_sha256,
        max_failed_fraction=max_failed_fraction, where="train (all ranks)",
    )
    check_failures(acc.failed, samples=acc.samples, fraction=max_failed_fraction,
                   where="train (all ranks)", first=acc.first_error)
    check_batch(acc.kept_samples, rolled_out=acc.samples, fraction=min_batch_fraction,
                iteration=iteration)
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
    return totals.into(acc.metrics(iteration, speeds), iteration, acc.kept_versions)


def merge_eval_metrics(
    rank_dirs: Mapping[int, Path],
    assignments: Mapping[int, Sequence[str]],
    *,
    iteration: int,
    group_size: int,
    frozen: Mapping[int, Path] | None = None,
    max_failed_fraction: float = 1.0,
) -> AggregateMetrics:
    """The same checks as aggregate_iteration, for eval: metrics only, no batch."""
    acc, speeds, totals = _merge(
        rank_dirs, assignments, iteration=iteration, group_size=group_size, collect=False,
        frozen=frozen or {}, max_failed_fraction=max_failed_fraction, where="eval (all ranks)",
    )
    check_failures(acc.failed, samples=acc.samples, fraction=max_failed_fraction,
                   where="eval (all ranks)", first=acc.first_error)
    return totals.rewards(acc.metrics(iteration, speeds))
