"""Process-group plumbing for one training iteration under torchrun.

Everything here is collective-aware: joining the group and choosing device,
strategy and compute dtype (`init_distributed`), summing scalars over ranks
(`all_reduce`), wrapping the model for DDP or FSDP2 (`wrap_model`) and
skipping gradient sync between micro-batches (`grad_sync`).  Loading and saving
an FSDP2 model shard by shard: sharded_load.py, sharded_save.py.  A single
process (WORLD_SIZE unset or 1) runs the same code with every collective a no-op.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from trainer.config import Device, DType, Strategy, TrainConfig
from trainer.errors import TrainError

log = logging.getLogger("trainer")

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


def env_int(name: str, default: int) -> int:
    """An integer torchrun put in the environment, or `default` when it is unset."""
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
    world = env_int("WORLD_SIZE", 1)
    rank = env_int("RANK", 0)
    local_rank = env_int("LOCAL_RANK", 0)
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


def exit_rank(code: int) -> NoReturn:
    """End this rank's process with `code`: leave the process group, flush the logs and
    the standard streams, then `os._exit`, never Python's interpreter shutdown.

    Why not a plain exit: gloo's worker threads free a finished collective after it
    returned, and freeing a tensor that a Python object holds takes the GIL.  A worker
    that asks for the GIL once the main thread is finalizing the interpreter is ended
    by Python inside a C++ destructor, and the C++ runtime aborts the process: SIGABRT,
    "terminate called without an active exception", after every step succeeded, so
    torchrun reports the rank failed.  Seen in CI and in 1 of about 175 three-rank
    saves here; the core showed ProcessGroupGloo::runLoop freeing an AsyncBarrierWork,
    blocked in take_gil, while the main thread ran Py_FinalizeEx (PyTorch has no fix:
    pytorch/pytorch#179291 was abandoned).  `os._exit` ends every thread at once: the
    code that writes a rank's files closes them (what was written stays with the
    kernel, however the process ends), and a trainer registers no atexit handler."""
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except dist.DistError:  # a peer already gone (its connection reset, its store
            # closed): logged, and the exit code, which says what failed first, is kept.
            # Anything else propagates: a traceback and exit 1, loudly.
            log.warning("leaving the process group failed", exc_info=True)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        # The reader of a pipe gone (BrokenPipeError) or the stream closed (ValueError):
        # nothing is left to tell, and the exit code still says what happened.
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def all_reduce(values: Sequence[float], ctx: DistContext, op: Any = None) -> list[float]:
    if not ctx.is_distributed:
        return list(values)
    t = torch.tensor(list(values), dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return t.tolist()


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

    # find_unused_parameters keeps the reducer's buckets as they were built: by default
    # DDP rebuilds them after the first step, in the order gradients became ready, and
    # with 3+ ranks another layout sums ranks in another order.  A resident trainer's
    # later iterations would then differ in the last bits from the same iterations
    # trained (or replayed) by a trainer started for them; with fixed buckets both
    # give the same weights (tests/integration/test_resident_trainer.py).  The cost is
    # one walk of the autograd graph per backward.
    return DistributedDataParallel(
        model, device_ids=[ctx.local_rank] if ctx.device.type == "cuda" else None,
        find_unused_parameters=True,
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
