"""Phase 0's checks of the reward, before any engine starts.

    every node, once per daemon   check_reward_here: reward.path is node-local
        (each node names the code it runs), so each node checks its own file:
        it exists, loads in its worker process and defines reward.function with
        a signature verl's call binds to (rollout/reward_file.py).  Its arrival
        carries the reward it will score with (`reward`), or the problem
        (`reward_problem`); the master raises its own problem at once.
    master, phase 0's decision     same_reward: a problem on any rank, or ranks
        that would score with different rewards (a worker started without the
        file, another file), stop every node with exit 2 naming the ranks.
    master, with the tasks         check_truths: a registered reward (data.reward
        or a data source's default) compares text, so a task whose ground truth
        is a list, an object or a boolean needs a reward file; refused naming the task.

A reward file's problem is the node's own config to fix: node-local keys are
not in run.json, so the same run restarts with the fixed file, without
--new-run.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final

from coordinator.errors import UsageError
from coordinator.records.records import Arrival
from rl.config import RlSections
from rl.loop import Loop
from rollout.errors import RewardFileError
from rollout.tasks import Task

AGENT: Final = "agent"  # the arrival's rollout.agent, or BUILTIN_AGENT
BUILTIN_AGENT: Final = "builtin"  # the agent reported without rollout.agent (sampling)
REWARD: Final = "reward"  # the arrival's description of the reward the rank scores with
PROBLEM: Final = "reward_problem"  # ... or why it cannot score
_SHOWN: Final = 400  # characters of a rank's text quoted (it comes from the run directory)


def check_reward_here(loop: Loop, *, master: bool) -> dict[str, str]:
    """Phase 0 on every node: this node's reward, checked once per daemon, as its
    arrival's payload.  The master's own problem is raised (UsageError)."""
    if loop.reward_checked is None:
        loop.reward_checked = _check(loop)
    if master and PROBLEM in loop.reward_checked:
        raise UsageError(f"{loop.reward_checked[PROBLEM]}; fix it and start every node again")
    return dict(loop.reward_checked)


def _check(loop: Loop) -> dict[str, str]:
    return {AGENT: loop.s.rollout.agent or BUILTIN_AGENT, **_reward(loop)}


def _reward(loop: Loop) -> dict[str, str]:
    s = loop.s
    if s.rollout.agent:
        return {REWARD: "the agent's own"}
    file = s.reward.file()
    if file is None:
        return {REWARD: f"data.reward={s.data.reward!r}" if s.data.reward
                else "each data source's default"}
    try:
        return {REWARD: f"reward.path's {file.check()}"}
    except RewardFileError as exc:
        return {PROBLEM: f"rank {loop.rank}: {exc}"}


def check_reward_file(s: RlSections) -> str:
    """reward.path checked here, in its worker process (rl/preflight.py check_setup:
    a setup tried without a run); UsageError naming the problem."""
    file = s.reward.file()
    if file is None:
        return ""
    try:
        return file.check()
    except RewardFileError as exc:
        raise UsageError(str(exc)) from None


def same_reward(arrivals: Mapping[int, Arrival]) -> None:
    """Phase 0's decision (master): every rank can score, and with the same reward;
    UsageError naming the ranks otherwise (exit 2 on every node)."""
    problems = [str(a.payload[PROBLEM])[:_SHOWN] for _, a in sorted(arrivals.items())
                if PROBLEM in a.payload]
    if problems:
        raise UsageError("the reward cannot be used on every node: " + "; ".join(problems)
                         + "; fix it and start every node again")
    same_agents({rank: a.payload[AGENT] for rank, a in arrivals.items()
                 if isinstance(a.payload.get(AGENT), str)})
    used: dict[str, list[int]] = {}
    for rank, arrival in sorted(arrivals.items()):
        reward = arrival.payload.get(REWARD)
        if isinstance(reward, str):  # none: a rank that skipped phase 0, done in its journal
            used.setdefault(reward[:_SHOWN], []).append(rank)
    if len(used) > 1:
        raise UsageError(
            "the ranks would score with different rewards ("
            + "; ".join(f"ranks {', '.join(map(str, r))}: {w}" for w, r in used.items())
            + "): reward.path and reward.function are node-local, give every node the same "
            "file (--set reward.path=FILE, or in its --config)")


def same_agents(used: Mapping[int, str]) -> None:
    """Every rank runs the same agent (rollout.agent is node-local: a node started
    without it would silently sample instead); UsageError naming the ranks."""
    by_agent: dict[str, list[int]] = {}
    for rank, agent in sorted(used.items()):
        by_agent.setdefault(agent[:_SHOWN], []).append(rank)
    if len(by_agent) > 1:
        raise UsageError(
            "the ranks would roll out with different agents ("
            + "; ".join(f"ranks {', '.join(map(str, r))}: {a}" for a, r in by_agent.items())
            + "): rollout.agent is node-local, give every node the same --set rollout.agent=...")


def check_truths(s: RlSections, tasks: Iterable[Task]) -> None:
    """With a registered reward (no agent, no reward file): every task's ground truth
    is text or a number, which that reward compares (UsageError naming the task)."""
    if s.rollout.agent or s.reward.path:
        return
    for task in tasks:
        if isinstance(task.stored_truth, list | dict | bool):
            reward = f"data.reward={s.data.reward!r}" if s.data.reward else \
                "the default reward of its data source"
            raise UsageError(
                f"task {task.task_id} of {s.data.source} has a {type(task.stored_truth).__name__} "
                f"as its ground truth, but {reward} compares text: give reward.path a "
                "compute_score(data_source, solution_str, ground_truth, extra_info) that reads "
                "it, or store the answer as a string")
