"""A test agent that counts the episodes it runs (one line per episode in the file
COUNTING_AGENT_LOG names) and takes COUNTING_AGENT_SLEEP seconds each, so a
kill lands mid-rollout and a rerun shows in the count."""

from __future__ import annotations

import os
import time

from rollout.agents import EngineEndpoint
from rollout.episode import Episode
from rollout.tasks import Task


class CountingAgent:
    def run(self, task: Task, engine: EngineEndpoint) -> Episode:
        with open(os.environ["COUNTING_AGENT_LOG"], "a") as log:
            log.write(f"{task.task_id}\n")
        time.sleep(float(os.environ.get("COUNTING_AGENT_SLEEP", "0")))
        conv = engine.conversation([{"role": "user", "content": str(task.prompt)}])
        turn = conv.generate(max_tokens=4)
        return Episode(tuple(conv.turns), float(turn.text.strip() == task.ground_truth))
