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
               clip grad norm, AdamW step
    ──> rank 0: publish checkpoint to out_dir, write metrics; every rank: save optimizer state

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
from trainer import grpo
from trainer.checkpoint import (
    OptimizerState,
    load_optimizer_state,
    publish_checkpoint,
    save_optimizer_state,
    verify_checkpoint,
)
from trainer.config import Device, Strategy, TrainConfig, TrainerError, TrainJob
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
        raise TrainError(f"environment {name}={raw!r} is not an integer: torchrun sets it") from None


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
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo", rank=rank, world_size=world
        )
    return DistContext(
        rank=rank, world_size=world, local_rank=local_rank, device=device, strategy=strategy
    )


def all_reduce(values: Sequence[float], ctx: DistContext, op: Any = None) -> list[float]:
    if not ctx.is_distributed:
        return list(values)
    t = torch.tensor(list(values), dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return t.tolist()


def set_determinism(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    # warn_only: a few CUDA kernels have no deterministic version; CPU has all we use.
    torch.use_deterministic_algorithms(True, warn_only=True)


# ---------------------------------------------------------------- the batch
# Stand-in for rollout.trajectory.load_train_batch until that module lands.

BATCH_SCHEMA: Final = "coordinator/train-batch"
BATCH_VERSION: Final = 1


@dataclass(frozen=True, kw_only=True)
class TrainBatch:
    iteration: int
    group_size: int
    task_ids: list[str]
    group_index: Tensor  # [S] long
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    old_logprobs: list[Tensor]  # engine log-probs, one 1-D tensor per sample
    rewards: Tensor  # [S] float32

    @property
    def size(self) -> int:
        return len(self.task_ids)

    @property
    def response_lens(self) -> list[int]:
        return [len(r) for r in self.response_ids]

    @property
    def num_response_tokens(self) -> int:
        return sum(self.response_lens)

    def check_vocab(self, vocab: int, *, source: Path) -> None:
        for i, (p, r) in enumerate(zip(self.prompt_ids, self.response_ids, strict=True)):
            bad = [t for t in (*p, *r) if not 0 <= t < vocab]
            if bad:
                raise TrainError(
                    f"{source}: sample {i} ({self.task_ids[i]}) has token id {bad[0]} outside the "
                    f"model's vocabulary 0..{vocab - 1}: the batch was made with another tokenizer"
                )


def _int_lists(value: Any, name: str, size: int, source: Path) -> list[list[int]]:
    if not isinstance(value, list) or len(value) != size:
        raise TrainError(f"{source}: {name} must be a list of {size} token lists")
    for i, row in enumerate(value):
        if not isinstance(row, list) or not all(type(t) is int for t in row):
            raise TrainError(f"{source}: {name}[{i}] must be a list of integer token ids")
    return value


def load_batch(path: Path) -> TrainBatch:
    """Read and validate a train-batch file (torch.save, weights_only)."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise TrainError(f"batch file {path} does not exist") from None
    except Exception as exc:  # any unpickling error means a corrupt or foreign file
        raise TrainError(f"batch file {path} is unreadable: {exc}") from exc
    if not isinstance(data, dict) or data.get("schema") != BATCH_SCHEMA:
        raise TrainError(f"{path}: schema is not {BATCH_SCHEMA!r}")
    if data.get("version") != BATCH_VERSION:
        raise TrainError(f"{path}: version {data.get('version')!r} is not {BATCH_VERSION}")
    task_ids = data.get("task_ids")
    if not isinstance(task_ids, list) or not task_ids or not all(isinstance(t, str) and t for t in task_ids):
        raise TrainError(f"{path}: task_ids must be a non-empty list of non-empty strings")
    size = len(task_ids)
    for key in ("iteration", "group_size"):
        if type(data.get(key)) is not int or data[key] < 0:
            raise TrainError(f"{path}: {key}={data.get(key)!r} must be an integer >= 0")
    group_index, rewards = data.get("group_index"), data.get("rewards")
    if not isinstance(group_index, Tensor) or group_index.dtype != torch.long or group_index.shape != (size,):
        raise TrainError(f"{path}: group_index must be a LongTensor of shape [{size}]")
    if not isinstance(rewards, Tensor) or not rewards.is_floating_point() or rewards.shape != (size,):
        raise TrainError(f"{path}: rewards must be a float tensor of shape [{size}]")
    if not bool(torch.isfinite(rewards).all()):
        raise TrainError(f"{path}: rewards contain NaN or inf")
    prompts = _int_lists(data.get("prompt_ids"), "prompt_ids", size, path)
    responses = _int_lists(data.get("response_ids"), "response_ids", size, path)
    engine = data.get("old_logprobs")
    if not isinstance(engine, list) or len(engine) != size:
        raise TrainError(f"{path}: old_logprobs must be a list of {size} lists")
    old: list[Tensor] = []
    for i, (row, resp) in enumerate(zip(engine, responses, strict=True)):
        if not isinstance(row, list) or len(row) != len(resp):
            raise TrainError(f"{path}: old_logprobs[{i}] must have one value per response token ({len(resp)})")
        t = torch.tensor(row, dtype=torch.float32)
        # A log-probability is <= 0; a little slack for engines' rounding.
        if not bool(torch.isfinite(t).all()) or bool((t > 1e-3).any()):
            raise TrainError(f"{path}: old_logprobs[{i}] has values that are not finite log-probabilities")
        old.append(t)
        if not prompts[i]:
            raise TrainError(f"{path}: prompt_ids[{i}] is empty: a response needs a prompt")
    return TrainBatch(
        iteration=data["iteration"],
        group_size=data["group_size"],
        task_ids=task_ids,
        group_index=group_index,
        prompt_ids=prompts,
        response_ids=responses,
        old_logprobs=old,
        rewards=rewards.to(torch.float32),
    )


# ---------------------------------------------------------------- optimizer state


def _local(value: Any) -> Any:
    return value.to_local() if hasattr(value, "to_local") else value


def restore_optimizer(optimizer: Any, job: TrainJob, ctx: DistContext) -> int:
    """Load this rank's saved optimizer state if every rank has a matching one.

    The decision is collective: replicas (DDP) or shards (FSDP2) whose Adam
    states came from different iterations would silently drift apart.
    Returns the optimizer step count the iteration starts from.
    """
    saved = load_optimizer_state(job.optim_dir, rank=ctx.rank, before_iteration=job.iteration)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    usable = saved is not None and saved.strategy == ctx.strategy.value
    if usable and ctx.strategy == Strategy.FSDP2:
        usable = saved.world_size == ctx.world_size  # shards only fit the same split
    if usable:
        state = saved.optimizer["state"]
        usable = len(saved.optimizer["param_groups"]) == len(optimizer.param_groups) and all(
            isinstance(state.get(i, {}).get("exp_avg"), Tensor)
            and state[i]["exp_avg"].shape == _local(p).shape
            for i, p in enumerate(params)
        )
    key = [saved.iteration, saved.step] if usable and saved else [-1, -1]
    low = all_reduce(key, ctx, dist.ReduceOp.MIN if ctx.is_distributed else None)
    high = all_reduce(key, ctx, dist.ReduceOp.MAX if ctx.is_distributed else None)
    if low[0] < 0 or low != high:
        if high[0] >= 0:
            log.warning(
                "optimizer state in %s is missing, unfit or from different iterations on some "
                "rank: every rank starts with fresh Adam moments", job.optim_dir,
            )
        return 0
    assert saved is not None
    optimizer.load_state_dict(saved.optimizer)
    for group in optimizer.param_groups:  # this iteration's config wins over the saved one
        group.update(lr=job.config.lr, betas=job.config.betas, eps=job.config.adam_eps,
                     weight_decay=job.config.weight_decay)
    if ctx.strategy == Strategy.FSDP2:
        from torch.distributed.tensor import DTensor

        for p in params:
            for k, v in optimizer.state.get(p, {}).items():
                if k != "step" and isinstance(p, DTensor) and not isinstance(v, DTensor):
                    optimizer.state[p][k] = DTensor.from_local(v.to(p.device), p.device_mesh, p.placements)
    log.info("restored optimizer state of iteration %d (step %d)", saved.iteration, saved.step)
    return saved.step


def save_optimizer(optimizer: Any, job: TrainJob, ctx: DistContext, step: int) -> None:
    sd = optimizer.state_dict()
    sd["state"] = {i: {k: _local(v) for k, v in s.items()} for i, s in sd["state"].items()}
    save_optimizer_state(
        OptimizerState(iteration=job.iteration, rank=ctx.rank, world_size=ctx.world_size,
                       strategy=ctx.strategy.value, step=step, optimizer=sd),
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
    model.to(ctx.device)
    model.config.use_cache = False  # no KV cache while training
    return model, tokenizer


def wrap_model(model: Any, ctx: DistContext, *, trainable: bool) -> Any:
    """DDP (gloo/nccl) or FSDP2 fully_shard with bf16 compute, fp32 reduce."""
    if not ctx.is_distributed:
        return model
    if ctx.strategy == Strategy.FSDP2:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
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


def forward_logprobs(model: Any, packed: grpo.PackedBatch, device: torch.device) -> Tensor:
    out = model(
        input_ids=packed.input_ids.to(device),
        attention_mask=packed.attention_mask.to(device),
        use_cache=False,
    )
    return grpo.token_logprobs(out.logits, packed.input_ids.to(device)).cpu()


def micro_batches(indices: Sequence[int], size: int, count: int) -> list[list[int]]:
    out = [list(indices[i * size : (i + 1) * size]) for i in range(count)]
    return out


def policy_logprobs(
    model: Any, batch: TrainBatch, own: Sequence[int], ctx: DistContext, config: TrainConfig, pad_id: int
) -> dict[int, Tensor]:
    """Per-response-token log-probs of `own` samples under `model`, without grad.

    All ranks run the same number of forwards (FSDP2 all-gathers inside).
    """
    longest = max(len(shard(batch.size, ctx.world_size, r)) for r in range(ctx.world_size))
    count = max(1, math.ceil(longest / config.micro_batch_size))
    out: dict[int, Tensor] = {}
    with torch.no_grad():
        for chunk in micro_batches(own, config.micro_batch_size, count):
            real = bool(chunk)
            idx = chunk if real else [0]  # a throwaway forward keeps collectives in step
            packed = grpo.collate(
                [batch.prompt_ids[i] for i in idx], [batch.response_ids[i] for i in idx], pad_id=pad_id
            )
            logp = forward_logprobs(model, packed, ctx.device)
            if real:
                for i, values in zip(idx, grpo.extract_response_values(logp, packed), strict=True):
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


def run(job: TrainJob, ctx: DistContext) -> dict[str, Any]:
    """Train one iteration and publish its outputs; returns the metrics (all ranks)."""
    started = time.monotonic()
    config = job.config
    set_determinism(config.seed * 1_000_003 + job.iteration)
    batch = load_batch(job.batch_path)
    log.info("batch %s: %d samples, %d response tokens", job.batch_path, batch.size, batch.num_response_tokens)

    model, tokenizer = load_model(job.model_dir, ctx)
    vocab = model.get_input_embeddings().num_embeddings
    batch.check_vocab(vocab, source=job.batch_path)
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
    restored_step = restore_optimizer(optimizer, job, ctx)

    advantages = grpo.group_advantages(batch.rewards, batch.group_index, eps=config.adv_eps)
    own = shard(batch.size, ctx.world_size, ctx.rank)

    # The PPO "old" policy is the current weights, recomputed here; the
    # engine's log-probs differ by kernels and precision and are only compared.
    old = policy_logprobs(wrapped, batch, own, ctx, config, pad_id)
    mismatch_sum = sum(float((old[i] - batch.old_logprobs[i]).abs().sum()) for i in own)
    mismatch_max = max((float((old[i] - batch.old_logprobs[i]).abs().max()) for i in own if old[i].numel()), default=0.0)
    ref: dict[int, Tensor] | None = None
    if config.kl_coef > 0:
        assert job.ref_model_dir is not None  # TrainJob enforces it
        ref_model, _ = load_model(job.ref_model_dir, ctx)
        ref_model.eval()
        ref = policy_logprobs(wrap_model(ref_model, ctx, trainable=False), batch, own, ctx, config, pad_id)
        del ref_model
    log.info("old log-probs ready (engine mismatch mean %.4g)", mismatch_sum / max(1, batch.num_response_tokens))

    steps = plan_steps(batch.response_lens, world=ctx.world_size, config=config, iteration=job.iteration)
    totals = dict(policy=0.0, kl=0.0, clipped=0.0, ratio=0.0, tokens=0.0)
    step_losses: list[float] = []
    grad_norms: list[float] = []
    for number, step in enumerate(steps, start=1):
        optimizer.zero_grad(set_to_none=True)
        sums = [0.0] * 5
        mine = step.micro[ctx.rank]
        for m, chunk in enumerate(mine):
            real = bool(chunk)
            idx = list(chunk) if real else [own[0] if own else 0]
            packed = grpo.collate(
                [batch.prompt_ids[i] for i in idx], [batch.response_ids[i] for i in idx], pad_id=pad_id
            )
            with grad_sync(wrapped, ctx, enabled=m == len(mine) - 1):
                out = wrapped(
                    input_ids=packed.input_ids.to(ctx.device),
                    attention_mask=packed.attention_mask.to(ctx.device),
                    use_cache=False,
                )
                logp = grpo.token_logprobs(out.logits, packed.input_ids.to(ctx.device))
                mask = packed.response_mask.to(ctx.device)
                if real:
                    old_t = grpo.place_response_values([old[i] for i in idx], packed).to(ctx.device)
                else:
                    old_t = logp.detach()
                ref_t = None
                if ref is not None and real:
                    ref_t = grpo.place_response_values([ref[i] for i in idx], packed).to(ctx.device)
                terms = grpo.grpo_loss(
                    logp, old_t, advantages[idx].to(ctx.device), mask,
                    clip_eps=config.clip_eps, normalizer=max(step.tokens, 1),
                    ref_logp=ref_t, kl_coef=config.kl_coef,
                )
                # DDP and FSDP2 average gradients over ranks; the normaliser
                # already counts every rank's tokens, so undo the average.
                weight = float(ctx.world_size) if real else 0.0
                (terms.loss * weight).backward()
            if real:
                for k, v in enumerate((terms.policy_sum, terms.kl_sum, terms.clipped_tokens, terms.ratio_sum, terms.tokens)):
                    sums[k] += float(v)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(wrapped.parameters(), config.max_grad_norm))
        if not math.isfinite(grad_norm):
            raise TrainError(
                f"step {number}: gradient norm is {grad_norm}: lower lr (now {config.lr}) "
                "or check the batch's rewards"
            )
        optimizer.step()
        sums = all_reduce(sums, ctx)
        loss = (sums[0] + config.kl_coef * sums[1]) / max(step.tokens, 1)
        step_losses.append(loss)
        grad_norms.append(grad_norm)
        for key, value in zip(totals, sums, strict=True):
            totals[key] += value
        log.info("step %d/%d loss %.5f grad_norm %.4f", number, len(steps), loss, grad_norm)

    agg = all_reduce([mismatch_sum], ctx)[0]
    agg_max = all_reduce([mismatch_max], ctx, dist.ReduceOp.MAX if ctx.is_distributed else None)[0]
    tokens_seen = max(totals["tokens"], 1.0)
    metrics: dict[str, Any] = {
        "schema": METRICS_SCHEMA,
        "version": METRICS_VERSION,
        "iteration": job.iteration,
        "world_size": ctx.world_size,
        "strategy": ctx.strategy.value,
        "samples": batch.size,
        "tokens": batch.num_response_tokens,
        "steps": len(steps),
        "loss": (totals["policy"] + config.kl_coef * totals["kl"]) / tokens_seen,
        "loss_per_step": step_losses,
        "kl": totals["kl"] / tokens_seen,
        "grad_norm": sum(grad_norms) / len(grad_norms),
        "grad_norm_per_step": grad_norms,
        "clip_fraction": totals["clipped"] / tokens_seen,
        "ratio_mean": totals["ratio"] / tokens_seen,
        "lr": optimizer.param_groups[0]["lr"],
        "reward_mean": float(batch.rewards.mean()),
        "advantage_mean": float(advantages.mean()),
        "advantage_abs_mean": float(advantages.abs().mean()),
        "logprob_mismatch_mean_abs": agg / max(1, batch.num_response_tokens),
        "logprob_mismatch_max_abs": agg_max,
        "optimizer_step_start": restored_step,
        "optimizer_step_end": restored_step + len(steps),
    }

    finish(job, ctx, wrapped, tokenizer, optimizer, metrics, started)
    return metrics


def gathered_state(model: Any, ctx: DistContext) -> dict[str, Tensor] | None:
    """Full CPU state dict for saving (FSDP2 needs every rank to take part)."""
    if ctx.is_distributed and ctx.strategy == Strategy.FSDP2:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
    return None


def finish(
    job: TrainJob, ctx: DistContext, model: Any, tokenizer: Any, optimizer: Any,
    metrics: dict[str, Any], started: float,
) -> None:
    digest = param_digest(model)
    log.info("params sha256 %s", digest)
    full_state = gathered_state(model, ctx)
    save_optimizer(optimizer, job, ctx, metrics["optimizer_step_end"])
    if ctx.is_distributed:
        dist.barrier()  # every rank's optimizer state is durable before the checkpoint appears
    if ctx.rank == 0:
        inner = unwrap(model)
        manifest = publish_checkpoint(
            inner, None, job.out_dir, iteration=job.iteration, state_dict=full_state,
            carry_files_from=job.model_dir,
        )
        metrics["checkpoint_digest"] = manifest.digest
        metrics["params_sha256"] = digest
        metrics["seconds"] = time.monotonic() - started
        publish_bytes(job.metrics_path, (json.dumps(metrics, indent=2) + "\n").encode())
        log.info("published %s (manifest %s) in %.1f s", job.out_dir, manifest.digest, metrics["seconds"])
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
    parser = argparse.ArgumentParser(prog="python -m trainer.train", description=__doc__.split("\n")[0])
    parser.add_argument("--job", type=Path, required=True, help="train job JSON (trainer.config.TrainJob)")
    args = parser.parse_args(argv)
    die_with_parent()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    _setup_logging(rank, world, "?")
    ctx: DistContext | None = None
    try:
        job = TrainJob.load(args.job)
        _setup_logging(rank, world, job.iteration)
        ctx = init_distributed(job.config)
        log.info("start: %s on %s, strategy %s", args.job, ctx.device, ctx.strategy.value)
        run(job, ctx)
    except TrainerError as exc:
        log.error("failed: %s", exc)
        print(f"trainer: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except Exception as exc:
        log.exception("failed with an unexpected error")
        print(f"trainer: unexpected error: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
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
