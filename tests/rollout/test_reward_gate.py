"""The tests' reward gate (tests/support/reward_gate.py), through the real reward-file
worker: a gated node's call waits until the test lets it through, a held call
stays held until go_on, and an ungated node scores at once with the task's
default reward."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout.reward_file import FileReward, close_workers
from rollout.rewards import Score
from rollout.tasks import REVERSE_SOURCE, Task
from tests.support import reward_gate
from tests.support.reward_gate import RewardGate

WAIT_S = 30.0  # a worker's start and a few 10 ms polls, on a loaded 2-core machine


@pytest.fixture(autouse=True)
def no_worker_left() -> Iterator[None]:
    yield
    close_workers()


def reverse_task() -> Task:
    return Task(task_id="reverse/train/0", prompt="abc", ground_truth="cba",
                data_source=REVERSE_SOURCE, split="train")


def score_in_thread(out: list[Score]) -> threading.Thread:
    reward = FileReward(path=reward_gate.__file__, timeout_s=WAIT_S)
    thread = threading.Thread(target=lambda: out.append(reward.score(reverse_task(), "cba")),
                              daemon=True)
    thread.start()
    return thread


def test_an_ungated_node_scores_at_once_with_the_default_reward(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(reward_gate.ENV, raising=False)
    reward = FileReward(path=reward_gate.__file__, timeout_s=WAIT_S)
    assert reward.score(reverse_task(), "cba").value == 1.0
    assert reward.score(reverse_task(), "abc").value == 0.0


def test_a_held_call_waits_until_go_on_and_calls_pass_otherwise(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with RewardGate(tmp_path / "gate") as gate:
        monkeypatch.setenv(reward_gate.ENV, gate.env[reward_gate.ENV])
        # No condition: let through.
        passed: list[Score] = []
        score_in_thread(passed).join(WAIT_S)
        assert [s.value for s in passed] == [1.0]

        gate.hold_when(lambda: True)
        held: list[Score] = []
        thread = score_in_thread(held)
        deadline = time.monotonic() + WAIT_S
        while not gate.holding() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gate.holding(), "the call never reached the gate"
        thread.join(1.0)  # held: it cannot finish while the gate keeps it
        assert thread.is_alive() and held == []
        gate.go_on()
        thread.join(WAIT_S)
        assert [s.value for s in held] == [1.0] and not gate.holding()
