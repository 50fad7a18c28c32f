"""Agent plugins: the user's code that turns a task into an episode, run with guarantees.

    rollout.agent = "mypkg.agents:CalculatorAgent"   # a class (made with no
                                                     # arguments) or a function

An agent is anything with `run(task, engine) -> Episode` (or a function of
the same two arguments).  `engine` is the node's inference engine:
`engine.conversation(messages)` for token-exact multi-turn chats
(rollout/conversation.py), `engine.openai()` for the official OpenAI client,
`base_url`, `api_key` and `model` for anything else.  The episode carries
the model's turns (exact token ids and log-probabilities) and the reward;
rollout/episode.py turns it into one training sample.

EpisodeRunner runs the group_size episodes of each task, at most
`concurrency` at once (one thread each: agents are ordinary blocking code),
and hands the groups back in task order as soon as each is complete, so the
caller checkpoints them as built-in rollout does.  An episode that raises,
returns something that is not a trainable Episode, or runs past
`timeout_s` becomes a failed sample carrying the task id and the error (the
traceback's tail for an exception): never dropped, and counted against
rollout.max_failed_fraction by the caller.  A timed-out episode's thread
cannot be killed: it is abandoned (a daemon thread) and stops counting
against the concurrency limit.  Each episode's thread runs in a copy of the
caller's context (contextvars), so what the rollout counts there, such as its
reward calls (rollout/reward_tally.py), counts the episode's too.
"""

from __future__ import annotations

import contextvars
import importlib
import inspect
import logging
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from rollout.chunk_format import TrajectorySample
from rollout.client import CompletionClient
from rollout.conversation import Conversation
from rollout.episode import Episode, EpisodeError, failed_sample
from rollout.tasks import Task

log = logging.getLogger(__name__)
TRACEBACK_TAIL: Final = 1500


class Agent(Protocol):
    def run(self, task: Task, engine: EngineEndpoint) -> Episode: ...


class GroupAgent(Protocol):
    """An agent that produces a task's whole group itself (built-in sampling does:
    rollout/sampling_agent.py), in task order."""

    def run_groups(self, tasks: Sequence[Task], engine: EngineEndpoint, *, group_size: int,
                   check_cancel: Callable[[], None],
                   ) -> Iterator[tuple[Task, list[TrajectorySample]]]: ...


def run_groups(agent: Agent | GroupAgent, tasks: Sequence[Task], engine: EngineEndpoint, *,
               group_size: int, concurrency: int, timeout_s: float,
               check_cancel: Callable[[], None]) -> Iterator[tuple[Task, list[TrajectorySample]]]:
    """Every task's group of samples, in task order, from either kind of agent."""
    if hasattr(agent, "run_groups"):
        return agent.run_groups(tasks, engine, group_size=group_size,  # type: ignore[union-attr]
                                check_cancel=check_cancel)
    runner = EpisodeRunner(agent, engine, concurrency=concurrency,  # type: ignore[arg-type]
                           timeout_s=timeout_s)
    return runner.iter_groups(tasks, group_size, check_cancel)


@dataclass(frozen=True)
class EngineEndpoint:
    """The node's engine as an agent sees it."""

    base_url: str
    api_key: str
    model: str
    client: CompletionClient = field(repr=False)

    def conversation(self, start: Sequence[Mapping[str, str]] | str) -> Conversation:
        """A token-exact exchange from chat messages, or from a text prompt."""
        return Conversation(self.client, start)

    def openai(self) -> Any:
        """The official OpenAI client for this engine (`pip install openai`)."""
        try:
            import openai
        except ImportError as exc:
            raise RuntimeError("engine.openai() needs the openai package: pip install openai"
                               ) from exc
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=self.api_key)


class _FunctionAgent:
    def __init__(self, fn: Callable[[Task, EngineEndpoint], Episode]) -> None:
        self.fn = fn

    def run(self, task: Task, engine: EngineEndpoint) -> Episode:
        return self.fn(task, engine)


def load_agent(spec: str) -> Agent | GroupAgent:
    """The agent `module:name` names: a class is instantiated without arguments."""
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise ValueError(f"rollout.agent={spec!r} must look like 'package.module:Name'")
    try:
        target = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"rollout.agent={spec!r} cannot be loaded ({type(exc).__name__}: "
                         f"{exc}): install the package on every node or fix the name") from exc
    if inspect.isclass(target):
        target = target()
    if callable(getattr(target, "run", None)) or callable(getattr(target, "run_groups", None)):
        return target  # type: ignore[no-any-return]
    if callable(target):
        return _FunctionAgent(target)
    raise ValueError(f"rollout.agent={spec!r} is neither a class with run(task, engine) nor a "
                     "function of (task, engine)")


@dataclass
class _Job:
    task_index: int
    episode: int
    thread: threading.Thread | None = None
    started: float = 0.0
    sample: TrajectorySample | None = None


class EpisodeRunner:
    """Every task's group of episodes, in task order, with the limits above."""

    def __init__(self, agent: Agent, engine: EngineEndpoint, *, concurrency: int,
                 timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if concurrency < 1 or not timeout_s > 0:
            raise ValueError(f"concurrency={concurrency} must be >= 1 and "
                             f"timeout_s={timeout_s} > 0")
        self.agent, self.engine = agent, engine
        self.concurrency, self.timeout_s, self.clock = concurrency, timeout_s, clock
        self._wake = threading.Condition()

    def iter_groups(self, tasks: Sequence[Task], group_size: int,
                    check_cancel: Callable[[], None] = lambda: None,
                    ) -> Iterator[tuple[Task, list[TrajectorySample]]]:
        jobs = [_Job(t, k) for t in range(len(tasks)) for k in range(group_size)]
        pending = iter(jobs)
        running: list[_Job] = []
        emitted = 0
        while emitted < len(tasks):
            check_cancel()
            for job in running[:]:
                if job.sample is None and self.clock() - job.started > self.timeout_s:
                    job.sample = self._failed(tasks[job.task_index], job.episode,
                                              f"the episode ran past rollout.episode_timeout_s="
                                              f"{self.timeout_s:g} s and was abandoned")
                if job.sample is not None:
                    running.remove(job)
            while len(running) < self.concurrency:
                waiting = next(pending, None)
                if waiting is None:
                    break
                self._start(waiting, tasks[waiting.task_index])
                running.append(waiting)
            while emitted < len(tasks):
                group = jobs[emitted * group_size:(emitted + 1) * group_size]
                if any(j.sample is None for j in group):
                    break
                yield tasks[emitted], [j.sample for j in group if j.sample is not None]
                emitted += 1
            with self._wake:
                self._wake.wait(0.05)

    def _start(self, job: _Job, task: Task) -> None:
        def work() -> None:
            sample = self._episode(task, job.episode)
            with self._wake:
                if job.sample is None:  # not timed out meanwhile
                    job.sample = sample
                self._wake.notify_all()

        job.started = self.clock()
        context = contextvars.copy_context()  # one per thread: a context runs in one at a time
        job.thread = threading.Thread(target=context.run, args=(work,), daemon=True,
                                      name=f"episode {task.task_id}#{job.episode}")
        job.thread.start()

    def _episode(self, task: Task, index: int) -> TrajectorySample:
        try:
            episode = self.agent.run(task, self.engine)
        except Exception as exc:
            tail = "".join(traceback.format_exception(exc))[-TRACEBACK_TAIL:]
            return self._failed(task, index, f"the agent raised {type(exc).__name__}: {exc}\n"
                                             f"{tail}")
        if not isinstance(episode, Episode):
            return self._failed(task, index, f"the agent returned {type(episode).__name__}, "
                                             "not an Episode")
        try:
            return episode.to_sample(task.task_id, index)
        except (EpisodeError, ValueError) as exc:
            return self._failed(task, index, f"the agent's episode cannot be trained on: {exc}")

    def _failed(self, task: Task, index: int, error: str) -> TrajectorySample:
        log.error("task %s episode %d failed: %s", task.task_id, index, error.splitlines()[0])
        return failed_sample(task.task_id, index, f"task {task.task_id}: {error}")
