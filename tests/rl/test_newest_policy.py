"""Phase 0 never serves an older policy than the newest published one in silence
(issue 32, finding 5): real checkpoint manifests on disk, faults injected at the read."""

from __future__ import annotations

import errno
import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from coordinator.storage import fsio
from rl import layout
from rl.newest_policy import Look, Observation, PolicyUnavailable, look, newest_published
from trainer.checkpoint import MANIFEST_NAME, FileEntry, Manifest

# The inner reads give up after 1 s here (tests/conftest.py), as after
# coordination.read_retry_s in a daemon.
pytestmark = pytest.mark.usefixtures("quick_read_retry")


def publish(run_dir: Path, k: int) -> Path:
    """iteration k trained: its checkpoint's manifest, and its metrics written after it."""
    directory = layout.checkpoint(run_dir, k)
    directory.mkdir(parents=True)
    manifest = Manifest(iteration=k, files={"model.safetensors": FileEntry(sha256="0" * 64,
                                                                          size=1)})
    (directory / MANIFEST_NAME).write_bytes(manifest.to_bytes())
    metrics = layout.metrics(run_dir, k, "train")
    metrics.parent.mkdir(parents=True)
    metrics.write_text(json.dumps({"iteration": k}))
    return directory / MANIFEST_NAME


def choose(run_dir: Path, iteration: int, *, budget_s: float) -> int | None:
    """Phase 0's decision as rl/plan.py choose_policy makes it."""
    return newest_published(iteration, lambda k: look(run_dir, k, budget_s=budget_s),
                            lambda k: layout.checkpoint(run_dir, k))


def failing_reads(monkeypatch: pytest.MonkeyPatch, target: Path,
                  failing: Callable[[], bool]) -> list[float]:
    """fsio.read_bytes of `target` raises EIO while `failing()`; returns when it was tried."""
    real = fsio.read_bytes
    tried: list[float] = []

    def read_bytes(path: Path, **kwargs: object) -> bytes:
        if Path(path) == target:
            tried.append(time.monotonic())
            if failing():
                raise OSError(errno.EIO, "Input/output error", str(path))
        return real(path, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(fsio, "read_bytes", read_bytes)
    return tried


def test_the_newest_published_checkpoint_is_chosen_and_an_untrained_iteration_skipped(
    tmp_path: Path,
) -> None:
    assert choose(tmp_path, 0, budget_s=5) is None
    publish(tmp_path, 0)
    publish(tmp_path, 2)
    assert choose(tmp_path, 3, budget_s=5) == 2
    assert choose(tmp_path, 2, budget_s=5) == 0  # iteration 1 trained nothing: skipped
    assert look(tmp_path, 1, budget_s=5) == Observation(Look.ABSENT)


def test_a_manifest_failing_longer_than_one_read_retry_is_read_again_within_the_phase(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    publish(tmp_path, 0)
    newest = publish(tmp_path, 1)
    # EIO for 1.5 s: longer than a record read retries (1 s here), so the old
    # choice took iteration 0's checkpoint; well within the phase's budget.
    until = time.monotonic() + 1.5
    tried = failing_reads(monkeypatch, newest, lambda: time.monotonic() < until)
    assert choose(tmp_path, 2, budget_s=60) == 1
    assert tried[-1] >= until and len(tried) > 2


def test_a_manifest_unreadable_for_the_whole_budget_fails_the_phase_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    publish(tmp_path, 0)
    newest = publish(tmp_path, 1)
    tried = failing_reads(monkeypatch, newest, lambda: True)
    started = time.monotonic()
    with pytest.raises(PolicyUnavailable) as caught:
        choose(tmp_path, 2, budget_s=1.5)
    # The budget, plus one inner read of at most 1 s and a backoff, on a busy machine.
    assert 1.5 <= time.monotonic() - started < 10
    assert caught.value.checkpoint == newest.parent and caught.value.iteration == 2
    assert len(tried) >= 2  # read again before giving up
    message = str(caught.value)
    assert f"the newest checkpoint {newest.parent} is unreadable" in message
    assert "Input/output error" in message and "an older policy is not served" in message


def test_a_malformed_manifest_fails_the_phase_instead_of_serving_an_older_policy(
    tmp_path: Path,
) -> None:
    publish(tmp_path, 0)
    publish(tmp_path, 1).write_text('{"schema": "coordinator/checkpoint-manifest", "vers')
    with pytest.raises(PolicyUnavailable, match=r"iter-000001 is unreadable \("
                                                r"MalformedRecordError: .*not valid JSON"):
        choose(tmp_path, 2, budget_s=5)


def test_a_checkpoint_whose_iteration_trained_but_is_gone_fails_naming_both_files(
    tmp_path: Path,
) -> None:
    publish(tmp_path, 0)
    publish(tmp_path, 1).unlink()  # e.g. pruned by a recovery that rewound too far
    with pytest.raises(PolicyUnavailable, match=r"iter-000001 is lost \(.*manifest.json is "
                                                r"missing, but iteration 1 trained"):
        choose(tmp_path, 2, budget_s=5)
