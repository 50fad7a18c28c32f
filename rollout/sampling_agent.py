"""Built-in rollout as an agent plugin: one sampled answer per episode, a group per request.

Single-turn sampling is the plugin `rollout.agent = ""` stands for.  It
implements the group-level side of the agent interface (`run_groups`, see
rollout/agents.py) rather than one episode at a time, because one request
for a task's n samples keeps the engine's batch full with one connection per
group instead of a thread per episode: the httpx client holds hundreds of
requests in flight (rollout/client.py).

    text prompts      /v1/completions
    chat messages     /v1/chat/completions (the engine applies the template)

Each group samples with its own seed (a redone group samples the same way),
each answer is scored by the run's reward (a reward file's function, a named
reward, or the default of the task's data_source), and a group whose request
still fails after the client's retries comes back as failed samples carrying
the error.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from rollout.agents import EngineEndpoint
from rollout.chunk_format import FinishReason, TrajectorySample
from rollout.client import GroupResult
from rollout.episode import failed_sample
from rollout.reward_file import FileReward
from rollout.rewards import Scorer, default_reward_for, get_reward, text_scorer
from rollout.tasks import Task
from rollout.wire import Prompt


@dataclass(frozen=True, kw_only=True)
class SingleTurnSampler:
    max_tokens: int
    temperature: float
    top_p: float
    reward: str  # a reward's name; "" picks each task's data_source default
    seed_of: Callable[[Task], int]
    reward_file: FileReward | None = None  # reward.path's function: scores every task

    def run_groups(self, tasks: Sequence[Task], engine: EngineEndpoint, *, group_size: int,
                   check_cancel: Callable[[], None]) -> Iterator[tuple[Task, list[TrajectorySample]]]:
        rewards: dict[str, Scorer] = {}
        prompts: list[Prompt] = [t.messages() or str(t.prompt) for t in tasks]
        results = engine.client.iter_groups(
            prompts, n=group_size, max_tokens=self.max_tokens, temperature=self.temperature,
            top_p=self.top_p, seeds=[self.seed_of(t) for t in tasks], check_cancel=check_cancel)
        try:
            for task, group in zip(tasks, results, strict=True):
                check_cancel()
                reward: Scorer
                if self.reward_file is not None:
                    name, reward = self.reward_file.name, self.reward_file.score
                else:
                    name = self.reward or default_reward_for(task.data_source)
                    reward = rewards.setdefault(name, text_scorer(get_reward(name)))
                yield task, samples_of(task, group, group_size, reward, reward_name=name)
        finally:
            results.close()  # a cancelled rollout stops the requests still in flight


def samples_of(task: Task, group: GroupResult, group_size: int, reward: Scorer, *,
               reward_name: str = "reward") -> list[TrajectorySample]:
    """A group's answers as scored samples, or group_size failed ones with its error.
    A reward that raises, or gives no finite number, fails its sample (saved with
    the error, counted against rollout.max_failed_fraction), not the rollout.  The
    numbers it reports beside the score travel with the sample (reward_extra)."""
    if not group.ok:
        error = f"task {task.task_id}: {group.error or 'no samples returned'}"
        return [failed_sample(task.task_id, i, error) for i in range(group_size)]
    out = []
    for i, sample in enumerate(group.samples):
        try:
            scored = reward(task, sample.text)
            score = float(scored.value)
            if not math.isfinite(score):
                raise ValueError(f"it gave {score}, not a finite number")
        except Exception as exc:
            out.append(failed_sample(task.task_id, i, (
                f"task {task.task_id}: the reward {reward_name!r} raised "
                f"{type(exc).__name__}: {exc}")))
            continue
        out.append(TrajectorySample(
            task_id=task.task_id, sample_index=i, prompt_token_ids=list(sample.prompt_token_ids),
            response_token_ids=list(sample.token_ids), response_logprobs=list(sample.logprobs),
            response_text=sample.text, reward=score, reward_extra=dict(scored.extra),
            finish_reason=FinishReason(sample.finish_reason)
            if sample.finish_reason in ("stop", "length") else FinishReason.STOP))
    return out
