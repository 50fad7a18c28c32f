from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

from coordinator.errors import ExitCode, MalformedRecordError
from rollout.manifest import MANIFEST_NAME, ChunkEntry, RankManifest, read_manifest

SHA = hashlib.sha256(b"chunk").hexdigest()


def manifest() -> RankManifest:
    return RankManifest(
        rank=2,
        iteration=7,
        complete=True,
        rollout_seconds=41.5,
        chunks=(
            ChunkEntry(file="chunk-000000.pt", sha256=SHA, size=81920, num_samples=4,
                       task_ids=("gsm8k/train/12", "gsm8k/train/3")),
            ChunkEntry(file="chunk-000002.pt", sha256=SHA, size=10, num_samples=2,
                       task_ids=("gsm8k/train/5",)),
        ),
    )  # fmt: skip


def test_the_manifest_keeps_its_on_disk_json_and_round_trips(tmp_path: Path) -> None:
    (tmp_path / MANIFEST_NAME).write_bytes(manifest().to_bytes())
    body = json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert body == {
        "schema": "coordinator/rank-manifest", "version": 1,
        "rank": 2, "iteration": 7, "complete": True, "rollout_seconds": 41.5,
        "chunks": [
            {"file": "chunk-000000.pt", "sha256": SHA, "size": 81920, "num_samples": 4,
             "task_ids": ["gsm8k/train/12", "gsm8k/train/3"], "failed_samples": 0,
             "policy_version": 0},
            {"file": "chunk-000002.pt", "sha256": SHA, "size": 10, "num_samples": 2,
             "task_ids": ["gsm8k/train/5"], "failed_samples": 0, "policy_version": 0},
        ],
        "stale_groups_dropped": 0, "reward_calls": 0, "reward_timeouts": 0,
    }  # fmt: skip
    assert read_manifest(tmp_path) == manifest()
    assert manifest().num_samples == 6
    assert manifest().task_ids() == ["gsm8k/train/12", "gsm8k/train/3", "gsm8k/train/5"]


def test_a_manifest_written_before_records_reads_the_same(tmp_path: Path) -> None:
    # The hand-written writer indented its JSON; a run directory may still hold one.
    old = json.loads(manifest().to_bytes()) | {"added_by_a_newer_writer": [1]}
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(old, indent=1))
    assert read_manifest(tmp_path) == manifest()


def test_a_missing_manifest_is_none(tmp_path: Path) -> None:
    assert read_manifest(tmp_path) is None


def planted(tmp_path: Path, **change: object) -> Path:
    body = json.loads(manifest().to_bytes())
    for key, value in change.items():
        if key.startswith("chunk_"):
            body["chunks"][0][key.removeprefix("chunk_")] = value
        else:
            body[key] = value
    path = tmp_path / MANIFEST_NAME
    path.write_text(json.dumps(body))
    return path


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rank": "2"}, r"field 'rank' must be an integer, got '2'"),
        ({"complete": 1}, r"field 'complete' must be true or false"),
        ({"rollout_seconds": "41.5"}, r"field 'rollout_seconds' must be a finite number"),
        ({"chunks": {"file": "chunk-000000.pt"}}, r"field 'chunks' must be a list"),
        ({"chunk_size": 1.5}, r"field 'size' must be an integer, got 1\.5"),
        ({"chunk_task_ids": "gsm8k/train/12"}, r"field 'task_ids' must be a list"),
        ({"chunk_task_ids": [12]}, r"field 'task_ids' must be a string, got 12"),
    ],
)
def test_a_field_of_the_wrong_type_is_coordinators_malformed_record_naming_the_file(
    tmp_path: Path, change: dict, message: str
) -> None:
    path = planted(tmp_path, **change)
    with pytest.raises(MalformedRecordError, match=f"^{re.escape(str(path))}: {message}") as info:
        read_manifest(tmp_path, retry_s=0)
    assert type(info.value) is MalformedRecordError  # coordinator's one type, no look-alike
    assert info.value.path == path and info.value.exit_code is ExitCode.CORRUPT


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"schema": "coordinator/shard-plan"}, r"schema is 'coordinator/shard-plan'"),
        ({"version": 2}, r"version 2 is not supported"),
        ({"rank": -1}, r"rank is -1: expected an integer >= 0"),
        ({"iteration": -3}, r"iteration is -3: expected an integer >= 0"),
        ({"rollout_seconds": -1.0}, r"rollout_seconds is -1\.0: expected a finite number >= 0"),
        ({"chunk_file": "../../escape.pt"}, r"'\.\./\.\./escape\.pt' is not named like chunk"),
        ({"chunk_file": "chunk-000002.pt"}, r"a chunk file is listed twice"),
        ({"chunk_sha256": "ABC"}, r"sha256 of chunk-000000\.pt is 'ABC': expected 64 hex"),
        ({"chunk_num_samples": -4}, r"num_samples of chunk-000000\.pt is -4"),
        ({"chunk_task_ids": ["a", ""]}, r"task_ids of chunk-000000\.pt must be non-empty"),
    ],
)
def test_a_manifest_breaking_a_rule_is_malformed_naming_the_file(
    tmp_path: Path, change: dict, message: str
) -> None:
    path = planted(tmp_path, **change)
    with pytest.raises(MalformedRecordError, match=f"^{re.escape(str(path))}: .*{message}") as info:
        read_manifest(tmp_path, retry_s=0)
    assert info.value.path == path


def test_the_rules_hold_for_manifests_built_in_memory() -> None:
    with pytest.raises(ValueError, match="a chunk file is listed twice"):
        RankManifest(rank=0, iteration=0, chunks=(manifest().chunks[0],) * 2)
    with pytest.raises(ValueError, match="rank is True: expected an integer"):
        RankManifest(rank=True, iteration=0)  # type: ignore[arg-type]
    entry = ChunkEntry(file="chunk-000001.pt", sha256=SHA, size=0, num_samples=0,
                       task_ids=["t"])  # type: ignore[arg-type]  # fmt: skip
    assert entry.task_ids == ("t",)
