"""Plugins that always fail, for the end-to-end tests of broken settings: an agent
(rollout.agent) and a reward (installed through the coordinator.rewards entry point
by tests/support/plugins.py)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from rollout.agents import EngineEndpoint
from rollout.episode import Episode
from rollout.tasks import Task


class RaisingAgent:
    def run(self, task: Task, engine: EngineEndpoint) -> Episode:
        raise RuntimeError(f"this agent always fails (task {task.task_id})")


def raising_reward(response: str, ground_truth: str) -> float:
    raise KeyError("this reward always fails")


class FlakyAgent:
    """Every episode fails (a flaky tool) until the run has recorded a recovery, then
    every one plays it straight: a transient fault that a rerun of the phase must
    redo, after which the run completes.  The run's recoveries.json is named by
    FLAKY_UNTIL; keying the fault on it, not on which tasks this process has seen,
    keeps it the same whichever tasks a rank reached before the phase was stopped."""

    def run(self, task: Task, engine: EngineEndpoint) -> Episode:
        if not Path(os.environ["FLAKY_UNTIL"]).exists():
            raise ConnectionError(f"a flaky tool timed out (task {task.task_id})")
        conv = engine.conversation([{"role": "user", "content": str(task.prompt)}])
        turn = conv.generate(max_tokens=4)
        return Episode(tuple(conv.turns), float(turn.text.strip() == task.ground_truth))


class NeverReturningAgent:
    """Every episode blocks for good (a tool that hangs): each ends only by
    rollout.episode_timeout_s.  Writes a line per episode started to the file
    NEVER_RETURNING_AGENT_LOG names, so a test can count what the rollout started."""

    def run(self, task: Task, engine: EngineEndpoint) -> Episode:
        with open(os.environ["NEVER_RETURNING_AGENT_LOG"], "a") as log:
            log.write(f"{task.task_id}\n")
        threading.Event().wait()  # never set: the episode thread is abandoned
        raise AssertionError("unreachable")
