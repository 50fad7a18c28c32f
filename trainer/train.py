"""One GRPO training iteration: `python -m trainer.train --job JOB.json`, or a job
handed to a resident trainer (trainer/resident.py) that holds the iteration before.

Run under torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT
from the environment) or as a single process.  Every rank reads the whole
batch, computes the group advantages over all of it, then works on its own
deterministic shard:

    prepare (a new trainer only): load the start model, restore the saved
        state (all ranks agree), train the `replay` jobs again unpublished
    train_iteration: load and check the batch
        │
        ├─ old log-probs with the current weights (no grad)  ── PPO "old" policy
        ├─ ref log-probs (only when kl_coef > 0)
        │
        └─ for each epoch, for each optimizer step:
               micro-batches: forward, GRPO loss, backward (grad sync on the last)
               clip grad norm, AdamW step (lr warm-up by the run's global step)
    ──> every rank: the probes, scored on the weights rounded to the checkpoint's
        dtype (the start model's own: trainer/checkpoint.py saved_dtype); its shard
        of the training state (fp32 master weights) when the job says save_state
        ── barrier ──> rank 0: publish the checkpoint to out_dir in that dtype,
        then metrics_path (last: it means "done")

Every rank runs the same number of forward/backward passes (a rank short of
samples runs a zero-weight copy of a real one), because DDP and FSDP2 issue
collectives inside them and unequal counts would hang.

The parts live in their own modules: `trainer.batch` (the batch, checked),
`trainer.distributed` (process group, model wrapping, grad sync),
`trainer.policy` (model loading and forwards), `trainer.update` (one
optimizer step), `trainer.session` (model and optimizer across jobs, the
saved state, offload); this module orchestrates them and publishes the results.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import random
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import torch
import torch.distributed as dist

from coordinator.storage.fsio import publish_bytes
from coordinator.storage.store import read_document
from rollout.batch_format import TrainBatch
from trainer import grpo, worker
from trainer.batch import check_vocab, load_batch
from trainer.checkpoint import publish_checkpoint
from trainer.config import Strategy
from trainer.distributed import (
    DistContext,
    all_reduce,
    env_int,
    exit_rank,
    unwrap,
)
from trainer.errors import TrainError
from trainer.grpo import shard
from trainer.job import TrainJob
from trainer.policy import (
    as_published,
    autocast,
    load_policy,
    param_digest,
    policy_logprobs,
)
from trainer.probes import ProbeSet, make_probe_set
from trainer.publisher import LAST_PUBLISHED
from trainer.session import Session, open_session
from trainer.sharded_save import published_weights
from trainer.update import Inputs, Sums, optimizer_step, plan

log = logging.getLogger("trainer")

METRICS_SCHEMA: Final = "coordinator/train-metrics"
METRICS_VERSION: Final = 1


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


# ---------------------------------------------------------------- the iteration


@dataclass
class Progress:
    """What the iteration's optimizer steps add up to, summed over ranks."""

    totals: Sums = field(default_factory=Sums)
    losses: list[float] = field(default_factory=list)  # per step
    grad_norms: list[float] = field(default_factory=list)  # per step


def run(job: TrainJob, ctx: DistContext, *, run_dir: Path | None = None,
        started: float | None = None) -> dict[str, Any]:
    """Open a session for `job` (resumed and replayed as it says), train it and publish.
    The metrics' `seconds` count from `started` (default: now): `main` passes the
    moment it began reading the job, as a resident trainer counts from its message."""
    started = time.monotonic() if started is None else started
    session = prepare(job, ctx, run_dir=run_dir)
    return train_iteration(session, job, started=started)


def prepare(job: TrainJob, ctx: DistContext, *, run_dir: Path | None = None) -> Session:
    """A session holding iteration `job.iteration - 1`: opened on the job's start model and
    saved state, then the `replay` jobs trained again without publishing anything.

    Each replayed iteration's weights are compared with what it published the
    first time (`params_sha256` in its metrics): equal on the same group and
    hardware, since every iteration is seeded; a difference (another group
    size after a shrink, GPU kernels) is reported, not an error.
    """
    session = open_session(job, ctx)
    replayed = []
    for path in job.replay:
        earlier = TrainJob.load(path, run_dir=run_dir)
        if earlier.iteration <= session.through:
            continue  # the saved state was unusable: the job's model already holds it
        published = _published_digest(earlier)
        train_iteration(session, earlier, publish=False)
        digest = param_digest(session.model)
        # None: nothing to compare with (its metrics unreadable), which is no difference.
        matches = None if published is None else digest == published
        log.info("replayed iteration %d: weights %s what it published", earlier.iteration,
                 {True: "equal", False: "differ from", None: "not compared with"}[matches])
        replayed.append({"iteration": earlier.iteration, "matches": matches})
    session.resumed["replayed"] = replayed
    return session


def _published_digest(job: TrainJob) -> str | None:
    """The `params_sha256` the job's iteration published, or None (a warning says why)."""
    why = "missing"
    try:
        found = read_document(job.metrics_path, lambda raw, _where: json.loads(raw))
    except (OSError, ValueError) as exc:
        found, why = None, str(exc)
    digest = found.get("params_sha256") if isinstance(found, dict) else None
    if isinstance(digest, str):
        return digest
    if found is not None:
        why = "no params_sha256 in it"
    log.warning("no metrics of iteration %d to compare its replay with (%s: %s)",
                job.iteration, job.metrics_path, why)
    return None


def train_iteration(session: Session, job: TrainJob, *, publish: bool = True,
                    started: float | None = None) -> dict[str, Any]:
    """Train `job`'s iteration on `session`, which must hold the one before; with
    `publish`, save the state (when the job asks) and publish checkpoint and metrics.

    The metrics' `seconds` count from `started` (default: now), so that a trainer
    started for this job counts its model loading, as a relaunched one does."""
    started = time.monotonic() if started is None else started
    ctx, config = session.ctx, job.config
    if job.iteration != session.through + 1:
        raise TrainError(
            f"this trainer holds iteration {session.through}, but the job is iteration "
            f"{job.iteration}: it can only train the next one; start a new trainer")
    if config != session.config:
        raise TrainError("the job's [train] settings differ from those this trainer started "
                         "with: start a new trainer")
    session.onload()
    seed_everything(config.seed * 1_000_003 + job.iteration)
    batch = load_batch(job)
    # The model's own tokens per sample: what the loss and every per-token metric
    # average over (a multi-turn episode's environment turns are context).
    log.info(
        "batch %s: %d samples, %d response tokens, %d of them the model's", job.batch_path,
        batch.num_samples, int(batch.response_tokens.numel()), sum(batch.model_token_counts)
    )
    wrapped, optimizer, start_step = session.model, session.optimizer, session.step
    check_vocab(batch, unwrap(wrapped).get_input_embeddings().num_embeddings, job.batch_path)
    tokenizer = session.tokenizer
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    steps = plan(batch, world=ctx.world_size, config=config, iteration=job.iteration)
    inputs, mismatch = fixed_inputs(job, ctx, wrapped, batch, bool(steps), pad_id)
    progress = Progress()
    for number, step in enumerate(steps, start=1):
        local, grad_norm = optimizer_step(
            wrapped, optimizer, step, inputs, ctx, config, start_step + number
        )
        sums = local.reduced(ctx)
        progress.totals.merge(sums)
        progress.losses.append(sums.loss)
        progress.grad_norms.append(grad_norm)
        log.info(
            "step %d/%d loss %.5f grad_norm %.4f lr %.3g",
            number,
            len(steps),
            sums.loss,
            grad_norm,
            optimizer.param_groups[0]["lr"],
        )
    session.step, session.through = start_step + len(steps), job.iteration
    metrics = iteration_metrics(job, ctx, inputs, progress, mismatch, start_step)
    if publish:
        metrics["resumed"] = session.resumed or None
        session.resumed = {}
        finish(job, session, metrics, started)
    return metrics


def fixed_inputs(
    job: TrainJob,
    ctx: DistContext,
    wrapped: Any,
    batch: TrainBatch,
    training: bool,
    pad_id: int,
) -> tuple[Inputs, tuple[float, ...]]:
    """What every optimizer step reads, computed once before the first.

    Returns the `Inputs` and, summed over ranks: the absolute gap between the
    engine's log-probs and the recomputed old ones (sum, max), and for an
    off-policy job the truncated importance weights (sum, tokens truncated),
    all over the tokens the model generated (TrainBatch.model_token_counts).
    Without steps to take (`training` false) no forward runs.
    """
    config = job.config
    model_tokens = batch.model_token_counts
    own = shard(batch.num_samples, ctx.world_size, ctx.rank)
    # The PPO "old" policy is the current weights, recomputed here: the
    # engine's log-probs differ by kernels and precision and are only compared.
    old = (
        policy_logprobs(wrapped, batch, own, ctx, config.micro_batch_size, pad_id)
        if training
        else {}
    )
    offsets = batch.response_offsets.tolist()
    engine = {i: batch.response_logprobs[offsets[i] : offsets[i + 1]] for i in own}
    # Only the model's own tokens have an engine log-prob to compare.
    mask = batch.response_mask
    assert mask is not None  # TrainBatch fills it
    model_mask = {i: mask[offsets[i] : offsets[i + 1]] for i in own}
    gaps = [(old[i] - engine[i]).abs()[model_mask[i]] for i in own if model_tokens[i]]
    gaps = [g for g in gaps if g.numel()]
    mismatch_sum = all_reduce([sum(float(g.sum()) for g in gaps)], ctx)[0]
    mismatch_max = all_reduce(
        [max((float(g.max()) for g in gaps), default=0.0)],
        ctx,
        dist.ReduceOp.MAX if ctx.is_distributed else None,
    )[0]
    tis = None
    tis_sums = [0.0, 0.0]
    if job.off_policy and training:
        tis = {i: grpo.truncated_is_weights(old[i], engine[i], cap=config.tis_cap) for i in own}
        for i in own:
            kept = tis[i][model_mask[i]]
            tis_sums[0] += float(kept.sum())
            tis_sums[1] += float((kept >= config.tis_cap).sum())
        tis_sums = all_reduce(tis_sums, ctx)
    ref = None
    if config.kl_coef > 0 and training:
        assert job.ref_model_dir is not None  # TrainJob enforces it
        # Frozen: in the compute dtype (bf16 on GPUs), sharded like the policy under FSDP2.
        ref_wrapped, _ = load_policy(job.ref_model_dir, ctx, trainable=False,
                                     dtype=ctx.compute_dtype)
        ref = policy_logprobs(ref_wrapped, batch, own, ctx, config.micro_batch_size, pad_id)
        del ref_wrapped
    log.info(
        "old log-probs ready; engine mismatch mean %.3g max %.3g",
        mismatch_sum / max(1, sum(model_tokens)),
        mismatch_max,
    )
    advantages = (
        grpo.group_advantages(batch.rewards, batch.group_index, eps=config.adv_eps)
        if batch.num_samples
        else torch.zeros(0)
    )
    inputs = Inputs(batch=batch, advantages=advantages, old=old, ref=ref, tis=tis, own=own,
                    pad_id=pad_id)
    return inputs, (mismatch_sum, mismatch_max, *tis_sums)


def iteration_metrics(
    job: TrainJob,
    ctx: DistContext,
    inputs: Inputs,
    progress: Progress,
    mismatch: tuple[float, ...],
    start_step: int,
) -> dict[str, Any]:
    """The metrics file's content, before `finish` adds the checkpoint's digest."""
    batch, advantages, totals = inputs.batch, inputs.advantages, progress.totals
    steps = len(progress.losses)
    # The model's tokens: what the loss, the mismatch and the TIS sums run over.  A
    # per-token figure over none of them (every response empty) is None, not 0.
    model_tokens = sum(batch.model_token_counts)

    def per_token(total: float, tokens: float, measured: bool = True) -> float | None:
        return total / tokens if measured and tokens > 0 else None

    return {
        "schema": METRICS_SCHEMA,
        "version": METRICS_VERSION,
        "iteration": job.iteration,
        "world_size": ctx.world_size,
        "strategy": ctx.strategy.value,
        "samples": batch.num_samples,
        "tokens": model_tokens,
        "steps": steps,
        "loss": totals.loss / steps if steps else 0.0,
        "loss_per_step": progress.losses,
        # None with kl_coef 0: no reference model, nothing measured (not a KL of 0).
        "kl": per_token(totals.kl, totals.tokens, job.config.kl_coef > 0),
        "grad_norm": sum(progress.grad_norms) / steps if steps else 0.0,
        "grad_norm_per_step": progress.grad_norms,
        "clip_fraction": per_token(totals.clipped, totals.tokens),
        "ratio_mean": per_token(totals.ratio, totals.tokens),
        "lr": job.config.lr_at(start_step + max(steps, 1)),
        "reward_mean": float(batch.rewards.mean()) if batch.num_samples else 0.0,
        "advantage_mean": float(advantages.mean()) if batch.num_samples else 0.0,
        "advantage_abs_mean": float(advantages.abs().mean()) if batch.num_samples else 0.0,
        "logprob_mismatch_mean_abs": per_token(mismatch[0], model_tokens),
        "logprob_mismatch_max_abs": mismatch[1] if model_tokens else None,
        # Off-policy jobs only (asynchronous runs): the truncated importance weights.
        "tis_weight_mean": per_token(mismatch[2], model_tokens, job.off_policy),
        "tis_truncated_fraction": per_token(mismatch[3], model_tokens, job.off_policy),
        "optimizer_step_start": start_step,
        "optimizer_step_end": start_step + steps,
    }


def finish(job: TrainJob, session: Session, metrics: dict[str, Any], started: float) -> None:
    """Save the training state (when the job asks), then (rank 0) the checkpoint, then
    the metrics.

    The metrics file is written last: the coordinator may take its presence
    as "iteration trained", so everything it describes must exist first.
    """
    ctx, model, dtype = session.ctx, session.model, session.publish_dtype
    digest = param_digest(model)  # of the master weights: what a replay must reproduce
    log.info("params sha256 %s", digest)
    with as_published(model, dtype):  # the probes score the weights the engines will load
        probes = score_probes(model, ctx)  # every rank: FSDP all-gathers inside the forward
    # FSDP2: every tensor gathered onto rank 0 where the model fits in its memory, else
    # every rank's shards staged on the share (trainer/sharded_save.py).  DDP and a
    # single process: the model as it is.
    gathered, staged = published_weights(model, ctx, job.out_dir, dtype) \
        if ctx.is_distributed and ctx.strategy == Strategy.FSDP2 else (None, None)
    if job.save_state:
        session.save_state(job.state_dir, job.iteration)  # collective: every shard published
    elif ctx.is_distributed:
        dist.barrier()  # every rank's staged shards are written before rank 0 reads them
    metrics["state_saved"] = job.save_state
    if ctx.rank == 0:
        inner = unwrap(model)
        manifest = publish_checkpoint(
            inner,
            None,
            job.out_dir,
            iteration=job.iteration,
            state_dict=gathered,
            carry_files_from=job.model_dir,
            probes=probes,
            weights_from=staged,
            dtype=dtype,
            # A delta of the checkpoint this node published last (trainer/publisher.py),
            # whose files it keeps on its disk: TMPDIR is the run's node-local .tmp/.
            delta_parent=job.delta_parent,
            last_published=Path(tempfile.gettempdir()) / LAST_PUBLISHED,
        )
        metrics["checkpoint_digest"] = manifest.digest
        metrics["params_sha256"] = digest
        metrics["seconds"] = time.monotonic() - started
        publish_bytes(job.metrics_path, (json.dumps(metrics, indent=2) + "\n").encode())
        log.info(
            "published %s (manifest %s) in %.1f s", job.out_dir, manifest.digest, metrics["seconds"]
        )
    if ctx.is_distributed:
        dist.barrier()


def _special_ids(config: Any) -> list[int]:
    out: list[int] = []
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(config, key, None)
        out += [value] if isinstance(value, int) else list(value or [])
    return out


def score_probes(model: Any, ctx: DistContext) -> ProbeSet:
    """The published weights' log-probabilities of the fixed probes (trainer/probes.py)."""
    config = unwrap(model).config
    was_training = model.training
    model.eval()
    try:
        with autocast(ctx):
            return make_probe_set(
                lambda ids: model(input_ids=ids.to(ctx.device), use_cache=False).logits,
                vocab_size=int(config.vocab_size),
                special_ids=_special_ids(config),
                dtype=str(ctx.compute_dtype).removeprefix("torch."),
            )
    finally:
        model.train(was_training)


# ---------------------------------------------------------------- the process


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.train", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--job", type=Path, required=True, help="train job JSON (trainer.job.TrainJob)"
    )
    args = parser.parse_args(argv)
    run_dir = worker.prepare_process()
    rank, world = env_int("RANK", 0), env_int("WORLD_SIZE", 1)
    worker.setup_logging(rank, world, "?")
    started = time.monotonic()  # "seconds": from receiving the job, joining the group included
    try:
        job = worker.read_job(args.job, run_dir)
        worker.setup_logging(rank, world, job.iteration)
        ctx = worker.start_distributed(job)
        log.info("start: %s on %s, strategy %s", args.job, ctx.device, ctx.strategy.value)
        run(job, ctx, run_dir=run_dir, started=started)
    except Exception as exc:
        return worker.exit_code(exc)
    else:
        log.info("done")
        return 0
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):  # shutdown after a failure must not mask it
                dist.destroy_process_group()


if __name__ == "__main__":
    exit_rank(main())  # not sys.exit: a gloo worker thread can abort interpreter shutdown
