"""Phase 3 pins each rank's manifest by digest; phase 4 aggregates only that (issue 32,
finding 8).  The aggregation side is tests/rollout/test_aggregate.py; here the decision
and the record that carries it."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.errors import ActionError, MalformedRecordError
from rl.aggregation import pinned_digests
from rl.contracts import PinnedManifests

A, B = "a" * 64, "b" * 64


def test_the_decision_pins_what_each_rank_reported_and_reads_only_for_a_skipped_phase() -> None:
    asked: list[int] = []

    def read(rank: int) -> str | None:
        asked.append(rank)
        return B

    # Rank 2 arrived without a digest: its journal marked phase 3 done (a restarted
    # group), so the master hashes its manifest as it reads it now.
    assert pinned_digests([0, 2, 1], {0: A, 1: A, 3: A}, read) == {0: A, 1: A, 2: B}
    assert asked == [2]


def test_a_rank_with_tasks_and_no_manifest_fails_the_phase_naming_it() -> None:
    with pytest.raises(ActionError, match=r"rank 1 has train tasks but reported no manifest "
                                          r"digest at phase 3 \(None\)"):
        pinned_digests([0, 1], {0: A}, lambda rank: None)


def test_the_release_record_refuses_what_is_not_a_rank_and_a_digest(tmp_path: Path) -> None:
    record = PinnedManifests(manifest_sha256={"0": A, "12": B})
    assert PinnedManifests.from_fields(record.fields(), tmp_path).by_rank() == {0: A, 12: B}
    for bad in ({"x": A}, {"0": "abc"}, {"0": 5}):
        with pytest.raises(MalformedRecordError):
            PinnedManifests.from_fields({"manifest_sha256": bad}, tmp_path)
