"""One rank's rollout of its shard: generate, reward, checkpoint every K groups.

A restarted rank reads its manifest, verifies every chunk's checksum and
generates only the groups that are not safely saved, so a kill costs at most
K groups.  A group whose requests still fail after the client's retries is
recorded as failed samples (never dropped); more failed groups than
`rollout.max_failed_fraction` fail the phase.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from coordinator.actions import StepContext
from coordinator.errors import ActionError
from rl.config import RlSections
from rl.engines import EngineHost
from rollout.client import GroupResult
from rollout.rewards import default_reward_for, get_reward
from rollout.tasks import Task
from rollout.trajectory import FinishReason, RankCheckpointWriter, TrajectorySample

log = logging.getLogger(__name__)


class PromptRenderer:
    """Plain prompts as they are; chat messages through the model's chat template."""

    def __init__(self) -> None:
        self._tokenizers: dict[Path, Any] = {}

    def render(self, task: Task, model_dir: Path) -> str:
        messages = task.messages()
        if messages is None:
            assert isinstance(task.prompt, str)
            return task.prompt
        if model_dir not in self._tokenizers:
            from transformers import AutoTokenizer

            self._tokenizers[model_dir] = AutoTokenizer.from_pretrained(str(model_dir))
        text = self._tokenizers[model_dir].apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True)
        return str(text)


RENDERER = PromptRenderer()


def _samples(task: Task, group: GroupResult, group_size: int,
             reward: Callable[[str, str], float]) -> list[TrajectorySample]:
    if not group.ok:
        error = group.error or "no samples returned"
        return [TrajectorySample(
            task_id=task.task_id, sample_index=i, prompt_token_ids=(), response_token_ids=(),
            response_logprobs=(), response_text="", reward=0.0,
            finish_reason=FinishReason.ERROR, failed=True, error=error,
        ) for i in range(group_size)]
    out = []
    for i, sample in enumerate(group.samples):
        out.append(TrajectorySample(
            task_id=task.task_id, sample_index=i,
            prompt_token_ids=list(sample.prompt_token_ids),
            response_token_ids=list(sample.token_ids),
            response_logprobs=list(sample.logprobs), response_text=sample.text,
            reward=float(reward(sample.text, task.ground_truth)),
            finish_reason=sample.finish_reason if sample.finish_reason in ("stop", "length")
            else FinishReason.STOP,
        ))
    return out


def roll_out_shard(
    ctx: StepContext, s: RlSections, *, split: str, tasks: Sequence[Task], out_dir: Path,
    group_size: int, engines: EngineHost, policy: Path, seed_of: Callable[[str], int],
) -> Mapping[str, Any]:
    k = s.rollout.checkpoint_every_groups
    writer = RankCheckpointWriter(out_dir, ctx.rank, k, iteration=ctx.iteration)
    done = writer.load_completed_task_ids()
    todo = [t for t in tasks if t.task_id not in done]
    temperature = s.rollout.temperature if split == "train" else s.rollout.eval_temperature
    rewards: dict[str, Callable[[str, str], float]] = {}
    failed = 0
    first_error = ""
    started = time.monotonic()
    last_report = started
    generated = 0
    if done:
        log.info("rank %d %s rollout: %d of %d tasks already saved, %d to go", ctx.rank, split,
                 len(done & {t.task_id for t in tasks}), len(tasks), len(todo))
    if todo:
        engines.ensure(ctx, policy)
        client = engines.client()
        local = engines.local_copy(ctx, policy)
        for start in range(0, len(todo), k):
            ctx.check_cancel()
            engines.check_alive()
            batch = todo[start:start + k]
            prompts = [RENDERER.render(t, local) for t in batch]
            results = client.generate_groups(
                prompts, n=group_size, max_tokens=s.rollout.max_tokens,
                temperature=temperature, top_p=s.rollout.top_p,
                seed=seed_of(batch[0].task_id))
            for task, group in zip(batch, results, strict=True):
                name = s.data.reward or default_reward_for(task.data_source)
                reward = rewards.setdefault(name, get_reward(name))
                if not group.ok:
                    failed += 1
                    first_error = first_error or f"{task.task_id}: {group.error}"
                writer.add_group(_samples(task, group, group_size, reward))
            generated += len(batch) * group_size
            now = time.monotonic()
            if now - last_report >= s.rollout.progress_interval_s or start + k >= len(todo):
                log.info("rank %d %s rollout: %d/%d tasks, %.1f samples/s", ctx.rank, split,
                         len(tasks) - len(todo) + min(start + k, len(todo)), len(tasks),
                         generated / max(now - started, 1e-9))
                last_report = now
    manifest = writer.finalize()
    if tasks and failed > s.rollout.max_failed_fraction * len(tasks):
        raise ActionError(
            f"{failed} of {len(tasks)} {split} groups failed on rank {ctx.rank} (limit "
            f"rollout.max_failed_fraction={s.rollout.max_failed_fraction}); first: {first_error}")
    elapsed = time.monotonic() - started
    return {"tasks": len(tasks), "samples": manifest.num_samples, "failed_groups": failed,
            "samples_per_second": generated / elapsed if generated and elapsed > 0 else None}
