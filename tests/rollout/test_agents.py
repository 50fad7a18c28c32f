"""Agent plugins: loaded by name, run with a concurrency limit and a timeout, every
failure recorded with its task id (never dropped), groups back in task order."""

from __future__ import annotations

import threading
import time

import pytest

from rollout.agents import EngineEndpoint, EpisodeRunner, load_agent
from rollout.client import CompletionClient
from rollout.episode import Episode, Turn
from rollout.tasks import Task

ENGINE = EngineEndpoint("http://127.0.0.1:9", "k", "policy",
                        CompletionClient("http://127.0.0.1:9", "k", model="policy"))


def task(i: int) -> Task:
    return Task(task_id=f"t/{i}", prompt=f"reverse {i}", ground_truth=str(i)[::-1],
                data_source="builtin", split="train")


def episode(reward: float = 1.0) -> Episode:
    return Episode((Turn((1, 2), (5, 6), (-0.5, -0.25), "65"),), reward)


class Agents:
    """One agent whose behaviour depends on the task; counts what it runs."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active = self.most = 0
        self.ran: list[str] = []

    def run(self, t: Task, engine: EngineEndpoint) -> Episode:
        with self.lock:
            self.active += 1
            self.most = max(self.most, self.active)
            self.ran.append(t.task_id)
        try:
            kind = int(t.task_id.split("/")[1]) % 5
            if kind == 1:
                raise ValueError("the sandbox broke")
            if kind == 2:
                time.sleep(3.0)  # past the timeout: abandoned
            if kind == 3:
                return "not an episode"  # type: ignore[return-value]
            if kind == 4:
                # Turn 2's prompt does not continue turn 1's context.
                return Episode((Turn((1, 2), (5,), (-1.0,)), Turn((1, 9, 9), (6,), (-1.0,))),
                               1.0)
            time.sleep(0.05 * (5 - int(t.task_id.split("/")[1]) % 3))
            return episode(0.5)
        finally:
            with self.lock:
                self.active -= 1


def test_failures_are_recorded_with_the_task_id_and_groups_come_back_in_order() -> None:
    agents = Agents()
    runner = EpisodeRunner(agents, ENGINE, concurrency=3, timeout_s=1.0)
    started = time.monotonic()
    groups = list(runner.iter_groups([task(i) for i in range(6)], group_size=2))
    assert time.monotonic() - started < 2.9, "the hung episodes were waited for"
    assert [t.task_id for t, _ in groups] == [f"t/{i}" for i in range(6)]
    by_task = {t.task_id: samples for t, samples in groups}
    assert all(len(s) == 2 and [x.sample_index for x in s] == [0, 1] for s in by_task.values())
    ok = by_task["t/0"][0]
    assert not ok.failed and ok.reward == 0.5 and list(ok.response_token_ids) == [5, 6]
    errors = {tid: s[0].error for tid, s in by_task.items() if s[0].failed}
    assert set(errors) == {"t/1", "t/2", "t/3", "t/4"}
    assert errors["t/1"].startswith("task t/1: the agent raised ValueError: the sandbox broke")
    assert "Traceback" in errors["t/1"] and "raise ValueError" in errors["t/1"]
    assert "ran past rollout.episode_timeout_s=1 s" in errors["t/2"]
    assert "returned str, not an Episode" in errors["t/3"]
    assert "turn 2's prompt does not continue turn 1's context" in errors["t/4"]
    assert agents.most <= 3


def test_agents_load_by_name_as_a_class_or_a_function() -> None:
    assert isinstance(load_agent("tests.rollout.test_agents:Agents"), Agents)
    fn = load_agent("tests.rollout.test_agents:episode_agent")
    assert fn.run(task(0), ENGINE).reward == 1.0
    for spec, rule in [("nocolon", "must look like"), ("no.such.module:X", "cannot be loaded"),
                       ("tests.rollout.test_agents:ENGINE", "neither a class")]:
        with pytest.raises(ValueError, match=rule):
            load_agent(spec)


def episode_agent(t: Task, engine: EngineEndpoint) -> Episode:
    return episode()


def test_episode_threads_count_their_reward_calls_in_the_rollouts_tally() -> None:
    """Each episode runs in a copy of the caller's context: the reward calls an agent
    makes in its own thread land in the tally of the rollout that started it."""
    from rollout.reward_tally import RewardTally, count_call, tallying

    class Scoring:
        def run(self, t: Task, engine: EngineEndpoint) -> Episode:
            count_call(timed_out=t.task_id == "t/2")
            return episode()

    runner = EpisodeRunner(Scoring(), ENGINE, concurrency=3, timeout_s=30.0)
    with tallying(RewardTally()) as tally:
        groups = list(runner.iter_groups([task(i) for i in range(4)], group_size=2))
    assert len(groups) == 4
    assert (tally.calls, tally.timeouts) == (8, 2)
    list(runner.iter_groups([task(9)], group_size=2))  # outside: counted nowhere
    assert (tally.calls, tally.timeouts) == (8, 2)
