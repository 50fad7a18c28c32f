"""The trainer's hyper-parameters, fixed for a run (`TrainConfig`, the [train] section).

Frozen, keyword-only and validated on construction, so a bad value fails
before any process group or model is created.  One iteration's job (which
model, which batch, where the results go) is trainer/job.py's `TrainJob`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, ClassVar, Final

from coordinator.config.run_config import to_plain
from coordinator.config.settings import Section, from_mapping, setting
from coordinator.errors import UsageError

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


class ParamDType(str, enum.Enum):
    """The parameters' own dtype (train.param_dtype): no "auto", which is compute's."""

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


@dataclass(frozen=True, kw_only=True)
class TrainConfig(Section):
    """GRPO hyper-parameters.

    Defaults suit a 1.5-8 B instruct model on GPUs (the learning rates and
    batch sizes GRPO recipes for such models use); the tiny demo model's own
    values (lr 3e-4, 3 epochs, 48 warm-up steps, batches of 128) are in
    rl/config.py's TINY_MODEL_DEFAULTS.
    """

    SECTION: ClassVar[str] = "train"

    lr: float = setting(1e-6, "Peak learning rate of AdamW.", gt=0, aliases=("learning_rate",))
    betas: tuple[float, float] = setting((0.9, 0.99), "AdamW's beta1 and beta2.", ge=0, lt=1)
    adam_eps: float = setting(1e-8, "AdamW's epsilon.", gt=0)
    weight_decay: float = setting(0.0, "AdamW's decoupled weight decay.", ge=0)
    clip_eps: float = setting(
        0.2, "PPO ratio clip: the ratio new/old is kept in [1 - clip_eps, 1 + clip_eps].",
        gt=0, lt=1)
    # 0 also skips loading the reference model altogether.
    kl_coef: float = setting(
        0.0, "Weight of the k3 KL estimate to the reference model in the loss (0: off, and "
        "no reference model is loaded).", ge=0)
    tis_cap: float = setting(
        2.0, "Asynchronous runs: each token's loss is weighted by min(pi_old / pi_behaviour, "
        "tis_cap), the truncated importance ratio between trainer and engine.", ge=1)
    # Without it a group of equal rewards would give advantages of 0/0.
    adv_eps: float = setting(
        1e-6, "Added to a group's reward std, so equal rewards give advantages of exactly 0.",
        gt=0)
    loss_agg: LossAgg = setting(
        LossAgg.SEQ_MEAN_TOKEN_MEAN, "How per-token losses are averaged over a step: "
        "token-mean (every token weighs the same, DAPO) or seq-mean-token-mean (every "
        "response does, the GRPO paper).")
    micro_batch_size: int = setting(8, "Samples per forward pass on one rank.", unit="samples",
                                    ge=1)
    mini_batch_size: int = setting(
        256, "Samples (over all ranks, not prompts) per optimizer step; 0: the whole batch, "
        "one step per epoch. Gradient accumulation is derived from it.", unit="samples", ge=0)
    epochs: int = setting(1, "Passes over the batch per iteration; each pass reshuffles.",
                          ge=1)
    max_grad_norm: float = setting(1.0, "Gradient norm clip.", gt=0)
    # Adam's first steps move every weight by about lr whatever its gradient,
    # which on a small model undoes the warm start; ramping lr avoids that shock.
    warmup_steps: int = setting(
        10, "Linear lr warm-up over the run's first optimizer steps (counted across "
        "iterations).", unit="steps", ge=0)
    seed: int = setting(0, "Seed of the trainer's shuffles.", ge=0)
    device: Device = setting(Device.AUTO, "Where training runs: auto (cuda when available), "
                             "cpu or cuda.")
    dtype: DType = setting(DType.AUTO, "Compute dtype: auto (float32 on cpu; bfloat16 "
                           "compute with fp32 master weights on cuda), float32 or bfloat16.")
    strategy: Strategy = setting(Strategy.AUTO, "Data parallelism: auto (ddp on cpu with "
                                 "gloo, fsdp2 on cuda with nccl), ddp or fsdp2.")
    activation_checkpointing: bool = setting(
        False, "Recompute each decoder layer's activations in the backward pass: less memory "
        "for long responses, about a third more compute.")
    param_dtype: ParamDType = setting(
        ParamDType.FLOAT32, "The parameters' dtype: float32, or bfloat16 with the optimizer's "
        "copies and moments in float32 (trainer/master_weights.py).")
    # A trainer lost in between resumes from the last saved state and trains the
    # iterations since then again from their kept batches.
    save_interval: int = setting(
        5, "Save the resumable training state (weights, optimizer, step) every this many "
        "iterations and at the last; the policy is published every iteration regardless.",
        unit="iterations", ge=1)
    offload: Offload = setting(
        Offload.AUTO, "Where a resident trainer keeps weights and optimizer between jobs: "
        "auto (CPU memory when training on a GPU), on, or off (stay on the accelerator).")

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step `step` (1-based, counted over the whole run)."""
        if self.warmup_steps == 0:
            return self.lr
        return self.lr * min(1.0, step / self.warmup_steps)

    def to_dict(self) -> dict[str, Any]:
        return dict(to_plain(self))

    @classmethod
    def from_dict(cls, data: Any) -> TrainConfig:
        """From a train job's JSON (or [train]), strictly: a typo would otherwise train
        at the default (train.lrr=1e-5 at lr 1e-6)."""
        check(isinstance(data, dict), f"config must be a JSON object, got {type(data).__name__}")
        try:
            return from_mapping(cls, data, "train")
        except UsageError as exc:
            raise ConfigError(str(exc)) from None
