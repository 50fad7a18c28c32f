"""Phases 1, 7 and 12: the node's inference engine around training.

    1   all   (first, on a node that rolls out) serve the policy phase 0 chose:
              its probes checked even when the engine kept it, and a policy older
              than the one the engine serves refused, naming both: phase 0 then
              did not choose the newest, in any placement or weight-update mode

    7   all   put the engine to sleep (engine.weight_update "reload") or stop it;
              either way its accelerator memory is released before training
    12  all   serve the checkpoint phase 11 announced (or, when nothing was
              trained, the iteration's policy), from a verified local copy:
              reloaded in place into the sleeping engine, restarted if that
              fails; then the served weights are checked against the
              checkpoint's probes.  The payload says how and which engine pid.

With a disaggregated placement (rl/placement.py) the training nodes
run no engine, and the rollout nodes' engines stay up through training: phase
7 leaves them serving (in an asynchronous run they roll out the next
iteration during phase 10), and phase 12 updates their weights between
requests (rollout/engines/serving.py UPDATED): the engine pauses (requests in
flight finish, new ones wait), reloads the checkpoint in place, resets its
prefix cache and resumes; the probes then check what it serves.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from coordinator.machine.actions import StepContext
from coordinator.records.phases import Phase
from rl.contracts import CheckpointAnnouncement, PolicyChoice, announced, policy_version
from rl.loop import Loop


def serve_chosen_policy(loop: Loop, ctx: StepContext) -> Mapping[str, Any]:
    """Phase 1, before the rollout: this node's engine serves phase 0's choice, checked."""
    if not loop.rolls_out:
        return {}
    name = PolicyChoice.read(ctx).policy
    how = loop.engines.serve_chosen(ctx, loop.model(ctx, name, where_phase=int(Phase.SYNC)),
                                    version=policy_version(name))
    return {"serving": name, **how}


def stop_engine(loop: Loop, ctx: StepContext) -> Mapping[str, Any]:
    """Phase 7: free the GPU for training (colocated only: disaggregated, training
    has GPUs of its own)."""
    if not loop.layout.shares_gpus:
        return {}
    return loop.engines.release(ctx)


def serve_new_policy(loop: Loop, ctx: StepContext) -> Mapping[str, Any]:
    """Phase 12: the engine serves the new checkpoint (a verified local copy)."""
    if not loop.trains or not loop.rolls_out:
        return {}
    checkpoint = announced(ctx, CheckpointAnnouncement)
    if checkpoint is not None:
        name, phase = checkpoint.checkpoint, Phase.PUBLISH_CHECKPOINT
    else:
        name, phase = PolicyChoice.read(ctx).policy, Phase.SYNC
    how = loop.engines.ensure(ctx, loop.model(ctx, name, where_phase=int(phase)),
                              version=policy_version(name))
    return {"serving": name, **how}
