"""The rank's checkpoint writer: its rollout saved as it goes, redone at most K groups.

A rank rolls out its shard group by group (one group = the n samples of one
task) and checkpoints as it goes, so a killed rank redoes at most K groups:

    add_group ... add_group (K groups) --> chunk-000007.pt (new file, atomic)
                                       --> manifest.json   (atomic, lists the
                                           chunk's SHA-256, task ids and
                                           failed samples)
    restart --> load_completed_task_ids(): every listed chunk's checksum is
                verified; a bad chunk is reported and dropped, so its groups
                are redone; an unlisted chunk (killed between the two
                publishes) is ignored, never trusted; while the manifest is
                not complete, a chunk holding a failed sample is dropped too,
                so a rerun redoes every failed sample
    finalize --> last partial chunk, manifest marked complete: the caller
                 accepted the result (its failures within the budget,
                 rollout/budget.py), and only then are failed samples final

The chunk is published before the manifest that names it, so a manifest never
points at a missing file unless something outside the writer removed it.

The samples and the chunk file format are in rollout/chunk_format.py; their
names are re-exported here, where the rollout loop, the benchmarks and the
tests have always imported them.
"""

from __future__ import annotations

import hashlib
import io
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import torch

from coordinator.errors import IntegrityError, MalformedRecordError, UnsafeFileError
from coordinator.storage import trees
from coordinator.storage.fsio import ensure_dir, publish_bytes, remove
from coordinator.storage.verified import read_verified
from rollout.chunk_format import (
    TrajectorySample,
    encode_chunk,
)
from rollout.errors import CheckpointError
from rollout.manifest import (
    CHUNK_NAME,
    MANIFEST_NAME,
    ChunkEntry,
    RankManifest,
    chunk_file_name,
    read_manifest,
)
from rollout.reward_tally import RewardTally

logger = logging.getLogger(__name__)


class RankCheckpointWriter:
    """Publishes a rank's groups as checksummed chunk files every K groups, or every
    S seconds when groups come slowly (long answers), whichever is first.

    One writer per rank directory at a time (the coordinator runs one rollout
    process per rank).  `clock` is injectable so tests can fix wall times.
    """

    def __init__(
        self,
        directory: Path,
        rank: int,
        every_k_groups: int,
        *,
        iteration: int,
        every_s: float | None = None,
        policy_version: int = 0,
        rewards: RewardTally | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if type(every_k_groups) is not int or every_k_groups < 1:
            raise ValueError(
                f"every_k_groups={every_k_groups!r} is below 1: checkpoint every 1 or more groups"
            )
        if every_s is not None and not every_s > 0:
            raise ValueError(f"every_s={every_s!r} must be a positive number of seconds or None")
        self.directory = Path(directory)
        self.rank = rank
        self.every_k_groups = every_k_groups
        self.every_s = every_s
        self.iteration = iteration
        # Stamped on every sample added: the policy the rank's engine serves.
        self.policy_version = policy_version
        self._clock = clock
        self._last_flush = clock()
        ensure_dir(self.directory)
        self._manifest = self._open_manifest()
        # Every manifest published adds what `rewards` has counted so far to the
        # counts of the earlier tries.
        self._rewards = rewards
        self._rewards_before = (self._manifest.reward_calls, self._manifest.reward_timeouts)
        self._session_start = clock()
        self._pending: list[tuple[TrajectorySample, ...]] = []
        self._done: set[str] = set(self._manifest.task_ids())
        self._next_index = 1 + max(
            [-1]
            + [
                int(m.group(1))
                for c in self._manifest.chunks
                if (m := CHUNK_NAME.fullmatch(c.file))
            ]
            + [
                int(m.group(1))
                for name in trees.listdir(self.directory)
                if (m := CHUNK_NAME.fullmatch(name))
            ]
        )
        self._remove_stale_temp_files()

    @property
    def manifest(self) -> RankManifest:
        return self._manifest

    def load_completed_task_ids(self, *, oldest_version: int = 0) -> frozenset[str]:
        """Task ids whose groups are safely saved; chunks failing their checksum are
        dropped, and so, unless the manifest is complete, are chunks holding a failed
        sample: a failed sample is never taken as done.  Chunks of a policy older
        than `oldest_version` are dropped too, complete or not, and counted in the
        manifest's stale_groups_dropped: their groups are generated again."""
        kept = verified_chunks(self.directory, self._manifest)
        stale = [c for c in kept if c.policy_version < oldest_version]
        dropped = sum(len(c.task_ids) for c in stale)
        if stale:
            logger.warning("rank %d iteration %d: %d groups in %d chunks come from policy "
                           "versions %s, older than %d (run.max_off_policy_steps): dropped, "
                           "generated again", self.rank, self.iteration, dropped, len(stale),
                           sorted({c.policy_version for c in stale}), oldest_version)
            kept = tuple(c for c in kept if c.policy_version >= oldest_version)
            self._manifest = replace(
                self._manifest, stale_groups_dropped=self._manifest.stale_groups_dropped + dropped)
            self._publish_manifest(chunks=kept, complete=False)
        if not self._manifest.complete:
            failed = [c for c in kept if c.failed_samples]
            for entry in failed:
                logger.info("rank %d iteration %d: %s holds %d failed samples: its %d groups "
                            "will be redone", self.rank, self.iteration, entry.file,
                            entry.failed_samples, len(entry.task_ids))
            kept = tuple(c for c in kept if not c.failed_samples)
        if len(kept) != len(self._manifest.chunks):
            self._publish_manifest(chunks=tuple(kept), complete=False)
        saved = self._manifest.task_ids()
        self._done = {*saved, *(g[0].task_id for g in self._pending)}
        return frozenset(saved)

    def restart_clock(self) -> None:
        """Rollout time (the manifest's rollout_seconds) counts from now: what came
        since the writer opened (the engine started or woken) is not generation."""
        self._session_start = self._clock()

    def reopen(self) -> None:
        """Take more groups after finalize: the rank was given more tasks (the group
        went on without a lost rank and shared out its unfinished ones)."""
        if self._manifest.complete:
            self._publish_manifest(chunks=self._manifest.chunks, complete=False)

    def add_group(self, samples: Sequence[TrajectorySample]) -> None:
        """Queue the n samples of one task; publishes a chunk once K groups wait."""
        if self._manifest.complete:
            raise CheckpointError(
                f"rank {self.rank} checkpoint in {self.directory} is already finalized: "
                "start a new iteration directory for new groups",
                path=self.directory,
                rank=self.rank,
            )
        group = tuple(samples)
        if not group:
            raise ValueError("empty group: a group holds the n samples of one task")
        task_id = group[0].task_id
        if any(s.task_id != task_id for s in group):
            raise ValueError(f"group of {task_id} mixes task ids: one group is one task")
        indices = [s.sample_index for s in group]
        if len(set(indices)) != len(indices):
            raise ValueError(f"group of {task_id} repeats sample indices {sorted(indices)}")
        if task_id in self._done:
            raise CheckpointError(
                f"task {task_id} is already saved for rank {self.rank}: skip the ids "
                "load_completed_task_ids() returns",
                path=self.directory,
                rank=self.rank,
            )
        self._done.add(task_id)
        self._pending.append(tuple(replace(x, policy_version=self.policy_version)
                                   for x in group))
        overdue = self.every_s is not None and self._clock() - self._last_flush >= self.every_s
        if len(self._pending) >= self.every_k_groups or overdue:
            self.flush()

    def flush(self) -> None:
        """Publish the waiting groups now, as one new chunk file."""
        if not self._pending:
            return
        payload = encode_chunk(self._pending, rank=self.rank, iteration=self.iteration)
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        data = buffer.getvalue()
        name = chunk_file_name(self._next_index)
        publish_bytes(self.directory / name, data)
        entry = ChunkEntry(
            file=name,
            sha256=hashlib.sha256(data).hexdigest(),
            size=len(data),
            num_samples=sum(len(g) for g in self._pending),
            task_ids=tuple(g[0].task_id for g in self._pending),
            failed_samples=sum(s.failed for g in self._pending for s in g),
            policy_version=min(s.policy_version for g in self._pending for s in g),
        )
        # The chunk is on disk before the manifest names it: a kill in between
        # leaves an unlisted file, whose groups are simply redone.
        self._publish_manifest(chunks=(*self._manifest.chunks, entry), complete=False)
        self._next_index += 1
        self._pending.clear()
        self._last_flush = self._clock()
        logger.debug(
            "rank %d iteration %d: published %s (%d groups, %d bytes)",
            self.rank,
            self.iteration,
            name,
            len(entry.task_ids),
            entry.size,
        )

    def finalize(self) -> RankManifest:
        """Publish the remainder and mark the manifest complete; idempotent."""
        self.flush()
        if not self._manifest.complete:
            self._publish_manifest(chunks=self._manifest.chunks, complete=True)
            logger.info(
                "rank %d iteration %d: rollout checkpoint complete, %d groups in %d chunks, %.1fs",
                self.rank,
                self.iteration,
                len(self._manifest.task_ids()),
                len(self._manifest.chunks),
                self._manifest.rollout_seconds,
            )
        return self._manifest

    def _publish_manifest(self, *, chunks: tuple[ChunkEntry, ...], complete: bool) -> None:
        now = self._clock()
        manifest = replace(
            self._manifest,
            chunks=chunks,
            complete=complete,
            rollout_seconds=self._manifest.rollout_seconds + max(0.0, now - self._session_start),
        )
        if self._rewards is not None:
            calls, timeouts = self._rewards.counts()
            manifest = replace(manifest, reward_calls=self._rewards_before[0] + calls,
                               reward_timeouts=self._rewards_before[1] + timeouts)
        publish_bytes(self.directory / MANIFEST_NAME, manifest.to_bytes())
        self._manifest = manifest
        self._session_start = now

    def _open_manifest(self) -> RankManifest:
        path = self.directory / MANIFEST_NAME
        try:
            found = read_manifest(self.directory)
        except MalformedRecordError as exc:
            # Still unparsable after read_manifest's retries (which outlast a
            # torn read from a stale client cache): damage.  Starting over
            # costs one redo and trusts nothing damaged.
            logger.warning("rank %d: %s; starting this rank's checkpoint afresh", self.rank, exc)
            found = None
        if found is None:
            return RankManifest(rank=self.rank, iteration=self.iteration)
        if found.rank != self.rank or found.iteration != self.iteration:
            raise CheckpointError(
                f"{path} belongs to rank {found.rank} iteration {found.iteration}, not rank "
                f"{self.rank} iteration {self.iteration}: give each rank and iteration its own "
                "directory",
                path=path,
                rank=self.rank,
            )
        return found

    def _remove_stale_temp_files(self) -> None:
        # Leftovers of a publish killed half-way: ours by name, in our own
        # directory, and never the target of a rename any more.
        # Listed and removed beneath the run directory, never through a symlink.
        for name in trees.listdir(self.directory):
            if name.endswith(".tmp") and name.startswith((".chunk-", f".{MANIFEST_NAME}.")):
                remove(self.directory / name)


def verified_chunks(directory: Path, manifest: RankManifest) -> tuple[ChunkEntry, ...]:
    """The chunks of `manifest` whose file in `directory` matches its size and SHA-256."""
    kept = []
    for entry in manifest.chunks:
        path = directory / entry.file
        try:
            read_verified(path, size=entry.size, sha256=entry.sha256).close()
        except (IntegrityError, FileNotFoundError, UnsafeFileError) as exc:
            # Damaged, gone or replaced by something that is not a file: its
            # groups are redone.  An I/O error is not damage and is not caught
            # here: it fails the phase, naming the file.
            logger.warning(
                "rank %d iteration %d: chunk %s cannot be used (%s); its %d groups will be "
                "redone", manifest.rank, manifest.iteration, path, exc, len(entry.task_ids))
        else:
            kept.append(entry)
    return tuple(kept)


def saved_work(directory: Path, *, rank: int, iteration: int) -> RankManifest:
    """What a rank that left has safely saved, as a complete manifest: its verified
    chunks (none without a readable manifest of this rank and iteration), less,
    unless the rank had accepted its result (its manifest complete), every chunk
    holding a failed sample: a failed sample is never taken as done, so those
    groups are redone by whoever takes the rank's other tasks.  Read only: nothing
    is written in the rank's directory."""
    try:
        found = read_manifest(directory)
    except MalformedRecordError as exc:
        logger.warning("rank %d: %s; none of its groups are kept", rank, exc)
        found = None
    if found is None or found.rank != rank or found.iteration != iteration:
        return RankManifest(rank=rank, iteration=iteration, complete=True)
    kept = verified_chunks(directory, found)
    if not found.complete:
        failed = [c for c in kept if c.failed_samples]
        for entry in failed:
            logger.info("rank %d iteration %d: %s holds %d failed samples: its %d groups "
                        "will be redone by the ranks that take over", rank, iteration,
                        entry.file, entry.failed_samples, len(entry.task_ids))
        kept = tuple(c for c in kept if not c.failed_samples)
    return replace(found, chunks=kept, complete=True)
