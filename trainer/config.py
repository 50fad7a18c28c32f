"""The trainer's hyper-parameters, fixed for a run (`TrainConfig`, the [train] section).

Frozen, keyword-only and validated on construction, so a bad value fails
before any process group or model is created.  One iteration's job (which
model, which batch, where the results go) is trainer/job.py's `TrainJob`.
"""

from __future__ import annotations

import enum
import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Final

from coordinator.config import unknown_setting

# Supervised steps of the tiny model's warm start (trainer/warmstart.py): 70
# give a sampled accuracy of 12-20 % on the built-in task's eval prompts over
# model seeds 0-4 (65 give 7-15 %, 75 give 15-23 %), measured on prompts the
# warm start never trained on: low enough that RL can double it within 8
# iterations, high enough that most groups of 16 samples hold a right answer.
# Here, not in warmstart.py, so that the settings can name it without torch.
WARMSTART_STEPS: Final = 70


class TrainerError(Exception):
    """Root of the trainer package's own errors.

    An unusable checkpoint is a rollout.errors.CheckpointError instead, the one
    class every package uses for it; `python -m trainer.train` reports both.
    """


class ConfigError(TrainerError, ValueError):
    """A config or job value breaks a rule; the message says which and how to fix it."""


class Device(str, enum.Enum):
    AUTO = "auto"  # cuda when available, else cpu
    CPU = "cpu"
    CUDA = "cuda"


class DType(str, enum.Enum):
    AUTO = "auto"  # float32 on cpu; bfloat16 compute (fp32 master weights) on cuda
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"


class LossAgg(str, enum.Enum):
    """How per-token losses are averaged over a step."""

    TOKEN_MEAN = "token-mean"  # every response token weighs the same (DAPO)
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"  # every response weighs the same (GRPO paper)


class Offload(str, enum.Enum):
    """Where a resident trainer keeps its weights and optimizer between jobs."""

    AUTO = "auto"  # CPU memory while training runs on a GPU; nothing moves on a CPU
    ON = "on"
    OFF = "off"  # stay on the accelerator (only if the engine fits beside them)


class Strategy(str, enum.Enum):
    AUTO = "auto"  # ddp on cpu (gloo), fsdp2 on cuda (nccl)
    DDP = "ddp"
    FSDP2 = "fsdp2"


def check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _finite(name: str, value: float) -> None:
    check(
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
        f"{name}={value!r} is not a finite number: give a real number",
    )


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """GRPO hyper-parameters.

    Defaults suit a 1.5-8 B instruct model on GPUs (the learning rates and
    batch sizes GRPO recipes for such models use); the tiny demo model's own
    values (lr 3e-4, 3 epochs, 48 warm-up steps, batches of 128) are in
    rl/demo.py's config and tests/trainer/test_rl_reward_rises.py.
    """

    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.99)
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    # PPO ratio clip: the ratio new/old is kept in [1 - clip_eps, 1 + clip_eps].
    clip_eps: float = 0.2
    # Weight of the k3 KL estimate to the reference model; 0 turns it off and
    # skips loading the reference model altogether.
    kl_coef: float = 0.0
    # Asynchronous runs (run.max_off_policy_steps >= 1): each token's loss is
    # weighted by min(pi_old / pi_behaviour, tis_cap), the truncated importance
    # ratio between the trainer's recomputed log-probs and the engine's.
    tis_cap: float = 2.0
    # Added to the group's reward std so that a group of equal rewards gives
    # advantages of exactly 0 rather than 0/0.
    adv_eps: float = 1e-6
    loss_agg: LossAgg = LossAgg.SEQ_MEAN_TOKEN_MEAN
    # Samples per forward pass on one rank.
    micro_batch_size: int = 8
    # Samples (over all ranks) per optimizer step; 0 means the whole batch, one
    # step per epoch.  Gradient accumulation is derived from it.
    mini_batch_size: int = 256
    # Passes over the batch per iteration; each pass reshuffles.
    epochs: int = 1
    max_grad_norm: float = 1.0
    # Linear lr warm-up over the first optimizer steps of the run (counted
    # across iterations through the saved optimizer state).  Adam's first
    # steps move every weight by about lr whatever its gradient, which on a
    # small model undoes the warm start; ramping lr avoids that shock.
    warmup_steps: int = 10
    seed: int = 0
    device: Device = Device.AUTO
    dtype: DType = DType.AUTO
    strategy: Strategy = Strategy.AUTO
    # Recompute each decoder layer's activations in the backward pass instead of
    # keeping them: less memory for long responses, about a third more compute.
    activation_checkpointing: bool = False
    # The parameters' dtype: float32, or bfloat16 with the optimizer's copies and
    # moments in float32 (trainer/master_weights.py); the checkpoint holds it too.
    param_dtype: DType = DType.FLOAT32
    # The resumable training state (weights, optimizer, step) goes to the run
    # directory every save_interval iterations and at the run's last one; the
    # policy checkpoint is published every iteration regardless.  A trainer
    # lost in between resumes from the last saved state and trains the
    # iterations since then again from their kept batches (at most
    # save_interval - 1 of them).  1 saves every iteration.
    save_interval: int = 5
    # Between training phases a resident trainer moves its weights, gradients
    # and optimizer state to CPU memory, so the inference engine has the GPU.
    offload: Offload = Offload.AUTO

    def __post_init__(self) -> None:
        for name in ("lr", "adam_eps", "weight_decay", "clip_eps", "kl_coef", "adv_eps"):
            _finite(name, getattr(self, name))
        check(self.lr > 0, f"lr={self.lr} is not positive: give a learning rate such as 1e-3")
        check(
            isinstance(self.betas, tuple)
            and len(self.betas) == 2
            and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in self.betas),
            f"betas={self.betas!r} must be two numbers in [0, 1), e.g. (0.9, 0.99)",
        )
        check(self.adam_eps > 0, f"adam_eps={self.adam_eps} must be > 0, e.g. 1e-8")
        check(self.weight_decay >= 0, f"weight_decay={self.weight_decay} must be >= 0")
        check(
            0 < self.clip_eps < 1,
            f"clip_eps={self.clip_eps} must be in (0, 1): PPO uses about 0.2",
        )
        check(self.kl_coef >= 0, f"kl_coef={self.kl_coef} must be >= 0 (0 turns KL off)")
        check(math.isfinite(self.tis_cap) and self.tis_cap >= 1,
              f"tis_cap={self.tis_cap} must be a number >= 1: the most one token's importance "
              "weight may count, e.g. 2.0")
        check(self.adv_eps > 0, f"adv_eps={self.adv_eps} must be > 0, e.g. 1e-6")
        for name, low in (
            ("micro_batch_size", 1),
            ("mini_batch_size", 0),
            ("epochs", 1),
            ("warmup_steps", 0),
            ("save_interval", 1),
        ):
            value = getattr(self, name)
            check(
                isinstance(value, int) and not isinstance(value, bool) and value >= low,
                f"{name}={value!r} must be an integer >= {low}",
            )
        check(
            isinstance(self.seed, int) and not isinstance(self.seed, bool) and self.seed >= 0,
            f"seed={self.seed!r} must be an integer >= 0",
        )
        _finite("max_grad_norm", self.max_grad_norm)
        check(
            self.max_grad_norm > 0,
            f"max_grad_norm={self.max_grad_norm} must be > 0, e.g. 1.0",
        )
        # Accept the enum values as plain strings too (JSON, CLI), and say
        # what is allowed when a value is not one of them.
        for name, kind in (
            ("device", Device),
            ("dtype", DType),
            ("strategy", Strategy),
            ("loss_agg", LossAgg),
            ("param_dtype", DType),
            ("offload", Offload),
        ):
            value = getattr(self, name)
            try:
                object.__setattr__(self, name, kind(value))
            except ValueError:
                allowed = ", ".join(k.value for k in kind)
                raise ConfigError(f"{name}={value!r} is not one of: {allowed}") from None
        check(self.param_dtype in (DType.FLOAT32, DType.BFLOAT16),
               f"param_dtype={self.param_dtype.value!r} is not float32 or bfloat16: give "
               "param_dtype = 'bfloat16' for bf16 parameters with fp32 optimizer state")

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step `step` (1-based, counted over the whole run)."""
        if self.warmup_steps == 0:
            return self.lr
        return self.lr * min(1.0, step / self.warmup_steps)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["betas"] = list(self.betas)
        for name in ("device", "dtype", "strategy", "loss_agg", "param_dtype", "offload"):
            out[name] = getattr(self, name).value
        return out

    @classmethod
    def from_dict(cls, data: Any) -> TrainConfig:
        check(isinstance(data, dict), f"config must be a JSON object, got {type(data).__name__}")
        names = [f.name for f in fields(cls)]
        for key in sorted(map(str, set(data) - set(names))):
            # A typo would otherwise train at the default (train.lrr=1e-5 at lr 1e-6).
            raise ConfigError(str(unknown_setting(f"train.{key}", "train", names)))
        kwargs: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in data:
                continue  # missing hyper-parameters take their defaults
            value = data[f.name]
            if f.name == "betas":
                check(
                    isinstance(value, list) and len(value) == 2,
                    f"config.betas={value!r} must be a list of two numbers",
                )
                value = (float(value[0]), float(value[1]))
            elif (
                isinstance(f.default, float)
                and isinstance(value, int)
                and not isinstance(value, bool)
            ):
                value = float(value)  # JSON writes 1.0 as 1 in some writers
            elif isinstance(f.default, (int, float)) and not isinstance(f.default, enum.Enum):
                check(
                    type(value) is type(f.default),
                    f"config.{f.name}={value!r} has type {type(value).__name__}: "
                    f"give a {type(f.default).__name__}",
                )
            kwargs[f.name] = value
        return cls(**kwargs)
