"""Configuration sections of the RL actions (`run.actions = "rl"`).

    [schedule]    which phases run, when to evaluate (rl/schedule.py)
    [model]       which model to start from
    [data]        where tasks come from, which reward
    [rollout]     sampling and checkpointing of the rollout
    [engine]      the inference server (rollout/engines/engine.py: EngineConfig)
    [train]       GRPO hyper-parameters (trainer/config.py: TrainConfig)
    [torchrun]    how phase 10 launches the trainer
    [checkpoint]  node-local cache and how many published checkpoints to keep

Every section is a frozen dataclass validated on construction; the master
writes the resolved sections (defaults filled in) into the run manifest.

The dataclass defaults suit a 1.5-8 B model on GPUs.  Without model.path the
run uses the tiny model the project builds (128 positions, answers of a few
characters): then TINY_MODEL_DEFAULTS take the place of the defaults that
depend on the model, under whatever the config and --set give, so the usage
line with no config at all runs and learns.  Settings the model or the tasks
bound are checked against them before any engine starts (rl/preflight.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Final

from coordinator.config import (
    CoordinationConfig,
    RunSection,
    UnknownSettingError,
    closest_name,
    deep_merge,
    from_mapping,
    to_plain,
    unknown_setting,
)
from coordinator.errors import UsageError
from rl.schedule import ScheduleSection, schedule_of
from rollout.engines.engine import EngineConfig
from trainer.config import WARMSTART_STEPS, ConfigError, TrainConfig

SECTIONS: Final = ("schedule", "model", "data", "rollout", "engine", "train", "torchrun",
                   "checkpoint", "metrics")

# Each node's own business, never written to run.json and never taken from it
# (docs/PROTOCOL.md, node-local keys): what a node executes and with which
# environment, secrets, and where its local disk is.  Each daemon reads them
# from its own --config and --set; the run directory cannot make a node run
# a program or leak a key.
NODE_LOCAL_KEYS: Final = (
    "engine.host",
    "engine.port",
    "engine.api_key",
    "engine.extra_args",
    "engine.env",
    "engine.cuda_visible_devices",
    "engine.vllm_executable",
    "engine.python_executable",
    "engine.device",
    "engine.threads",
    "engine.prewarm",
    "torchrun.extra_args",
    "checkpoint.local_cache",
    "checkpoint.keep_local_cache",
    # The agent plugin is code each node imports and runs: named by the node's
    # own config, never by run.json (phase 1 checks every rank ran the same).
    "rollout.agent",
)


@dataclass(frozen=True, kw_only=True)
class ModelSection:
    # A local Hugging Face causal LM directory; "" builds the tiny demo model
    # (with a short supervised warm start) under <log-path>/model-init.
    path: str = ""
    init_seed: int = 0
    warmstart_steps: int = WARMSTART_STEPS  # 12-20% sampled accuracy: room for RL to double it


@dataclass(frozen=True, kw_only=True)
class DataSection:
    path: str = "builtin:reverse"  # or a verl-style parquet / JSONL file or directory
    reward: str = ""  # "" picks the reward registered for the tasks' data_source
    seed: int = 0


@dataclass(frozen=True, kw_only=True)
class RolloutSection:
    """Defaults for a 1.5-8 B instruct model on GSM8K-like tasks; the demo's tiny
    values (6 tokens, 4 requests in flight) are in rl/demo.py's config."""

    group_size: int = 8  # samples per prompt (GRPO's group)
    tasks_per_iteration: int = 256  # 0: the whole train split every iteration
    max_tokens: int = 1024  # a reasoning answer; the engine's max_model_len bounds it too
    temperature: float = 1.0
    top_p: float = 1.0
    eval_tasks: int = 0  # 0: the whole eval split
    eval_group_size: int = 1
    eval_temperature: float = 0.0  # greedy: eval accuracy without sampling noise
    # A killed rank redoes at most this many groups, or this many seconds of
    # generation, whichever is less.
    checkpoint_every_groups: int = 32
    checkpoint_every_s: float = 60.0
    # Requests in flight; 0 keeps each engine replica's batch full: 64 per
    # data-parallel replica (engine.data_parallel_size).
    concurrency: int = 0
    request_retries: int = 3
    max_failed_fraction: float = 0.1  # more failed samples than this fail the phase
    # A train batch with fewer samples than this fraction of those rolled out
    # (tasks x group_size) fails phase 4 rather than train on scraps; an empty
    # batch always does.  Failed samples and groups left with too few answers
    # are what a batch loses.
    min_batch_fraction: float = 0.5
    progress_interval_s: float = 5.0
    keep_rank_files: bool = False  # rank trajectory files are removed once an iteration completes
    # An agent plugin ("package.module:Name", rollout/agents.py) that turns each
    # task into an episode; "" for built-in single-turn sampling.
    agent: str = ""
    episode_timeout_s: float = 600.0  # an agent's episode running longer fails

    def __post_init__(self) -> None:
        for name in ("group_size", "max_tokens", "eval_group_size", "checkpoint_every_groups"):
            if getattr(self, name) < 1:
                raise UsageError(f"rollout.{name}={getattr(self, name)} must be >= 1")
        if self.concurrency < 0:
            raise UsageError(f"rollout.concurrency={self.concurrency} is negative: give the "
                             "requests to keep in flight, or 0 for 64 per engine replica")
        if not self.episode_timeout_s > 0:
            raise UsageError(f"rollout.episode_timeout_s={self.episode_timeout_s} must be a "
                             "positive number of seconds")
        if self.agent and ":" not in self.agent:
            raise UsageError(f"rollout.agent={self.agent!r} must look like "
                             "'package.module:Name' (a class or a function)")
        if not self.checkpoint_every_s > 0:
            raise UsageError(f"rollout.checkpoint_every_s={self.checkpoint_every_s} must be a "
                             "positive number of seconds")
        if self.group_size < 2:
            raise UsageError(
                f"rollout.group_size={self.group_size} is below 2: GRPO normalises rewards "
                "within a group, so each prompt needs at least 2 samples (8 is typical)"
            )
        if self.tasks_per_iteration < 0 or self.eval_tasks < 0:
            raise UsageError("rollout.tasks_per_iteration and rollout.eval_tasks must be >= 0")
        for name in ("max_failed_fraction", "min_batch_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise UsageError(f"rollout.{name}={getattr(self, name)} must be within 0..1")


# Requests in flight per engine replica when rollout.concurrency is 0: enough
# to keep a vLLM replica's continuous batch full on one GPU group.
REQUESTS_PER_REPLICA = 64


def requests_in_flight(rollout: RolloutSection, engine: EngineConfig) -> int:
    return rollout.concurrency or REQUESTS_PER_REPLICA * engine.data_parallel_size


@dataclass(frozen=True, kw_only=True)
class TorchrunSection:
    nproc_per_node: int = 1
    wall_limit_s: float = 21600.0  # phase 10 fails after this long
    extra_args: tuple[str, ...] = ()
    # One torchrun group per session, kept between iterations (rl/trainer_host.py);
    # false starts one per iteration and saves the training state every time.
    resident: bool = True
    # After a job on a GPU the trainer may keep this much (its CUDA context, the
    # communicator's buffers) beside the engine; more, within release_timeout_s,
    # and its group is stopped so the engine has the GPU.
    offload_residual_mib: int = 3072
    release_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1:
            raise UsageError(f"torchrun.nproc_per_node={self.nproc_per_node} must be >= 1")
        if self.wall_limit_s <= 0:
            raise UsageError(f"torchrun.wall_limit_s={self.wall_limit_s} must be positive")
        if self.offload_residual_mib < 0 or not self.release_timeout_s > 0:
            raise UsageError("torchrun.offload_residual_mib must be >= 0 and "
                             "torchrun.release_timeout_s positive")


@dataclass(frozen=True, kw_only=True)
class CheckpointSection:
    # Node-local; the run's checkpoints go to <local_cache>/<run id>/, shared by the
    # daemons of one node under a node-local lock ("" means $TMPDIR/coordinator-<uid>,
    # rl/node_local.py).  The last daemon of the run on a node removes it as it
    # exits, unless keep_local_cache.
    local_cache: str = ""
    keep_local_cache: bool = False
    keep: int = 2  # published checkpoints kept (the initial model is never removed)

    def __post_init__(self) -> None:
        if self.keep < 1:
            raise UsageError(
                f"checkpoint.keep={self.keep} is below 1: the newest checkpoint is the policy "
                "the next iteration samples from"
            )


@dataclass(frozen=True, kw_only=True)
class MetricsSection:
    """Where the master reports each iteration's metrics besides metrics/*.json."""

    tensorboard: bool = True  # event files in <run dir>/tensorboard/
    # Weights & Biases (pip install 'coordinator[wandb]'): a project name turns it on.
    wandb_project: str = ""
    wandb_entity: str = ""


@dataclass(frozen=True, kw_only=True)
class RlSections:
    schedule: ScheduleSection
    model: ModelSection
    data: DataSection
    rollout: RolloutSection
    engine: EngineConfig
    train: TrainConfig
    torchrun: TorchrunSection
    checkpoint: CheckpointSection
    metrics: MetricsSection


# The built-in tiny model's own values of the settings that depend on the model
# (rl/demo.py and the usage line run with them).  Its context is 128 positions
# and its answers are 2-4 digits and an end token: 6 new tokens suffice, and a
# 1024-token default would be refused by every request.  Its learning rate,
# epochs and batches are the ones that double its reward in 8 iterations.
TINY_MODEL_DEFAULTS: Final[Mapping[str, Mapping[str, Any]]] = {
    "rollout": {"tasks_per_iteration": 128, "max_tokens": 6, "eval_tasks": 64,
                "eval_group_size": 2, "eval_temperature": 1.0,
                "checkpoint_every_groups": 8, "concurrency": 4},
    "engine": {"ready_timeout_s": 300.0, "request_timeout_s": 60.0},
    "train": {"lr": 3e-4, "warmup_steps": 48, "epochs": 3, "micro_batch_size": 64,
              "mini_batch_size": 128},
}


def uses_tiny_model(raw: Mapping[str, Any]) -> bool:
    """Whether raw sections leave model.path empty: the project builds the tiny model."""
    model = raw.get("model", {})
    return not (isinstance(model, Mapping) and model.get("path"))


def with_model_defaults(raw: Mapping[str, Any]) -> dict[str, Any]:
    """`raw` over the defaults of its model: TINY_MODEL_DEFAULTS when it uses the
    tiny model, nothing added otherwise.  A key `raw` gives always wins."""
    if not uses_tiny_model(raw):
        return dict(raw)
    return deep_merge({k: dict(v) for k, v in TINY_MODEL_DEFAULTS.items()}, raw)


# Each section's dataclass; with [run] and [coordination] (coordinator/config.py),
# every setting a config file or --set may give.
SECTION_CLASSES: Final[Mapping[str, type]] = {
    "run": RunSection, "coordination": CoordinationConfig, "schedule": ScheduleSection,
    "model": ModelSection, "data": DataSection, "rollout": RolloutSection,
    "engine": EngineConfig, "train": TrainConfig, "torchrun": TorchrunSection,
    "checkpoint": CheckpointSection, "metrics": MetricsSection,
}

# What a verl user is likely to write for a setting, where the name is too far
# from ours for difflib to find it (train.learning_rate is not close to train.lr).
VERL_NAMES: Final[Mapping[str, str]] = {
    "train.learning_rate": "train.lr",
    "train.lr_warmup_steps": "train.warmup_steps",
    "train.ppo_mini_batch_size": "train.mini_batch_size",
    "train.ppo_micro_batch_size_per_gpu": "train.micro_batch_size",
    "train.ppo_epochs": "train.epochs",
    "train.clip_ratio": "train.clip_eps",
    "train.grad_clip": "train.max_grad_norm",
    "train.kl_loss_coef": "train.kl_coef",
    "train.loss_agg_mode": "train.loss_agg",
    "rollout.n": "rollout.group_size",
    "rollout.response_length": "rollout.max_tokens",
    "data.max_response_length": "rollout.max_tokens",
    "data.train_files": "data.path",
}


def settings_of(section: str) -> tuple[str, ...]:
    return tuple(f.name for f in fields(SECTION_CLASSES[section]))


def suggest(key: str) -> str | None:
    """The setting dotted `key` (which names none) most likely meant: a verl name's
    counterpart, a close name in its section, else the same name in another section
    (train.max_tokens -> rollout.max_tokens)."""
    if key in VERL_NAMES:
        return VERL_NAMES[key]
    section, _, name = key.rpartition(".")
    if section in SECTION_CLASSES and (near := closest_name(name, settings_of(section))):
        return f"{section}.{near}"
    return next((f"{other}.{name}" for other in SECTION_CLASSES
                 if other != section and name in settings_of(other)), None)


def check_names(raw: Mapping[str, Any]) -> None:
    """Every section and key of raw config sections names a setting, or
    UnknownSettingError naming the closest one (exit 2 at start)."""
    for section in sorted(map(str, raw)):
        value = raw[section]
        if section not in SECTION_CLASSES:
            if not isinstance(value, Mapping):  # --set lr=1e-5: a key without its section
                near = suggest(section)
                raise UnknownSettingError(
                    f"{section}: no such setting; "
                    + (f"did you mean {near}?" if near else
                       "a key is written with its section, e.g. train.lr=1e-5"),
                    key=section, suggestion=near)
            near = closest_name(section, list(SECTION_CLASSES))
            raise UsageError(
                f"[{section}]: no such section"
                + (f"; did you mean [{near}]?" if near else "")
                + f" (run.actions='rl' knows {', '.join(f'[{s}]' for s in SECTION_CLASSES)})")
        if not isinstance(value, Mapping):
            continue  # from_mapping says a section must be a table
        known = settings_of(section)
        for name in sorted(set(map(str, value)) - set(known)):
            key = f"{section}.{name}"
            raise unknown_setting(key, section, known, suggest(key))


def parse_sections(raw: Mapping[str, Any]) -> RlSections:
    check_names(raw)
    try:
        train = TrainConfig.from_dict(dict(raw.get("train", {})))
    except ConfigError as exc:
        raise UsageError(f"[train]: {exc}") from exc
    try:
        engine = from_mapping(EngineConfig, raw.get("engine", {}), "engine")
    except ValueError as exc:
        raise UsageError(f"[engine]: {exc}") from exc
    return RlSections(
        schedule=schedule_of(raw),
        model=from_mapping(ModelSection, raw.get("model", {}), "model"),
        data=from_mapping(DataSection, raw.get("data", {}), "data"),
        rollout=from_mapping(RolloutSection, raw.get("rollout", {}), "rollout"),
        engine=engine,
        train=train,
        torchrun=from_mapping(TorchrunSection, raw.get("torchrun", {}), "torchrun"),
        checkpoint=from_mapping(CheckpointSection, raw.get("checkpoint", {}), "checkpoint"),
        metrics=from_mapping(MetricsSection, raw.get("metrics", {}), "metrics"),
    )


def resolve_sections(raw: Mapping[str, Any]) -> dict[str, Any]:
    """Defaults filled in (the model's own first), as plain JSON for the manifest."""
    s = parse_sections(with_model_defaults(raw))
    out = {name: to_plain(getattr(s, name)) for name in SECTIONS if name != "train"}
    out["train"] = s.train.to_dict()
    return out
