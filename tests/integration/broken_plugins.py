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
