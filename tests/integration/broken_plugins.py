"""Plugins that always fail, for the end-to-end tests of broken settings: an agent
(rollout.agent) and a reward (installed through the coordinator.rewards entry point
by tests/support/plugins.py)."""

from __future__ import annotations

from rollout.agents import EngineEndpoint
from rollout.episode import Episode
from rollout.tasks import Task


class RaisingAgent:
    def run(self, task: Task, engine: EngineEndpoint) -> Episode:
        raise RuntimeError(f"this agent always fails (task {task.task_id})")


def raising_reward(response: str, ground_truth: str) -> float:
    raise KeyError("this reward always fails")


_SEEN: set[str] = set()  # tasks this daemon process has run an episode of


class FlakyAgent:
    """The first episode of each task this process runs fails (a flaky tool), every
    later one plays it straight: a transient fault that a rerun of the phase must
    redo, after which the run completes."""

    def run(self, task: Task, engine: EngineEndpoint) -> Episode:
        if task.task_id not in _SEEN:
            _SEEN.add(task.task_id)
            raise ConnectionError(f"a flaky tool timed out (task {task.task_id})")
        conv = engine.conversation([{"role": "user", "content": str(task.prompt)}])
        turn = conv.generate(max_tokens=4)
        return Episode(tuple(conv.turns), float(turn.text.strip() == task.ground_truth))
