"""What one training iteration is told to do: the hyper-parameters and the job.

`TrainConfig` holds the hyper-parameters, fixed for a run.  `TrainJob` holds
one iteration's inputs and outputs (which checkpoint to start from, which
batch to learn from, where to put the result); the coordinator writes it as
JSON and `python -m trainer.train --job JOB.json` reads it on every rank.

Both are frozen, keyword-only and validated on construction, so a bad value
fails before any process group or model is created.  The job file is a
versioned record parsed strictly: a wrong type or a missing field is an error
naming the field; unknown fields are ignored so that newer writers can add
fields without breaking older readers.
"""

from __future__ import annotations

import enum
import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Final

from coordinator.fsio import publish_bytes
from coordinator.store import read_document

JOB_SCHEMA: Final = "coordinator/train-job"
JOB_VERSION: Final = 1


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


class Strategy(str, enum.Enum):
    AUTO = "auto"  # ddp on cpu (gloo), fsdp2 on cuda (nccl)
    DDP = "ddp"
    FSDP2 = "fsdp2"


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _finite(name: str, value: float) -> None:
    _check(
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

    def __post_init__(self) -> None:
        for name in ("lr", "adam_eps", "weight_decay", "clip_eps", "kl_coef", "adv_eps"):
            _finite(name, getattr(self, name))
        _check(self.lr > 0, f"lr={self.lr} is not positive: give a learning rate such as 1e-3")
        _check(
            isinstance(self.betas, tuple)
            and len(self.betas) == 2
            and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in self.betas),
            f"betas={self.betas!r} must be two numbers in [0, 1), e.g. (0.9, 0.99)",
        )
        _check(self.adam_eps > 0, f"adam_eps={self.adam_eps} must be > 0, e.g. 1e-8")
        _check(self.weight_decay >= 0, f"weight_decay={self.weight_decay} must be >= 0")
        _check(
            0 < self.clip_eps < 1,
            f"clip_eps={self.clip_eps} must be in (0, 1): PPO uses about 0.2",
        )
        _check(self.kl_coef >= 0, f"kl_coef={self.kl_coef} must be >= 0 (0 turns KL off)")
        _check(self.adv_eps > 0, f"adv_eps={self.adv_eps} must be > 0, e.g. 1e-6")
        for name, low in (
            ("micro_batch_size", 1),
            ("mini_batch_size", 0),
            ("epochs", 1),
            ("warmup_steps", 0),
        ):
            value = getattr(self, name)
            _check(
                isinstance(value, int) and not isinstance(value, bool) and value >= low,
                f"{name}={value!r} must be an integer >= {low}",
            )
        _check(
            isinstance(self.seed, int) and not isinstance(self.seed, bool) and self.seed >= 0,
            f"seed={self.seed!r} must be an integer >= 0",
        )
        _finite("max_grad_norm", self.max_grad_norm)
        _check(
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
        ):
            value = getattr(self, name)
            try:
                object.__setattr__(self, name, kind(value))
            except ValueError:
                allowed = ", ".join(k.value for k in kind)
                raise ConfigError(f"{name}={value!r} is not one of: {allowed}") from None
        _check(self.param_dtype in (DType.FLOAT32, DType.BFLOAT16),
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
        for name in ("device", "dtype", "strategy", "loss_agg", "param_dtype"):
            out[name] = getattr(self, name).value
        return out

    @classmethod
    def from_dict(cls, data: Any) -> TrainConfig:
        _check(isinstance(data, dict), f"config must be a JSON object, got {type(data).__name__}")
        kwargs: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in data:
                continue  # missing hyper-parameters take their defaults
            value = data[f.name]
            if f.name == "betas":
                _check(
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
                _check(
                    type(value) is type(f.default),
                    f"config.{f.name}={value!r} has type {type(value).__name__}: "
                    f"give a {type(f.default).__name__}",
                )
            kwargs[f.name] = value
        return cls(**kwargs)


def _path_field(data: dict[str, Any], name: str, *, run_dir: Path | None,
                optional: bool = False) -> Path | None:
    """A job path: relative to the run directory (each node resolves it against its
    own mount), or absolute for a model outside the run directory."""
    if name not in data:
        raise ConfigError(f"train job is missing field {name!r}: the coordinator must set it")
    value = data[name]
    if value is None and optional:
        return None
    _check(
        isinstance(value, str) and value != "" and "\0" not in value,
        f"train job field {name}={value!r} must be a non-empty path string",
    )
    path = Path(value)
    if path.is_absolute():
        return path
    _check(".." not in path.parts,
           f"train job field {name}={value!r} climbs out of the run directory with '..'")
    _check(run_dir is not None,
           f"train job field {name}={value!r} is relative to the run directory, but no run "
           "directory is known: start the trainer from the coordinator")
    return run_dir / path  # type: ignore[operator]


@dataclass(frozen=True, kw_only=True)
class TrainJob:
    """One iteration's inputs and outputs.

    `ref_model_dir` may be None only when `config.kl_coef` is 0.  `optim_dir`
    holds one optimizer-state file per rank, read at the start when present
    and written at the end, so Adam's moments carry across iterations.
    """

    iteration: int
    model_dir: Path
    ref_model_dir: Path | None
    batch_path: Path
    out_dir: Path
    optim_dir: Path
    metrics_path: Path
    config: TrainConfig = field(default_factory=TrainConfig)
    # The batch as the master published it: the trainer loads it only if it
    # still has exactly this size and SHA-256 (None: not checked, for tests
    # and standalone use).
    batch_bytes: int | None = None
    batch_sha256: str | None = None

    def __post_init__(self) -> None:
        _check(
            isinstance(self.iteration, int)
            and not isinstance(self.iteration, bool)
            and self.iteration >= 0,
            f"iteration={self.iteration!r} must be an integer >= 0",
        )
        for name in ("model_dir", "batch_path", "out_dir", "optim_dir", "metrics_path"):
            _check(isinstance(getattr(self, name), Path), f"{name} must be a pathlib.Path")
        _check(
            self.ref_model_dir is None or isinstance(self.ref_model_dir, Path),
            "ref_model_dir must be a pathlib.Path or None",
        )
        _check(
            self.ref_model_dir is not None or self.config.kl_coef == 0,
            f"kl_coef={self.config.kl_coef} needs a reference model: set ref_model_dir "
            "(usually the initial checkpoint) or set kl_coef=0",
        )
        _check(
            self.out_dir.resolve() != self.model_dir.resolve(),
            f"out_dir {self.out_dir} is the input model_dir: give each iteration a new directory",
        )
        _check(
            (self.batch_bytes is None) == (self.batch_sha256 is None)
            and (self.batch_bytes is None or (type(self.batch_bytes) is int
                                              and self.batch_bytes >= 0))
            and (self.batch_sha256 is None or (isinstance(self.batch_sha256, str)
                                               and len(self.batch_sha256) == 64)),
            f"batch_bytes={self.batch_bytes!r} and batch_sha256={self.batch_sha256!r} must be "
            "given together: a byte count and 64 hex digits",
        )

    def check_writes_inside(self, run_dir: Path) -> None:
        """Every path training writes must lie inside the run directory.

        The job file sits in the run directory, which others can write: a
        forged job must not make a trainer write anywhere else.
        """
        root = os.path.normpath(os.path.abspath(run_dir))
        for name in ("out_dir", "optim_dir", "metrics_path"):
            path = os.path.abspath(getattr(self, name))
            _check(
                ".." not in Path(getattr(self, name)).parts
                and os.path.commonpath([root, path]) == root and path != root,
                f"train job field {name}={str(getattr(self, name))!r} is not inside the run "
                f"directory {root}: the job file is forged or from another run",
            )

    def to_json(self, run_dir: Path | None = None) -> str:
        """The job file; paths inside `run_dir` are written relative to it, so that
        every node resolves them against its own mount of the run directory."""
        data: dict[str, Any] = {"schema": JOB_SCHEMA, "version": JOB_VERSION}
        data["iteration"] = self.iteration
        for name in (
            "model_dir",
            "ref_model_dir",
            "batch_path",
            "out_dir",
            "optim_dir",
            "metrics_path",
        ):
            value = getattr(self, name)
            if value is not None and run_dir is not None and value.is_relative_to(run_dir):
                value = value.relative_to(run_dir)
            data[name] = None if value is None else value.as_posix()
        data["config"] = self.config.to_dict()
        data["batch_bytes"] = self.batch_bytes
        data["batch_sha256"] = self.batch_sha256
        return json.dumps(data, indent=2, sort_keys=False) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, *, source: str = "<job>",
                  run_dir: Path | None = None) -> TrainJob:
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"train job {source} is not valid JSON: {exc}") from exc
        _check(isinstance(data, dict), f"train job {source} must be a JSON object")
        _check(
            data.get("schema") == JOB_SCHEMA,
            f"train job {source} has schema {data.get('schema')!r}, expected {JOB_SCHEMA!r}",
        )
        _check(
            data.get("version") == JOB_VERSION,
            f"train job {source} has version {data.get('version')!r}; this trainer reads "
            f"version {JOB_VERSION}: run matching coordinator and trainer versions",
        )
        try:
            return cls(
                iteration=data.get("iteration"),  # type: ignore[arg-type]  # checked in __post_init__
                model_dir=_path_field(data, "model_dir", run_dir=run_dir),  # type: ignore[arg-type]
                ref_model_dir=_path_field(data, "ref_model_dir", run_dir=run_dir, optional=True),
                batch_path=_path_field(data, "batch_path", run_dir=run_dir),  # type: ignore[arg-type]
                out_dir=_path_field(data, "out_dir", run_dir=run_dir),  # type: ignore[arg-type]
                optim_dir=_path_field(data, "optim_dir", run_dir=run_dir),  # type: ignore[arg-type]
                metrics_path=_path_field(data, "metrics_path", run_dir=run_dir),  # type: ignore[arg-type]
                config=TrainConfig.from_dict(data.get("config", {})),
                batch_bytes=data.get("batch_bytes"),
                batch_sha256=data.get("batch_sha256"),
            )
        except ConfigError as exc:
            raise ConfigError(f"train job {source}: {exc}") from exc

    def save(self, path: Path, *, run_dir: Path | None = None) -> None:
        publish_bytes(path, self.to_json(run_dir).encode())

    @classmethod
    def load(cls, path: Path, *, run_dir: Path | None = None) -> TrainJob:
        """Read with the run directory's reader: a torn read is retried, never trusted.

        Relative paths resolve against `run_dir`, this node's mount of the run.
        """
        try:
            job = read_document(path, lambda raw, where: cls.from_json(
                raw, source=str(where), run_dir=run_dir))
        except OSError as exc:
            raise ConfigError(f"cannot read train job {path}: {exc}") from exc
        except ValueError as exc:  # a file planted where the job belongs, too big, ...
            raise ConfigError(f"train job {path}: {exc}") from exc
        if job is None:
            raise ConfigError(f"train job {path} does not exist: phase 8 writes it")
        return job
