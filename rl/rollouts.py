"""Phases 1-3: each rank rolls out its shard of the train split.

    1   all   roll out this rank's train shard, checkpointing every K groups
    2   all   make sure every assigned task is saved (redo groups a restart lost)
    3   all   report the digest of the rank manifest the master will aggregate

After a shrink (rl/takeover.py) phase 0's release asks for phases 1-3 again:
a member then also rolls out the tasks it took over from a rank that left.

`roll_out_shard` serves the train split here and the eval split at phase 6
(rl/evaluation.py): a restarted rank reads its manifest, verifies every
chunk's checksum and generates only the groups that are not safely saved, so
a kill costs at most K groups.  The groups come from an agent: built-in
single-turn sampling (rollout/sampling_agent.py), or the plugin
`rollout.agent` names (rollout/agents.py, docs/PLUGINS.md).  A failed sample
(a request that still fails after the client's retries, an episode that
raised or timed out) is recorded with its task id, never dropped; more failed
samples than `rollout.max_failed_fraction` fail the phase, before the
rank's manifest is marked complete: a failed sample is never taken as done,
and the phase run again redoes it (rollout/budget.py).  The phase fails as
soon as its failed samples exceed what the budget allows for the whole
shard: an agent that never returns costs the budget's worth of episode
timeouts, not the whole shard's.

The reward calls with a time limit the rollout makes (the math reward), and
those that ran out of it, are counted into the rank's manifest
(rollout/reward_tally.py), for the iteration's metrics.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from coordinator.errors import ActionError
from coordinator.machine.actions import StepContext
from coordinator.records.records import Arrival
from coordinator.storage.store import read_document
from rl import layout
from rl.contracts import PolicyChoice, policy_version
from rl.engines import serve_chosen_policy
from rl.layout import Split
from rl.loop import Loop
from rl.plan import shard_plan
from rl.reward_check import BUILTIN_AGENT, same_agents
from rl.sections import episodes_in_flight
from rollout.agents import Agent, GroupAgent, load_agent, run_groups
from rollout.budget import check_failures, check_failures_so_far
from rollout.errors import BudgetError
from rollout.reward_tally import RewardTally, tallying
from rollout.sampling_agent import SingleTurnSampler
from rollout.tasks import Task
from rollout.trajectory import RankCheckpointWriter

log = logging.getLogger(__name__)


def roll_out_train(loop: Loop, ctx: StepContext) -> Mapping[str, Any]:
    """Phase 1: the engine serves phase 0's policy, checked (rl/engines.py), then this
    rank's train shard (in an asynchronous run, what phase 10 of the previous iteration
    did not already roll out)."""
    if not loop.trains:
        return {}
    return {**serve_chosen_policy(loop, ctx), **roll_out_shard(loop, ctx, Split.TRAIN)}


def roll_out_next(loop: Loop, ctx: StepContext) -> Mapping[str, Any]:
    """Phase 10 on a rollout node of an asynchronous run: the next iteration's shard,
    on the policy this iteration serves, while the training nodes train."""
    return roll_out_shard(loop, ctx, Split.TRAIN, iteration=ctx.iteration + 1)


def same_agent(loop: Loop, ctx: StepContext, arrivals: Mapping[int, Arrival],
               ) -> Mapping[str, Any]:
    """Phase 1's decision: every rank rolled out with the same agent.  rollout.agent
    is node-local (each node names the code it runs), so a node started without
    it would silently sample instead: refused, naming the ranks (exit 2)."""
    same_agents({rank: a.payload["agent"] for rank, a in arrivals.items()
                 if isinstance(a.payload.get("agent"), str)})
    return {}


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


def roll_out_shard(loop: Loop, ctx: StepContext, split: Split, *,
                   iteration: int | None = None) -> Mapping[str, Any]:
    """Generate, reward and checkpoint this rank's shard of `split` in `iteration`
    (this one unless given: phase 10 of an asynchronous run rolls out the next).

    Every sample records the policy version the engine serves.  In an
    asynchronous run, saved groups of a version older than the batch allows
    (run.max_off_policy_steps) are dropped and generated again."""
    s = loop.s
    target = ctx.iteration if iteration is None else iteration
    tasks = _assigned_tasks(loop, target, split)
    group_size = s.rollout.group_size if split is Split.TRAIN else s.rollout.eval_group_size
    version = policy_version(PolicyChoice.read(ctx).policy)
    oldest = loop.placement.oldest_version(target) \
        if loop.layout.off_policy and split is Split.TRAIN else 0
    if tasks and version < oldest:
        raise ActionError(
            f"rank {ctx.rank} serves policy version {version}, but iteration {target}'s batch "
            f"takes versions >= {oldest} only (run.max_off_policy_steps="
            f"{loop.placement.max_off_policy_steps}): the checkpoints in between are missing; "
            f"run `coordinator recover --iteration {ctx.iteration}` and restart every node")
    rewards = RewardTally()
    writer = RankCheckpointWriter(layout.rank_dir(loop.run_dir, target, split, loop.rank),
                                  ctx.rank, s.rollout.checkpoint_every_groups,
                                  iteration=target, every_s=s.rollout.checkpoint_every_s,
                                  policy_version=version, rewards=rewards)
    done = writer.load_completed_task_ids(oldest_version=oldest)
    todo = [t for t in tasks if t.task_id not in done]
    if todo and writer.manifest.complete:
        log.info("rank %d %s rollout: %d more tasks given to this rank after a rank left the "
                 "group", ctx.rank, split.value, len(todo))
        writer.reopen()
    if done:
        log.info("rank %d %s rollout: %d of %d tasks already saved, %d to go", ctx.rank,
                 split.value, len(done & {t.task_id for t in tasks}), len(tasks), len(todo))
    if todo:
        # The engine serves the chosen policy before the clock starts: its start or
        # wake (phase 6 of a run that only evaluates) is not generation time.
        name = PolicyChoice.read(ctx).policy
        loop.engines.ensure(ctx, loop.model(ctx, name, where_phase=0),
                            version=policy_version(name))
        writer.restart_clock()
    started = time.monotonic()
    failed: list[str] = []
    try:
        with tallying(rewards):
            generated = _generate(loop, ctx, split, target, tasks, todo, writer, group_size,
                                  failed) if todo else 0
        writer.flush()
        # The budget first: a manifest left incomplete has its failed groups redone
        # when the phase runs again, while a complete one takes them as final.
        check_failures(writer.manifest.failed_samples, samples=len(tasks) * group_size,
                       fraction=s.rollout.max_failed_fraction, where=split.value,
                       first=failed[0] if failed else "")
    except BudgetError as exc:
        writer.flush()  # the groups done are kept; those with failed samples are redone
        raise ActionError(f"rank {ctx.rank}: {exc}; a rerun of the phase redoes every "
                          "failed sample") from exc
    manifest = writer.finalize()
    elapsed = time.monotonic() - started
    return {"agent": s.rollout.agent or BUILTIN_AGENT, "iteration": target, "tasks": len(tasks),
            "samples": manifest.num_samples, "failed_samples": manifest.failed_samples,
            "policy_version": version, "stale_groups_dropped": manifest.stale_groups_dropped,
            "samples_per_second": generated / elapsed if generated and elapsed > 0 else None}


def _assigned_tasks(loop: Loop, iteration: int, split: Split) -> list[Task]:
    assigned = list(shard_plan(loop, iteration, split).tasks_for(loop.rank))
    index = loop.tasks(split)
    unknown = [t for t in assigned if t not in index]
    if unknown:
        raise ActionError(f"the shard plan names tasks unknown to {loop.s.data.source}: "
                          f"{unknown[:5]} ({len(unknown)} in all)")
    return [index[t] for t in assigned]


def _generate(loop: Loop, ctx: StepContext, split: Split, iteration: int,
              tasks: Sequence[Task], todo: Sequence[Task], writer: RankCheckpointWriter,
              group_size: int, failed: list[str]) -> int:
    """The groups still to do, from the agent (built-in sampling unless rollout.agent
    names a plugin); each group is checkpointed in task order as soon as it and
    those before it are done (the writer publishes every K groups or S seconds).
    Returns the samples generated; each failed one is listed in `failed`.  Once the
    failed samples (those kept from a completed manifest and the new ones) exceed
    what the budget allows for the whole shard: BudgetError, the rest not done."""
    s = loop.s
    kept_failed = writer.manifest.failed_samples  # final: of a manifest once complete
    generated = 0
    started = last_report = time.monotonic()
    groups = run_groups(_agent(loop, iteration, split), todo, loop.engines.endpoint(),
                        group_size=group_size,
                        concurrency=episodes_in_flight(s.rollout, s.engine),
                        timeout_s=s.rollout.episode_timeout_s, check_cancel=ctx.check_cancel)
    try:
        for done, (_task, samples) in enumerate(groups, start=1):
            failed += [x.error.splitlines()[0] for x in samples if x.failed]  # each names its task
            writer.add_group(samples)
            generated += len(samples)
            now = time.monotonic()
            if now - last_report >= s.rollout.progress_interval_s or done == len(todo):
                log.info("rank %d iteration %d %s rollout: %d/%d tasks, %.1f samples/s, %d "
                         "failed", ctx.rank, iteration, split.value,
                         len(tasks) - len(todo) + done, len(tasks),
                         generated / max(now - started, 1e-9), len(failed))
                last_report = now
            check_failures_so_far(kept_failed + len(failed),
                                  seen=(len(tasks) - len(todo) + done) * group_size,
                                  planned=len(tasks) * group_size,
                                  fraction=s.rollout.max_failed_fraction, where=split.value,
                                  first=failed[0] if failed else "")
    finally:
        # Now, not whenever the generator is collected: built-in sampling cancels its
        # requests in flight, the episode runner starts no more episodes.
        close = getattr(groups, "close", None)
        if close is not None:
            close()
    return generated


def _agent(loop: Loop, iteration: int, split: Split) -> Agent | GroupAgent:
    """rollout.agent's plugin, or built-in single-turn sampling (itself a plugin)."""
    s = loop.s
    if s.rollout.agent:
        try:
            return load_agent(s.rollout.agent)
        except ValueError as exc:
            raise ActionError(str(exc)) from exc
    train = split is Split.TRAIN
    return SingleTurnSampler(
        max_tokens=s.rollout.max_tokens,
        temperature=s.rollout.temperature if train else s.rollout.eval_temperature,
        top_p=s.rollout.top_p, reward=s.data.reward, reward_file=s.reward.file(),
        seed_of=lambda t: group_seed(loop.config.run.seed, iteration, split, t.task_id))
