"""One GRPO training iteration: `python -m trainer.train --job JOB.json`.

Run under torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT
from the environment) or as a single process.  Every rank reads the whole
batch, computes the group advantages over all of it, then works on its own
deterministic shard:

    load job, batch, model ──> restore optimizer state (all ranks agree)
        │
        ├─ old log-probs with the current weights (no grad)  ── PPO "old" policy
        ├─ ref log-probs (only when kl_coef > 0)
        │
        └─ for each epoch, for each optimizer step:
               micro-batches: forward, GRPO loss, backward (grad sync on the last)
               clip grad norm, AdamW step (lr warm-up by the run's global step)
    ──> every rank: save optimizer state ── barrier ──> rank 0: publish the
        checkpoint to out_dir, then metrics_path (last: it means "done")

Every rank runs the same number of forward/backward passes (a rank short of
samples runs a zero-weight copy of a real one), because DDP and FSDP2 issue
collectives inside them and unequal counts would hang.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import json
import logging
import math
import os
import random
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch
import torch.distributed as dist
from torch import Tensor

from coordinator.fsio import publish_bytes
from rollout.train_batch import TrainBatch, TrainBatchError, load_train_batch
from trainer import grpo
from trainer.checkpoint import (
    OptimizerState,
    load_optimizer_state,
    publish_checkpoint,
    save_optimizer_state,
    verify_checkpoint,
)
from trainer.config import (
    Device,
    DType,
    LossAgg,
    Strategy,
    TrainConfig,
    TrainerError,
    TrainJob,
)
from trainer.grpo import plan_steps, shard

log = logging.getLogger("trainer")

METRICS_SCHEMA: Final = "coordinator/train-metrics"
METRICS_VERSION: Final = 1
_PR_SET_PDEATHSIG: Final = 1  # from <linux/prctl.h>


class TrainError(TrainerError):
    """Training could not complete; the message names the phase and the cause."""


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL us when our parent (torchrun) dies.

    Without it a rank whose torchrun agent was killed keeps its process group
    and memory until its next collective times out, minutes later.
    """
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    # The parent may have died before prctl took effect: then we were reparented.
    if os.getppid() != parent:
        os._exit(1)


@dataclass(frozen=True, kw_only=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    strategy: Strategy
    compute_dtype: torch.dtype = torch.float32  # weights and optimizer stay float32

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise TrainError(
            f"environment {name}={raw!r} is not an integer: torchrun sets it"
        ) from None


def init_distributed(config: TrainConfig) -> DistContext:
    """Join the process group (when WORLD_SIZE > 1) and pick device and strategy."""
    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    if not 0 <= rank < world:
        raise TrainError(f"RANK={rank} is outside 0..WORLD_SIZE-1={world - 1}")
    if config.device == Device.CUDA and not torch.cuda.is_available():
        raise TrainError("device='cuda' but no CUDA device is visible: use device='auto' or 'cpu'")
    use_cuda = config.device == Device.CUDA or (
        config.device == Device.AUTO and torch.cuda.is_available()
    )
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    strategy = config.strategy
    if strategy == Strategy.AUTO:
        strategy = Strategy.FSDP2 if use_cuda else Strategy.DDP
    if config.dtype == DType.AUTO:
        compute = torch.bfloat16 if use_cuda else torch.float32
    else:
        compute = torch.bfloat16 if config.dtype == DType.BFLOAT16 else torch.float32
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", rank=rank, world_size=world)
    return DistContext(
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        device=device,
        strategy=strategy,
        compute_dtype=compute,
    )


def all_reduce(values: Sequence[float], ctx: DistContext, op: Any = None) -> list[float]:
    if not ctx.is_distributed:
        return list(values)
    t = torch.tensor(list(values), dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return t.tolist()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


# ---------------------------------------------------------------- the batch


def load_batch(path: Path) -> TrainBatch:
    try:
        return load_train_batch(path)
    except FileNotFoundError:
        raise TrainError(
            f"batch file {path} does not exist: the rollout phase must write it"
        ) from None
    except TrainBatchError as exc:
        raise TrainError(str(exc)) from exc


def check_vocab(batch: TrainBatch, vocab: int, source: Path) -> None:
    for name in ("prompt", "response"):
        flat, offsets = getattr(batch, f"{name}_tokens"), getattr(batch, f"{name}_offsets")
        bad = ((flat < 0) | (flat >= vocab)).nonzero()
        if bad.numel():
            pos = int(bad[0, 0])
            sample = int(torch.searchsorted(offsets, torch.tensor(pos), right=True)) - 1
            raise TrainError(
                f"{source}: sample {sample} ({batch.task_ids[sample]}) has {name} token id "
                f"{int(flat[pos])} outside the model's vocabulary 0..{vocab - 1}: the batch "
                "was made with another tokenizer"
            )


# ---------------------------------------------------------------- optimizer state


def _local(value: Any) -> Any:
    return value.to_local() if hasattr(value, "to_local") else value


def _fits(saved: OptimizerState, params: list[Any], groups: int, ctx: DistContext) -> bool:
    """Whether a saved state can be loaded into this optimizer on this rank."""
    if saved.strategy != ctx.strategy.value:
        return False
    if ctx.strategy == Strategy.FSDP2 and saved.world_size != ctx.world_size:
        return False  # shards only fit the split they were cut for
    state = saved.optimizer["state"]
    if len(saved.optimizer["param_groups"]) != groups or len(state) > len(params):
        return False
    return all(
        isinstance(i, int)
        and 0 <= i < len(params)
        and isinstance(entry.get("exp_avg"), Tensor)
        and entry["exp_avg"].shape == _local(params[i]).shape
        for i, entry in state.items()
    )


def restore_optimizer(optimizer: Any, job: TrainJob, ctx: DistContext) -> int:
    """Load this rank's saved optimizer state if every rank has a matching one.

    The decision is collective: replicas (DDP) or shards (FSDP2) whose Adam
    states came from different iterations would silently drift apart.
    Returns the optimizer step count the iteration starts from.
    """
    saved = load_optimizer_state(job.optim_dir, rank=ctx.rank, before_iteration=job.iteration)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    usable = saved is not None and _fits(saved, params, len(optimizer.param_groups), ctx)
    key = [saved.iteration, saved.step] if saved is not None and usable else [-1, -1]
    low = all_reduce(key, ctx, dist.ReduceOp.MIN if ctx.is_distributed else None)
    high = all_reduce(key, ctx, dist.ReduceOp.MAX if ctx.is_distributed else None)
    if low[0] < 0 or low != high:
        if high[0] >= 0:
            log.warning(
                "optimizer state in %s is missing, unfit or from different iterations on some "
                "rank: every rank starts with fresh Adam moments",
                job.optim_dir,
            )
        return 0
    assert saved is not None
    optimizer.load_state_dict(saved.optimizer)
    for group in optimizer.param_groups:  # this iteration's config wins over the saved one
        group.update(
            lr=job.config.lr,
            betas=job.config.betas,
            eps=job.config.adam_eps,
            weight_decay=job.config.weight_decay,
        )
    if ctx.strategy == Strategy.FSDP2:
        from torch.distributed.tensor import DTensor

        for p in params:
            for k, v in optimizer.state.get(p, {}).items():
                if k != "step" and isinstance(p, DTensor) and not isinstance(v, DTensor):
                    optimizer.state[p][k] = DTensor.from_local(
                        v.to(p.device), p.device_mesh, p.placements
                    )
    log.info("restored optimizer state of iteration %d (step %d)", saved.iteration, saved.step)
    return saved.step


def save_optimizer(optimizer: Any, job: TrainJob, ctx: DistContext, step: int) -> None:
    sd = optimizer.state_dict()
    sd["state"] = {i: {k: _local(v) for k, v in s.items()} for i, s in sd["state"].items()}
    save_optimizer_state(
        OptimizerState(
            iteration=job.iteration,
            rank=ctx.rank,
            world_size=ctx.world_size,
            strategy=ctx.strategy.value,
            step=step,
            optimizer=sd,
        ),
        job.optim_dir,
    )


# ---------------------------------------------------------------- model


def load_model(model_dir: Path, ctx: DistContext) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (model_dir / "manifest.json").exists():
        verify_checkpoint(model_dir)
    elif not model_dir.is_dir():
        raise TrainError(f"model_dir {model_dir} does not exist")
    # fp32 master weights everywhere; FSDP2 casts to bf16 for compute on GPUs.
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, local_files_only=True, use_safetensors=True
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model.to(ctx.device)  # type: ignore[arg-type]  # transformers' stub is wrong
    model.config.use_cache = False  # no KV cache while training
    return model, tokenizer


def wrap_model(model: Any, ctx: DistContext, *, trainable: bool) -> Any:
    """DDP (gloo/nccl) or FSDP2 fully_shard with bf16 compute, fp32 reduce."""
    if not ctx.is_distributed:
        return model
    if ctx.strategy == Strategy.FSDP2:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=ctx.compute_dtype, reduce_dtype=torch.float32)
        # One shard group per decoder layer (all-gathered just in time), then the rest.
        for layer in getattr(getattr(model, "model", None), "layers", []):
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        return model
    if not trainable:
        return model  # a frozen reference model needs no gradient sync
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(
        model, device_ids=[ctx.local_rank] if ctx.device.type == "cuda" else None
    )


def unwrap(model: Any) -> Any:
    return model.module if hasattr(model, "module") else model


@contextlib.contextmanager
def grad_sync(model: Any, ctx: DistContext, enabled: bool) -> Iterator[None]:
    """Skip the gradient all-reduce on all but the last micro-batch of a step."""
    if not ctx.is_distributed or enabled:
        if ctx.strategy == Strategy.FSDP2 and ctx.is_distributed:
            model.set_requires_gradient_sync(True)
        yield
    elif ctx.strategy == Strategy.FSDP2:
        model.set_requires_gradient_sync(False)
        yield
    else:
        with model.no_sync():
            yield


def autocast(ctx: DistContext) -> contextlib.AbstractContextManager[Any]:
    """bf16 compute for DDP/single process; FSDP2 casts through its own policy."""
    if ctx.compute_dtype == torch.float32 or (
        ctx.is_distributed and ctx.strategy == Strategy.FSDP2
    ):
        return contextlib.nullcontext()
    return torch.autocast(device_type=ctx.device.type, dtype=ctx.compute_dtype)


def forward_logits(model: Any, packed: grpo.PackedBatch, ctx: DistContext) -> Tensor:
    with autocast(ctx):
        out = model(
            input_ids=packed.input_ids.to(ctx.device),
            attention_mask=packed.attention_mask.to(ctx.device),
            use_cache=False,
        )
    return out.logits


def _packed(batch: TrainBatch, idx: Sequence[int], pad_id: int) -> grpo.PackedBatch:
    return grpo.collate(
        [batch.prompt_ids[i] for i in idx], [batch.response_ids[i] for i in idx], pad_id=pad_id
    )


def policy_logprobs(
    model: Any, batch: TrainBatch, own: Sequence[int], ctx: DistContext, micro: int, pad_id: int
) -> dict[int, Tensor]:
    """Per-response-token log-probs of `own` samples under `model`, without grad.

    All ranks run the same number of forwards (FSDP2 all-gathers inside).
    """
    longest = len(shard(batch.num_samples, ctx.world_size, 0))  # rank 0's shard is the largest
    out: dict[int, Tensor] = {}
    with torch.no_grad():
        for m in range(max(1, math.ceil(longest / micro))):
            chunk = list(own[m * micro : (m + 1) * micro])
            idx = chunk or [0]  # a throwaway forward keeps the collectives in step
            packed = _packed(batch, idx, pad_id)
            logits = forward_logits(model, packed, ctx)
            logp = grpo.token_logprobs(logits, packed.input_ids.to(ctx.device)).cpu()
            for i, values in zip(chunk, grpo.extract_response_values(logp, packed), strict=False):
                out[i] = values
    return out


def param_digest(model: Any) -> str:
    """sha256 over all (full) parameters: equal on every rank when replicas agree."""
    digest = hashlib.sha256()
    for name, p in sorted(unwrap(model).named_parameters()):
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        digest.update(name.encode())
        digest.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()


# ---------------------------------------------------------------- the iteration


@dataclass
class Sums:
    """Token sums over the iteration, added over ranks before they become means."""

    loss: float = 0.0  # the objective as optimised (already normalised)
    policy: float = 0.0
    kl: float = 0.0
    clipped: float = 0.0
    ratio: float = 0.0
    tokens: float = 0.0

    def add(self, terms: grpo.LossTerms) -> None:
        self.loss += float(terms.loss.detach())
        self.policy += float(terms.policy_sum)
        self.kl += float(terms.kl_sum)
        self.clipped += float(terms.clipped_tokens)
        self.ratio += float(terms.ratio_sum)
        self.tokens += float(terms.tokens)

    def reduced(self, ctx: DistContext) -> Sums:
        return Sums(
            *all_reduce(
                [self.loss, self.policy, self.kl, self.clipped, self.ratio, self.tokens], ctx
            )
        )


@dataclass(frozen=True, kw_only=True)
class Inputs:
    """What the optimizer steps read: advantages and the per-sample reference values."""

    batch: TrainBatch
    advantages: Tensor  # [S]
    old: dict[int, Tensor]  # recomputed "old" log-probs of this rank's samples
    ref: dict[int, Tensor] | None  # reference log-probs (KL on) of this rank's samples
    own: list[int]
    pad_id: int


def optimizer_step(
    wrapped: Any,
    optimizer: Any,
    step: grpo.Step,
    inputs: Inputs,
    ctx: DistContext,
    config: TrainConfig,
    total_steps: int,
) -> tuple[Sums, float]:
    """Accumulate the step's micro-batches, clip, and apply AdamW; returns (local sums, grad norm)."""
    sums = Sums()
    optimizer.zero_grad(set_to_none=True)
    mine = step.micro[ctx.rank]
    for m, chunk in enumerate(mine):
        real = bool(chunk)
        # A rank short of samples runs a zero-weight copy of a real one: DDP
        # and FSDP2 need every rank in every backward's collectives.
        idx = list(chunk) if real else [inputs.own[0] if inputs.own else 0]
        packed = _packed(inputs.batch, idx, inputs.pad_id)
        with grad_sync(wrapped, ctx, enabled=m == len(mine) - 1):
            logits = forward_logits(wrapped, packed, ctx)
            logp = grpo.token_logprobs(logits, packed.input_ids.to(ctx.device))
            if real:
                old = grpo.place_response_values([inputs.old[i] for i in idx], packed)
            else:
                old = logp.detach().cpu()
            ref = None
            if inputs.ref is not None and real:
                ref = grpo.place_response_values([inputs.ref[i] for i in idx], packed).to(
                    ctx.device
                )
            if config.loss_agg == LossAgg.TOKEN_MEAN:
                weights, normalizer = None, max(step.tokens, 1)
            else:
                weights = torch.tensor([1.0 / max(r, 1) for r in packed.response_lens])
                normalizer = max(step.samples, 1)
            terms = grpo.grpo_loss(
                logp,
                old.to(ctx.device),
                inputs.advantages[idx].to(ctx.device),
                packed.response_mask.to(ctx.device),
                clip_eps=config.clip_eps,
                normalizer=normalizer,
                ref_logp=ref,
                kl_coef=config.kl_coef,
                sample_weights=None if weights is None else weights.to(ctx.device),
            )
            # DDP and FSDP2 average gradients over ranks, while the normaliser
            # already counts every rank's tokens/samples: scale the average back to a sum.
            (terms.loss * (float(ctx.world_size) if real else 0.0)).backward()
        if real:
            sums.add(terms)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(wrapped.parameters(), config.max_grad_norm))
    if not math.isfinite(grad_norm):
        raise TrainError(
            f"gradient norm is {grad_norm}: lower lr (now {config.lr}) or check the batch's rewards"
        )
    for group in optimizer.param_groups:
        group["lr"] = config.lr_at(total_steps)
    optimizer.step()
    return sums, grad_norm


def run(job: TrainJob, ctx: DistContext) -> dict[str, Any]:
    """Train one iteration and publish its outputs; returns the metrics (on every rank)."""
    started = time.monotonic()
    config = job.config
    seed_everything(config.seed * 1_000_003 + job.iteration)
    batch = load_batch(job.batch_path)
    if batch.iteration != job.iteration:
        raise TrainError(
            f"{job.batch_path} holds the batch of iteration {batch.iteration}, but this is "
            f"iteration {job.iteration}: a stale batch; aggregate iteration {job.iteration} again"
        )
    lens = [len(r) for r in batch.response_ids]
    log.info(
        "batch %s: %d samples, %d response tokens", job.batch_path, batch.num_samples, sum(lens)
    )

    model, tokenizer = load_model(job.model_dir, ctx)
    check_vocab(batch, model.get_input_embeddings().num_embeddings, job.batch_path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    model.train()
    wrapped = wrap_model(model, ctx, trainable=True)
    optimizer = torch.optim.AdamW(
        wrapped.parameters(),
        lr=config.lr,
        betas=config.betas,
        eps=config.adam_eps,
        weight_decay=config.weight_decay,
    )
    start_step = restore_optimizer(optimizer, job, ctx)

    own = shard(batch.num_samples, ctx.world_size, ctx.rank)
    if batch.num_samples == 0:
        # Every group failed: publish the unchanged model so the run moves on.
        log.warning("batch %s is empty: publishing the model unchanged", job.batch_path)
        steps: list[grpo.Step] = []
    else:
        steps = plan_steps(lens, world=ctx.world_size, config=config, iteration=job.iteration)
    # The PPO "old" policy is the current weights, recomputed here: the
    # engine's log-probs differ by kernels and precision and are only compared.
    old = (
        policy_logprobs(wrapped, batch, own, ctx, config.micro_batch_size, pad_id) if steps else {}
    )
    offsets = batch.response_offsets.tolist()
    engine = {i: batch.response_logprobs[offsets[i] : offsets[i + 1]] for i in own}
    gaps = [(old[i] - engine[i]).abs() for i in own if lens[i]]
    mismatch_sum = all_reduce([sum(float(g.sum()) for g in gaps)], ctx)[0]
    mismatch_max = all_reduce(
        [max((float(g.max()) for g in gaps), default=0.0)],
        ctx,
        dist.ReduceOp.MAX if ctx.is_distributed else None,
    )[0]
    ref = None
    if config.kl_coef > 0 and steps:
        assert job.ref_model_dir is not None  # TrainJob enforces it
        ref_model, _ = load_model(job.ref_model_dir, ctx)
        ref_model.eval()
        ref_wrapped = wrap_model(ref_model, ctx, trainable=False)
        ref = policy_logprobs(ref_wrapped, batch, own, ctx, config.micro_batch_size, pad_id)
        del ref_model, ref_wrapped
    log.info(
        "old log-probs ready; engine mismatch mean %.3g max %.3g",
        mismatch_sum / max(1, sum(lens)),
        mismatch_max,
    )

    advantages = (
        grpo.group_advantages(batch.rewards, batch.group_index, eps=config.adv_eps)
        if batch.num_samples
        else torch.zeros(0)
    )
    inputs = Inputs(batch=batch, advantages=advantages, old=old, ref=ref, own=own, pad_id=pad_id)
    totals, step_losses, grad_norms = Sums(), [], []
    for number, step in enumerate(steps, start=1):
        local, grad_norm = optimizer_step(
            wrapped, optimizer, step, inputs, ctx, config, start_step + number
        )
        sums = local.reduced(ctx)
        step_losses.append(sums.loss)
        grad_norms.append(grad_norm)
        for name in ("loss", "policy", "kl", "clipped", "ratio", "tokens"):
            setattr(totals, name, getattr(totals, name) + getattr(sums, name))
        log.info(
            "step %d/%d loss %.5f grad_norm %.4f lr %.3g",
            number,
            len(steps),
            step_losses[-1],
            grad_norm,
            optimizer.param_groups[0]["lr"],
        )

    seen = max(totals.tokens, 1.0)
    metrics: dict[str, Any] = {
        "schema": METRICS_SCHEMA,
        "version": METRICS_VERSION,
        "iteration": job.iteration,
        "world_size": ctx.world_size,
        "strategy": ctx.strategy.value,
        "samples": batch.num_samples,
        "tokens": sum(lens),
        "steps": len(steps),
        "loss": totals.loss / len(steps) if steps else 0.0,
        "loss_per_step": step_losses,
        "kl": totals.kl / seen,
        "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else 0.0,
        "grad_norm_per_step": grad_norms,
        "clip_fraction": totals.clipped / seen,
        "ratio_mean": totals.ratio / seen if totals.tokens else 1.0,
        "lr": config.lr_at(start_step + max(len(steps), 1)),
        "reward_mean": float(batch.rewards.mean()) if batch.num_samples else 0.0,
        "advantage_mean": float(advantages.mean()) if batch.num_samples else 0.0,
        "advantage_abs_mean": float(advantages.abs().mean()) if batch.num_samples else 0.0,
        "logprob_mismatch_mean_abs": mismatch_sum / max(1, sum(lens)),
        "logprob_mismatch_max_abs": mismatch_max,
        "optimizer_step_start": start_step,
        "optimizer_step_end": start_step + len(steps),
    }
    finish(job, ctx, wrapped, optimizer, metrics, started)
    return metrics


def gathered_state(model: Any, ctx: DistContext) -> dict[str, Tensor] | None:
    """Full CPU state dict for saving (FSDP2 needs every rank to take part)."""
    if ctx.is_distributed and ctx.strategy == Strategy.FSDP2:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        return dict(state)  # type: ignore[arg-type]
    return None


def finish(
    job: TrainJob,
    ctx: DistContext,
    model: Any,
    optimizer: Any,
    metrics: dict[str, Any],
    started: float,
) -> None:
    """Save every rank's optimizer state, then (rank 0) the checkpoint, then the metrics.

    The metrics file is written last: the coordinator may take its presence
    as "iteration trained", so everything it describes must exist first.
    """
    digest = param_digest(model)
    log.info("params sha256 %s", digest)
    full_state = gathered_state(model, ctx)
    save_optimizer(optimizer, job, ctx, metrics["optimizer_step_end"])
    if ctx.is_distributed:
        dist.barrier()  # every rank's optimizer state is durable before the checkpoint appears
    if ctx.rank == 0:
        inner = unwrap(model)
        manifest = publish_checkpoint(
            inner,
            None,
            job.out_dir,
            iteration=job.iteration,
            state_dict=full_state,
            carry_files_from=job.model_dir,
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


def _setup_logging(rank: int, world: int, iteration: int | str) -> None:
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s [trainer it={iteration} rank={rank}/{world}] %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    for noisy in ("transformers", "torch", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.train", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--job", type=Path, required=True, help="train job JSON (trainer.config.TrainJob)"
    )
    args = parser.parse_args(argv)
    die_with_parent()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import transformers.utils.logging as hf_logging

    hf_logging.disable_progress_bar()  # tqdm bars would flood the per-rank logs
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    _setup_logging(rank, world, "?")
    ctx: DistContext | None = None
    try:
        job = TrainJob.load(args.job)
        _setup_logging(rank, world, job.iteration)
        # Process-wide, so set here rather than in run(), which tests call in-process.
        # warn_only: a few CUDA kernels have no deterministic version; CPU has all we use.
        torch.use_deterministic_algorithms(True, warn_only=True)
        ctx = init_distributed(job.config)
        log.info("start: %s on %s, strategy %s", args.job, ctx.device, ctx.strategy.value)
        run(job, ctx)
    except TrainerError as exc:
        log.error("failed: %s", exc)
        print(f"trainer: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except Exception as exc:
        log.exception("failed with an unexpected error")
        print(
            f"trainer: unexpected error: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True
        )
        return 1
    else:
        log.info("done")
        return 0
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):  # shutdown after a failure must not mask it
                dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
