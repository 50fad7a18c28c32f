from __future__ import annotations

import io
import json
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from coordinator.errors import MalformedRecordError
from rollout.chunk_format import (
    FinishReason,
    TrajectorySample,
    decode_chunk,
    encode_chunk,
    read_verified_chunk,
)
from rollout.errors import CheckpointError
from rollout.manifest import MANIFEST_NAME, read_manifest
from rollout.trajectory import RankCheckpointWriter, saved_work

# Damaged files are reported after the read deadline: 1 s here (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("quick_read_retry")

PROJECT = Path(__file__).resolve().parents[2]


def make_group(task_id: str, n: int = 2, *, failed: tuple[int, ...] = ()) -> list[TrajectorySample]:
    out = []
    for i in range(n):
        length = 1 + (i % 3)
        out.append(
            TrajectorySample(
                task_id=task_id,
                sample_index=i,
                prompt_token_ids=[5, 6, 7],
                response_token_ids=[] if i in failed else [100 + j for j in range(length)],
                response_logprobs=[] if i in failed else [-0.5] * length,
                response_text="" if i in failed else f"answer {i}",
                reward=0.0 if i in failed else float(i % 2),
                finish_reason=FinishReason.ERROR if i in failed else FinishReason.STOP,
                failed=i in failed,
                error="engine died" if i in failed else "",
            )
        )
    return out


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_chunk_is_published_every_k_groups_with_its_checksum_in_the_manifest(
    tmp_path: Path,
) -> None:
    writer = RankCheckpointWriter(tmp_path, 3, 2, iteration=7)
    writer.add_group(make_group("t/0"))
    assert not (tmp_path / "chunk-000000.pt").exists()
    writer.add_group(make_group("t/1"))
    writer.add_group(make_group("t/2"))
    manifest = read_manifest(tmp_path)
    assert manifest is not None and manifest.rank == 3 and manifest.iteration == 7
    assert not manifest.complete
    (entry,) = manifest.chunks
    assert entry.file == "chunk-000000.pt" and entry.task_ids == ("t/0", "t/1")
    chunk = read_verified_chunk(tmp_path / entry.file, entry)
    assert list(chunk.samples()) == make_group("t/0") + make_group("t/1")
    assert (tmp_path / entry.file).stat().st_mode & 0o777 == 0o644
    assert (tmp_path / MANIFEST_NAME).stat().st_mode & 0o777 == 0o644
    data = json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert (data["schema"], data["version"]) == ("coordinator/rank-manifest", 1)


def test_time_before_the_clock_restarts_is_not_rollout_time(tmp_path: Path) -> None:
    """rl/rollouts.py opens the writer, then makes the engine serve (a start or a wake,
    in a run that only evaluates), then restarts the clock: rollout_seconds, and the
    samples per second made of it, hold generation alone."""
    clock = FakeClock()
    writer = RankCheckpointWriter(tmp_path, 0, 4, iteration=0, clock=clock)
    clock.now += 90.0  # the engine starting
    writer.restart_clock()
    writer.add_group(make_group("t/0"))
    clock.now += 8.0
    assert writer.finalize().rollout_seconds == pytest.approx(8.0)


def test_finalize_publishes_the_remainder_and_marks_the_manifest_complete(tmp_path: Path) -> None:
    clock = FakeClock()
    writer = RankCheckpointWriter(tmp_path, 0, 4, iteration=0, clock=clock)
    for i in range(5):
        writer.add_group(make_group(f"t/{i}", failed=(1,) if i == 2 else ()))
    clock.now += 12.5
    manifest = writer.finalize()
    assert manifest.complete and manifest.rollout_seconds == pytest.approx(12.5)
    assert [c.task_ids for c in manifest.chunks] == [("t/0", "t/1", "t/2", "t/3"), ("t/4",)]
    assert writer.finalize() == read_manifest(tmp_path)  # idempotent
    chunk = read_verified_chunk(tmp_path / "chunk-000000.pt", manifest.chunks[0])
    failed = [s for s in chunk.samples() if s.failed]
    assert [(s.task_id, s.error, s.finish_reason) for s in failed] == [
        ("t/2", "engine died", FinishReason.ERROR)
    ]
    with pytest.raises(CheckpointError, match="already finalized"):
        writer.add_group(make_group("t/9"))


def test_chunk_files_hold_only_tensors_and_plain_containers(tmp_path: Path) -> None:
    writer = RankCheckpointWriter(tmp_path, 0, 1, iteration=0)
    writer.add_group(make_group("t/0", 3))
    obj = torch.load(tmp_path / "chunk-000000.pt", weights_only=True)
    assert obj["prompt_tokens"].dtype == torch.int32
    assert obj["response_offsets"].tolist() == [0, 1, 3, 6]

    def plain(value: object) -> bool:
        if isinstance(value, dict):
            return all(isinstance(k, str) and plain(v) for k, v in value.items())
        if isinstance(value, list):
            return all(plain(v) for v in value)
        return isinstance(value, torch.Tensor | str | int | float | bool)

    assert plain(obj)


def test_a_task_cannot_be_saved_twice_or_mixed_within_a_group(tmp_path: Path) -> None:
    writer = RankCheckpointWriter(tmp_path, 0, 1, iteration=0)
    writer.add_group(make_group("t/0"))
    with pytest.raises(CheckpointError, match="task t/0 is already saved for rank 0"):
        writer.add_group(make_group("t/0"))
    with pytest.raises(ValueError, match="mixes task ids"):
        writer.add_group(make_group("t/1")[:1] + make_group("t/2")[1:])
    with pytest.raises(ValueError, match="repeats sample indices"):
        writer.add_group(make_group("t/3")[:1] * 2)


def test_a_directory_of_another_rank_or_iteration_is_refused(tmp_path: Path) -> None:
    RankCheckpointWriter(tmp_path, 1, 1, iteration=4).add_group(make_group("t/0"))
    with pytest.raises(CheckpointError, match="belongs to rank 1 iteration 4, not rank 2"):
        RankCheckpointWriter(tmp_path, 2, 1, iteration=4)
    with pytest.raises(CheckpointError, match="not rank 1 iteration 5"):
        RankCheckpointWriter(tmp_path, 1, 1, iteration=5)


def test_restart_keeps_verified_groups_and_rollout_time(tmp_path: Path) -> None:
    clock = FakeClock()
    first = RankCheckpointWriter(tmp_path, 0, 2, iteration=0, clock=clock)
    for i in range(5):
        first.add_group(make_group(f"t/{i}"))
        clock.now += 1.0
    # Killed here: t/4 was pending and is lost; 4 s were spent up to the last publish.
    second = RankCheckpointWriter(tmp_path, 0, 2, iteration=0, clock=clock)
    assert second.load_completed_task_ids() == {"t/0", "t/1", "t/2", "t/3"}
    second.add_group(make_group("t/4"))
    clock.now += 2.0
    manifest = second.finalize()
    assert manifest.rollout_seconds == pytest.approx(3.0 + 2.0)
    assert manifest.task_ids() == [f"t/{i}" for i in range(5)]


@pytest.mark.parametrize("damage", ["truncate", "flip_byte"])
def test_a_damaged_chunk_is_reported_dropped_and_its_groups_redone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    writer = RankCheckpointWriter(tmp_path, 0, 2, iteration=0)
    for i in range(6):
        writer.add_group(make_group(f"t/{i}"))
    victim = tmp_path / "chunk-000001.pt"
    data = victim.read_bytes()
    if damage == "truncate":
        victim.write_bytes(data[: len(data) // 2])
    else:
        victim.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    with caplog.at_level(logging.WARNING):
        restarted = RankCheckpointWriter(tmp_path, 0, 2, iteration=0)
        done = restarted.load_completed_task_ids()
    assert done == {"t/0", "t/1", "t/4", "t/5"}
    assert str(victim) in caplog.text and "truncated or altered" in caplog.text
    manifest = read_manifest(tmp_path)
    assert manifest is not None and "chunk-000001.pt" not in [c.file for c in manifest.chunks]
    for i in (2, 3):
        restarted.add_group(make_group(f"t/{i}"))
    final = restarted.finalize()
    assert sorted(final.task_ids()) == [f"t/{i}" for i in range(6)]
    assert "chunk-000001.pt" not in [c.file for c in final.chunks]  # never reused


def test_an_unlisted_chunk_from_a_kill_before_the_manifest_is_ignored_and_kept(
    tmp_path: Path,
) -> None:
    writer = RankCheckpointWriter(tmp_path, 0, 1, iteration=0)
    writer.add_group(make_group("t/0"))
    orphan = tmp_path / "chunk-000005.pt"
    orphan.write_bytes((tmp_path / "chunk-000000.pt").read_bytes())
    (tmp_path / ".chunk-000006.pt.abc123.tmp").write_bytes(b"half a file")
    restarted = RankCheckpointWriter(tmp_path, 0, 1, iteration=0)
    assert restarted.load_completed_task_ids() == {"t/0"}
    restarted.add_group(make_group("t/1"))
    manifest = read_manifest(tmp_path)
    assert manifest is not None and [c.file for c in manifest.chunks] == [
        "chunk-000000.pt",
        "chunk-000006.pt",
    ]
    assert not list(tmp_path.glob("*.tmp"))


def test_a_corrupt_manifest_is_reported_and_the_rank_starts_afresh(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    RankCheckpointWriter(tmp_path, 0, 1, iteration=0).add_group(make_group("t/0"))
    (tmp_path / MANIFEST_NAME).write_text('{"schema": "coordinator/rank-manifest", "vers')
    with caplog.at_level(logging.WARNING):
        writer = RankCheckpointWriter(tmp_path, 0, 1, iteration=0)
    assert "not valid JSON" in caplog.text and "afresh" in caplog.text
    assert writer.load_completed_task_ids() == frozenset()


_CHILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from rollout.chunk_format import FinishReason, TrajectorySample
    from rollout.trajectory import RankCheckpointWriter

    directory, k, n = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    writer = RankCheckpointWriter(directory, 0, k, iteration=0)
    done = writer.load_completed_task_ids()
    progress = open(sys.argv[4], "a")
    for i in range(n):
        task_id = f"t/{i:04d}"
        if task_id in done:
            continue
        # Logged before saving: the groups whose rollout work a kill can lose.
        progress.write(task_id + "\\n")
        progress.flush()
        writer.add_group([
            TrajectorySample(task_id=task_id, sample_index=j, prompt_token_ids=[1, 2],
                response_token_ids=[3] * 50, response_logprobs=[-0.1] * 50,
                response_text="x", reward=1.0, finish_reason=FinishReason.STOP)
            for j in range(4)
        ])
        time.sleep(0.02)  # a rollout's pace: the kill lands long before the end
    writer.finalize()
    """
)


def test_a_rank_killed_mid_rollout_redoes_at_most_k_groups_after_restart(tmp_path: Path) -> None:
    k, n = 3, 200
    directory, progress = tmp_path / "rank-0", tmp_path / "progress.txt"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(PROJECT)}
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(directory), str(k), str(n), str(progress)],
        env=env,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 45
        while time.monotonic() < deadline:
            manifest = read_manifest(directory) if directory.exists() else None
            if manifest is not None and len(manifest.chunks) >= 3:
                break
            assert child.poll() is None, "the writer exited before it could be killed"
            time.sleep(0.01)
        else:
            pytest.fail("the writer published no 3 chunks within 45 s")
        time.sleep(random.uniform(0, 0.05))  # land anywhere inside a chunk's K groups
        os.killpg(child.pid, signal.SIGKILL)
        assert child.wait(timeout=10) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    added = progress.read_text().split()
    assert len(added) < n, "the writer finished before the kill; the test proved nothing"
    restarted = RankCheckpointWriter(directory, 0, k, iteration=0)
    done = restarted.load_completed_task_ids()
    assert done <= set(added)
    assert len(set(added) - done) <= k
    finisher = RankCheckpointWriter(directory, 0, 100, iteration=0)  # few fsyncs
    assert finisher.load_completed_task_ids() == done
    for i in range(n):
        if f"t/{i:04d}" not in done:
            finisher.add_group(make_group(f"t/{i:04d}", 4))
    final = finisher.finalize()
    assert sorted(final.task_ids()) == [f"t/{i:04d}" for i in range(n)]


def test_samples_with_inconsistent_fields_are_refused() -> None:
    good = make_group("t/0", 1)[0]
    fields = {f: getattr(good, f) for f in good.__dataclass_fields__}
    with pytest.raises(ValueError, match="2 response tokens but 1 logprobs"):
        TrajectorySample(**{**fields, "response_token_ids": [1, 2], "response_logprobs": [-1.0]})
    with pytest.raises(ValueError, match="a failed sample needs an error message"):
        TrajectorySample(**{**fields, "failed": True})
    with pytest.raises(ValueError, match="not a valid FinishReason"):
        TrajectorySample(**{**fields, "finish_reason": "tired"})
    with pytest.raises(ValueError, match="give a list of ints"):
        TrajectorySample(**{**fields, "prompt_token_ids": [1.5]})


def test_non_finite_logprobs_and_oversized_token_ids_are_refused_at_encoding() -> None:
    sample = make_group("t/0", 1)[0]
    fields = {f: getattr(sample, f) for f in sample.__dataclass_fields__}
    bad = TrajectorySample(**{**fields, "response_logprobs": [float("-inf")]})
    with pytest.raises(ValueError, match="NaN or infinite"):
        encode_chunk([[bad]], rank=0, iteration=0)
    huge = TrajectorySample(**{**fields, "prompt_token_ids": [2**40]})
    with pytest.raises(ValueError, match="does not fit in int32"):
        encode_chunk([[huge]], rank=0, iteration=0)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("response_offsets", torch.tensor([0, 5, 2, 6]), "response_offsets do not delimit"),
        ("prompt_tokens", torch.zeros(9, dtype=torch.int64), "prompt_tokens must be a 1-D"),
        ("sample_group", torch.tensor([0, 1, 0]), "sample_group must be sorted"),
        ("task_ids", ["t/0", 7], "task_ids must be a list of str"),
        ("version", 2, "version 2"),
    ],
)
def test_decoding_refuses_structurally_inconsistent_chunks(
    key: str, value: object, message: str
) -> None:
    payload = encode_chunk([make_group("t/0", 3)], rank=0, iteration=0)
    payload[key] = value
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    buffer.seek(0)
    expected = rf"^c\.pt: malformed chunk: .*{message}"
    with pytest.raises(MalformedRecordError, match=expected) as info:
        decode_chunk(torch.load(buffer, weights_only=True), path=Path("c.pt"))
    assert info.value.path == Path("c.pt")


def test_a_failed_sample_is_never_taken_as_done_until_the_manifest_is_complete(
        tmp_path: Path) -> None:
    writer = RankCheckpointWriter(tmp_path, 0, 2, iteration=0)
    writer.add_group(make_group("a"))
    writer.add_group(make_group("b", failed=(1,)))  # chunk 0: a, b (1 failed sample)
    writer.add_group(make_group("c"))
    writer.add_group(make_group("d"))  # chunk 1: c, d
    writer.flush()
    assert writer.manifest.failed_samples == 1 and not writer.manifest.complete
    # The phase failed its budget and runs again: the chunk holding the failed
    # sample is dropped from the manifest, so both of its groups are redone.
    again = RankCheckpointWriter(tmp_path, 0, 2, iteration=0)
    assert again.load_completed_task_ids() == {"c", "d"}
    kept = read_manifest(tmp_path)
    assert kept is not None and [c.task_ids for c in kept.chunks] == [("c", "d")]
    again.add_group(make_group("a"))
    again.add_group(make_group("b"))  # succeeded this time
    manifest = again.finalize()
    assert sorted(manifest.task_ids()) == ["a", "b", "c", "d"]
    assert manifest.failed_samples == 0 and manifest.complete
    assert len({c.file for c in manifest.chunks}) == 2  # a new name, never the dropped one's


def test_failed_samples_a_complete_manifest_accepted_stay_done(tmp_path: Path) -> None:
    writer = RankCheckpointWriter(tmp_path, 0, 8, iteration=0)
    writer.add_group(make_group("a", failed=(0,)))
    writer.add_group(make_group("b"))
    writer.finalize()  # within the budget: the caller accepted it
    again = RankCheckpointWriter(tmp_path, 0, 8, iteration=0)
    assert again.load_completed_task_ids() == {"a", "b"}
    assert again.manifest.failed_samples == 1


def test_a_lost_ranks_failed_samples_are_not_frozen_as_done(tmp_path: Path) -> None:
    """saved_work (a shrink's takeover, rl/takeover.py) reads what a lost rank saved: an
    incomplete manifest's chunks holding a failed sample are left out, so their groups
    are redone by the members; a complete manifest's accepted failures stay final."""
    writer = RankCheckpointWriter(tmp_path, 2, 2, iteration=0)
    writer.add_group(make_group("a"))
    writer.add_group(make_group("b", failed=(1,)))  # chunk 0: a, b (1 failed sample)
    writer.add_group(make_group("c"))
    writer.add_group(make_group("d"))  # chunk 1: c, d
    # Killed here: the manifest is not complete.
    work = saved_work(tmp_path, rank=2, iteration=0)
    assert work.complete and sorted(work.task_ids()) == ["c", "d"]
    assert work.failed_samples == 0
    untouched = read_manifest(tmp_path)  # read only: the rank's own manifest is left as it was
    assert untouched is not None
    assert [c.task_ids for c in untouched.chunks] == [("a", "b"), ("c", "d")]

    writer.finalize()  # within the budget: the rank accepted it before it was lost
    accepted = saved_work(tmp_path, rank=2, iteration=0)
    assert sorted(accepted.task_ids()) == ["a", "b", "c", "d"]
    assert accepted.failed_samples == 1


def test_every_sample_records_its_policy_and_stale_groups_are_dropped_and_redone(
        tmp_path: Path) -> None:
    # Iteration 3's shard, rolled out ahead on version 2 (one step off policy).
    early = RankCheckpointWriter(tmp_path, 1, 2, iteration=3, policy_version=2)
    for i in range(4):
        early.add_group(make_group(f"t/{i}"))
    early.finalize()
    manifest = read_manifest(tmp_path)
    assert manifest is not None and manifest.policy_versions == {2: 8}
    chunk = read_verified_chunk(tmp_path / manifest.chunks[0].file, manifest.chunks[0])
    assert {s.policy_version for s in chunk.samples()} == {2}
    # With one step allowed, version 2 is fresh enough for iteration 3: all kept.
    again = RankCheckpointWriter(tmp_path, 1, 2, iteration=3, policy_version=3)
    assert again.load_completed_task_ids(oldest_version=2) == {f"t/{i}" for i in range(4)}
    # Allowed none (version >= 3 only): every group is dropped, counted, generated
    # again on the version now served, and the manifest names only the new ones.
    strict = RankCheckpointWriter(tmp_path, 1, 2, iteration=3, policy_version=3)
    assert strict.load_completed_task_ids(oldest_version=3) == frozenset()
    for i in range(4):
        strict.add_group(make_group(f"t/{i}"))
    redone = strict.finalize()
    assert redone.stale_groups_dropped == 4 and redone.policy_versions == {3: 8}
    assert redone.complete and sorted(redone.task_ids()) == [f"t/{i}" for i in range(4)]
