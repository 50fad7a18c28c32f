"""The per-rank manifest: which chunk files a rank has safely published.

    {"schema": "coordinator/rank-manifest", "version": 1,
     "rank": 2, "iteration": 7, "complete": false, "rollout_seconds": 41.5,
     "chunks": [{"file": "chunk-000000.pt", "sha256": "<64 hex>", "size": 81920,
                 "num_samples": 32, "failed_samples": 0,
                 "task_ids": ["gsm8k/train/12", ...]}, ...]}

Only a chunk listed here counts; its checksum is what makes a truncated or
altered file detectable.  The rank and iteration inside fence against a
directory left over from another rank or an older iteration.  Both classes are
coordinator records (coordinator/records/records.py): decoding is strict by type,
unknown fields are ignored, and anything else wrong is a MalformedRecordError
naming the file.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Final

from coordinator.records.records import Record
from coordinator.storage.store import read_document

MANIFEST_NAME: Final = "manifest.json"
MANIFEST_SCHEMA: Final = "coordinator/rank-manifest"
# A plain file name, never a path: a manifest must not be able to point the
# reader outside its rank directory.
CHUNK_NAME: Final = re.compile(r"chunk-(\d{6})\.pt")
_SHA256: Final = re.compile(r"[0-9a-f]{64}")


def chunk_file_name(index: int) -> str:
    return f"chunk-{index:06d}.pt"


def _int(value: Any, what: str, minimum: int = 0) -> int:
    if type(value) is not int or value < minimum:
        raise ValueError(f"{what} is {value!r}: expected an integer >= {minimum}")
    return value


@dataclass(frozen=True, kw_only=True)
class ChunkEntry(Record):
    """One published chunk file as its manifest lists it."""

    # Only ever nested in a RankManifest, where it is written without schema
    # and version; the name identifies the type in errors and tests.
    SCHEMA: ClassVar[str] = "coordinator/rank-manifest/chunk"
    file: str
    sha256: str
    size: int
    num_samples: int
    task_ids: tuple[str, ...]
    # Samples of these groups that failed.  While the manifest is not complete
    # such a chunk is not taken as done: its groups are redone (trajectory.py).
    failed_samples: int = 0
    # The policy version its samples came from (the oldest, were they to differ).
    policy_version: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.file, str) or not CHUNK_NAME.fullmatch(self.file):
            raise ValueError(f"chunk file {self.file!r} is not named like chunk-000000.pt")
        if not isinstance(self.sha256, str) or not _SHA256.fullmatch(self.sha256):
            raise ValueError(f"sha256 of {self.file} is {self.sha256!r}: expected 64 hex digits")
        _int(self.size, f"size of {self.file}")
        _int(self.num_samples, f"num_samples of {self.file}")
        _int(self.failed_samples, f"failed_samples of {self.file}")
        _int(self.policy_version, f"policy_version of {self.file}")
        if self.failed_samples > self.num_samples:
            raise ValueError(f"{self.file} has {self.failed_samples} failed samples of "
                             f"{self.num_samples}")
        object.__setattr__(self, "task_ids", tuple(self.task_ids))
        if not all(isinstance(t, str) and t for t in self.task_ids):
            raise ValueError(f"task_ids of {self.file} must be non-empty strings")


@dataclass(frozen=True, kw_only=True)
class RankManifest(Record):
    """The chunks one rank published for one iteration, and whether it is done."""

    SCHEMA: ClassVar[str] = MANIFEST_SCHEMA
    rank: int
    iteration: int
    complete: bool = False
    rollout_seconds: float = 0.0
    chunks: tuple[ChunkEntry, ...] = ()
    # Groups dropped because their policy was older than the batch allows
    # (run.max_off_policy_steps), and generated again: counted over the rank's tries.
    stale_groups_dropped: int = 0
    # Calls of a reward with a time limit (the math reward), and those of them
    # that ran out of it and scored 0 (rollout/reward_tally.py): over the rank's tries.
    reward_calls: int = 0
    reward_timeouts: int = 0

    def __post_init__(self) -> None:
        _int(self.rank, "rank")
        _int(self.stale_groups_dropped, "stale_groups_dropped")
        _int(self.reward_calls, "reward_calls")
        _int(self.reward_timeouts, "reward_timeouts")
        if self.reward_timeouts > self.reward_calls:
            raise ValueError(f"reward_timeouts {self.reward_timeouts} exceed reward_calls "
                             f"{self.reward_calls}")
        _int(self.iteration, "iteration")
        if not isinstance(self.complete, bool):
            raise ValueError(f"complete is {self.complete!r}: expected true or false")
        seconds = self.rollout_seconds
        if isinstance(seconds, bool) or not isinstance(seconds, int | float):
            raise ValueError(f"rollout_seconds is {seconds!r}: expected a number")
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"rollout_seconds is {seconds}: expected a finite number >= 0")
        object.__setattr__(self, "rollout_seconds", float(seconds))
        object.__setattr__(self, "chunks", tuple(self.chunks))
        names = [c.file for c in self.chunks]
        if len(set(names)) != len(names):
            raise ValueError(f"a chunk file is listed twice in {names}")

    @property
    def num_samples(self) -> int:
        return sum(c.num_samples for c in self.chunks)

    @property
    def failed_samples(self) -> int:
        return sum(c.failed_samples for c in self.chunks)

    @property
    def policy_versions(self) -> dict[int, int]:
        """Samples per policy version."""
        out: dict[int, int] = {}
        for c in self.chunks:
            out[c.policy_version] = out.get(c.policy_version, 0) + c.num_samples
        return out

    def task_ids(self) -> list[str]:
        """All listed task ids, in chunk order; repeats kept, for the caller to judge."""
        return [t for c in self.chunks for t in c.task_ids]


def read_manifest(directory: Path, *, retry_s: float | None = None) -> RankManifest | None:
    """The manifest in a rank directory, None if there is none yet.

    Read like every record (coordinator.storage.store.read_document): a torn or stale
    read is retried until `retry_s`, then the manifest is reported malformed.
    """
    return read_document(directory / MANIFEST_NAME, RankManifest.from_bytes, retry_s=retry_s)
