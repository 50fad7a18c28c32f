"""Phases 1-3: each rank rolls out its shard of the train split.

    1   all   roll out this rank's train shard, checkpointing every K groups
    2   all   make sure every assigned task is saved (redo groups a restart lost)
    3   all   report the digest of the rank manifest the master will aggregate

`roll_out_shard` serves the train split here and the eval split at phase 6
(rl/evaluation.py): a restarted rank reads its manifest, verifies every
chunk's checksum and generates only the groups that are not safely saved, so
a kill costs at most K groups.  A group whose requests still fail after the
client's retries is recorded as failed samples (never dropped); more failed
groups than `rollout.max_failed_fraction` fail the phase.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from coordinator.actions import StepContext
from coordinator.errors import ActionError
from coordinator.store import read_document
from rl import layout
from rl.config import requests_in_flight
from rl.contracts import PolicyChoice
from rl.layout import Split
from rl.loop import Loop
from rl.plan import shard_plan
from rollout.agents import EpisodeRunner, load_agent
from rollout.chunk_format import FinishReason, TrajectorySample
from rollout.client import GroupResult
from rollout.episode import failed_sample
from rollout.rewards import default_reward_for, get_reward
from rollout.tasks import Task
from rollout.trajectory import RankCheckpointWriter
from rollout.wire import Prompt

log = logging.getLogger(__name__)


def _samples(task: Task, group: GroupResult, group_size: int,
             reward: Callable[[str, str], float]) -> list[TrajectorySample]:
    if not group.ok:
        error = group.error or "no samples returned"
        return [failed_sample(task.task_id, i, error) for i in range(group_size)]
    out = []
    for i, sample in enumerate(group.samples):
        out.append(TrajectorySample(
            task_id=task.task_id, sample_index=i,
            prompt_token_ids=list(sample.prompt_token_ids),
            response_token_ids=list(sample.token_ids),
            response_logprobs=list(sample.logprobs), response_text=sample.text,
            reward=float(reward(sample.text, task.ground_truth)),
            finish_reason=FinishReason(sample.finish_reason)
            if sample.finish_reason in ("stop", "length") else FinishReason.STOP,
        ))
    return out


def roll_out_train(loop: Loop, ctx: StepContext) -> Mapping[str, Any]:
    """Phase 1: this rank's train shard."""
    return roll_out_shard(loop, ctx, Split.TRAIN) if loop.trains else {}


def finish_train_rollout(loop: Loop, ctx: StepContext) -> Mapping[str, Any]:
    """Phase 2: the same call; after a restart it redoes only the groups not saved."""
    return roll_out_shard(loop, ctx, Split.TRAIN) if loop.trains else {}


def report_trajectories(loop: Loop, ctx: StepContext) -> Mapping[str, Any]:
    """Phase 3: the digest of this rank's manifest, as the master will read it."""
    if not loop.trains:
        return {}
    manifest = layout.rank_dir(loop.run_dir, ctx.iteration, Split.TRAIN, loop.rank) \
        / "manifest.json"
    digest = read_document(manifest, lambda raw, _path: hashlib.sha256(raw).hexdigest())
    if digest is None and shard_plan(loop, ctx.iteration, Split.TRAIN).tasks_for(loop.rank):
        raise ActionError(f"rank {loop.rank} has tasks but no manifest at {manifest}")
    return {"manifest_sha256": digest}


def group_seed(run_seed: int, iteration: int, split: Split, task_id: str) -> int:
    """A sampling seed per group: a redone group samples the same way."""
    digest = hashlib.sha256(f"{run_seed}/{iteration}/{split.value}/{task_id}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def roll_out_shard(loop: Loop, ctx: StepContext, split: Split) -> Mapping[str, Any]:
    """Generate, reward and checkpoint this rank's shard of `split` in this iteration."""
    s = loop.s
    tasks = _assigned_tasks(loop, ctx, split)
    group_size = s.rollout.group_size if split is Split.TRAIN else s.rollout.eval_group_size
    writer = RankCheckpointWriter(layout.rank_dir(loop.run_dir, ctx.iteration, split, loop.rank),
                                  ctx.rank, s.rollout.checkpoint_every_groups,
                                  iteration=ctx.iteration, every_s=s.rollout.checkpoint_every_s)
    done = writer.load_completed_task_ids()
    todo = [t for t in tasks if t.task_id not in done]
    if done:
        log.info("rank %d %s rollout: %d of %d tasks already saved, %d to go", ctx.rank,
                 split.value, len(done & {t.task_id for t in tasks}), len(tasks), len(todo))
    started = time.monotonic()
    failed: list[str] = []
    generated = _generate(loop, ctx, split, tasks, todo, writer, group_size, failed) if todo \
        else 0
    manifest = writer.finalize()
    # Built-in sampling fails whole groups (one request each); an agent, episodes.
    units, what = (len(tasks) * group_size, "episodes") if s.rollout.agent \
        else (len(tasks), "groups")
    if tasks and len(failed) > s.rollout.max_failed_fraction * units:
        raise ActionError(
            f"{len(failed)} of {units} {split.value} {what} failed on rank {ctx.rank} "
            f"(limit rollout.max_failed_fraction={s.rollout.max_failed_fraction}); first: "
            f"{failed[0]}")
    elapsed = time.monotonic() - started
    return {"tasks": len(tasks), "samples": manifest.num_samples, "failed_groups": len(failed),
            "samples_per_second": generated / elapsed if generated and elapsed > 0 else None}


def _assigned_tasks(loop: Loop, ctx: StepContext, split: Split) -> list[Task]:
    assigned = list(shard_plan(loop, ctx.iteration, split).tasks_for(loop.rank))
    index = loop.tasks(split)
    unknown = [t for t in assigned if t not in index]
    if unknown:
        raise ActionError(f"the shard plan names tasks unknown to {loop.s.data.path}: "
                          f"{unknown[:5]} ({len(unknown)} in all)")
    return [index[t] for t in assigned]


def _generate(loop: Loop, ctx: StepContext, split: Split, tasks: Sequence[Task],
              todo: Sequence[Task], writer: RankCheckpointWriter, group_size: int,
              failed: list[str]) -> int:
    """Generate the groups still to do with the engine's batch kept full; each group is
    checkpointed in task order as soon as it and those before it are done (the
    writer publishes every K groups or S seconds).  Returns the samples generated;
    failed groups are recorded, and listed in `failed`."""
    s = loop.s
    temperature = s.rollout.temperature if split is Split.TRAIN else s.rollout.eval_temperature
    policy = loop.model(ctx, PolicyChoice.read(ctx).policy, where_phase=0)
    loop.engines.ensure(ctx, policy)
    if s.rollout.agent:
        return _run_agent(loop, ctx, split, tasks, todo, writer, group_size, failed)
    client = loop.engines.client()
    rewards: dict[str, Callable[[str, str], float]] = {}
    started = last_report = time.monotonic()
    seeds = [group_seed(loop.config.run.seed, ctx.iteration, split, t.task_id) for t in todo]
    # Chat tasks go to the chat endpoint: the engine applies the model's chat
    # template and returns the exact prompt ids; nothing is re-tokenised here.
    prompts: list[Prompt] = [t.messages() or str(t.prompt) for t in todo]
    results = client.iter_groups(prompts, n=group_size,
                                 max_tokens=s.rollout.max_tokens, temperature=temperature,
                                 top_p=s.rollout.top_p, seeds=seeds)
    generated = 0
    try:
        for done, (task, group) in enumerate(zip(todo, results, strict=True), start=1):
            ctx.check_cancel()
            name = s.data.reward or default_reward_for(task.data_source)
            reward = rewards.setdefault(name, get_reward(name))
            if not group.ok:
                failed.append(f"{task.task_id}: {group.error}")
            writer.add_group(_samples(task, group, group_size, reward))
            generated += group_size
            now = time.monotonic()
            if now - last_report >= s.rollout.progress_interval_s or done == len(todo):
                log.info("rank %d %s rollout: %d/%d tasks, %.1f samples/s", ctx.rank,
                         split.value, len(tasks) - len(todo) + done, len(tasks),
                         generated / max(now - started, 1e-9))
                last_report = now
    finally:
        results.close()  # a cancelled rollout stops the requests still in flight
    return generated


def _run_agent(loop: Loop, ctx: StepContext, split: Split, tasks: Sequence[Task],
               todo: Sequence[Task], writer: RankCheckpointWriter, group_size: int,
               failed: list[str]) -> int:
    """The agent plugin's episodes instead of built-in sampling: the same checkpoints
    (in task order, every K groups or S seconds), resume and failure accounting."""
    s = loop.s
    try:
        agent = load_agent(s.rollout.agent)
    except ValueError as exc:
        raise ActionError(str(exc)) from exc
    runner = EpisodeRunner(agent, loop.engines.endpoint(),
                           concurrency=requests_in_flight(s.rollout, s.engine),
                           timeout_s=s.rollout.episode_timeout_s)
    generated = 0
    last_report = time.monotonic()
    for done, (_task, samples) in enumerate(runner.iter_groups(todo, group_size,
                                                              ctx.check_cancel), start=1):
        bad = [x for x in samples if x.failed]
        failed += [f"{x.error.splitlines()[0]}" for x in bad]  # each names its task
        writer.add_group(samples)
        generated += len(samples)
        now = time.monotonic()
        if now - last_report >= s.rollout.progress_interval_s or done == len(todo):
            log.info("rank %d %s rollout (agent %s): %d/%d tasks, %d failed episodes",
                     ctx.rank, split.value, s.rollout.agent, len(tasks) - len(todo) + done,
                     len(tasks), len(bad))
            last_report = now
    return generated
