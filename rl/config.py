"""Configuration sections of the RL actions (`run.actions = "rl"`).

    [schedule]    which phases run, when to evaluate (rl/schedule.py)
    [model]       which model to start from
    [data]        where tasks come from, which reward
    [reward]      a reward function in a Python file (verl's custom_reward_function)
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
from typing import Any, ClassVar, Final

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
from coordinator.settings import Section, SettingError, iter_settings, setting
from rl.data_source import without_eval_data
from rl.keep_best import Metric, parse_metric
from rl.schedule import RolloutSplit, ScheduleSection, schedule_of
from rl.verl_keys import suggestions
from rollout.engines.config import EngineKind
from rollout.engines.engine import EngineConfig
from rollout.reward_file import DEFAULT_FUNCTION, FileReward
from rollout.rewards import DEFAULT_CALL_SECONDS
from rollout.tasks import BUILTIN_REVERSE
from trainer.config import WARMSTART_STEPS, TrainConfig

SECTIONS: Final = ("schedule", "model", "data", "reward", "rollout", "engine", "train",
                   "torchrun", "checkpoint", "metrics")

@dataclass(frozen=True, kw_only=True)
class ModelSection(Section):
    """Which model the run starts from."""

    SECTION: ClassVar[str] = "model"

    path: str = setting(
        "", "A local Hugging Face causal LM directory; '' builds the tiny demo model (with a "
        "short supervised warm start) under <log-path>/model-init.", flag="--model")
    init_seed: int = setting(0, "Weights seed of the tiny demo model.", ge=0)
    # 12-20% sampled accuracy: room for RL to double it.
    warmstart_steps: int = setting(
        WARMSTART_STEPS, "Supervised warm-up steps of the tiny demo model on the built-in "
        "task.", unit="steps", ge=0)


@dataclass(frozen=True, kw_only=True)
class DataSection(Section):
    """Where tasks come from, and which reward scores them."""

    SECTION: ClassVar[str] = "data"

    path: str = setting(
        BUILTIN_REVERSE, "Tasks: builtin:reverse, or a verl-style parquet / JSONL file or "
        "a directory holding train.* and test.* (or eval.*).", flag="--data-path")
    # verl's way instead of data.path; with no val_files there is no eval split: eval is
    # off, with a WARNING, unless the schedule asks for it (rl/data_source.py).
    train_files: str | tuple[str, ...] = setting(
        (), "verl's data.train_files: the train split's parquet or JSONL files, a path or a "
        "list (instead of data.path).")
    val_files: str | tuple[str, ...] = setting(
        (), "verl's data.val_files: the eval split's parquet or JSONL files, a path or a "
        "list; none: no eval.")
    reward: str = setting(
        "", "A reward registered under the entry-point group coordinator.rewards; '' picks "
        "the one registered for each task's data_source.")
    seed: int = setting(0, "Seed of a generated task source (builtin:reverse); files keep "
                        "their order.", ge=0)

    def check(self) -> None:
        for name in ("train_files", "val_files"):
            value = getattr(self, name)
            files = (value,) if isinstance(value, str) else tuple(value)
            if not all(files):
                raise SettingError(f"data.{name}={list(files)!r} holds an empty path: give "
                                   "parquet or JSONL files, a path or a list of paths",
                                   key=f"data.{name}", value=value)
            object.__setattr__(self, name, files)
        if self.train_files and self.path != BUILTIN_REVERSE:
            raise SettingError(
                f"data.path={self.path!r} and data.train_files={list(self.train_files)!r} "
                "both name the tasks: give one, data.path (a task file, or a directory of "
                "train.<ext> and test.<ext>) or data.train_files with data.val_files (verl's "
                "lists of files)", key="data.train_files", value=self.train_files)
        if self.val_files and not self.train_files:
            raise SettingError(
                f"data.val_files={list(self.val_files)!r} without data.train_files: give the "
                "train files too (data.path's eval split is its directory's test.<ext>)",
                key="data.val_files", value=self.val_files)

    @property
    def source(self) -> str:
        """The tasks' source as messages name it."""
        if self.train_files:
            return f"data.train_files={list(self.train_files)!r}" + (
                f" and data.val_files={list(self.val_files)!r}" if self.val_files else "")
        return f"data.path={self.path!r}"


@dataclass(frozen=True, kw_only=True)
class RewardSection(Section):
    """A reward function in a Python file, verl's custom_reward_function
    (rollout/reward_file.py, docs/PLUGINS.md); data.reward names a registered one."""

    SECTION: ClassVar[str] = "reward"

    # Code each node runs (in a worker process): named by the node's own config,
    # never by run.json (phase 0 checks every rank loads the same).
    path: str = setting(
        "", "A Python file defining the reward function (verl's custom_reward_function.path); "
        "'' scores with data.reward.", node_local=True)
    function: str = setting(
        DEFAULT_FUNCTION, "The file's function, called as function(data_source, solution_str, "
        "ground_truth, extra_info) -> float or dict with 'score'.", node_local=True)
    timeout_s: float = setting(
        DEFAULT_CALL_SECONDS, "A reward call with no result by then is killed, scores 0 and "
        "counts in reward_timeouts.", unit="s", gt=0)

    def check(self) -> None:
        if not self.function.isidentifier():
            raise SettingError(f"reward.function={self.function!r} is not a Python name: give "
                               f"the function's name in reward.path, e.g. {DEFAULT_FUNCTION}",
                               key="reward.function", value=self.function)
        if self.function != DEFAULT_FUNCTION and not self.path:
            raise SettingError(f"reward.function={self.function!r} names a function of "
                               "reward.path, which is not set: give reward.path=FILE too",
                               key="reward.function", value=self.function)

    def file(self) -> FileReward | None:
        """reward.path's function, or None (data.reward and the data sources choose)."""
        if not self.path:
            return None
        return FileReward(path=self.path, function=self.function, timeout_s=self.timeout_s)


@dataclass(frozen=True, kw_only=True)
class RolloutSection(Section):
    """Sampling, and checkpointing of the rollout.  Defaults for a 1.5-8 B instruct model
    on GSM8K-like tasks."""

    SECTION: ClassVar[str] = "rollout"

    group_size: int = setting(
        8, "Samples per prompt (GRPO's group).", unit="samples", ge=2,
        fix="GRPO normalises rewards within a group, so each prompt needs at least 2 samples "
            "(8 is typical)")
    tasks_per_iteration: int = setting(
        256, "Prompts rolled out per iteration; 0: the whole train split every iteration.",
        unit="prompts", ge=0)
    max_tokens: int = setting(
        1024, "Most new tokens of one answer; the engine's max_model_len bounds it too.",
        unit="tokens", ge=1)
    temperature: float = setting(1.0, "Sampling temperature of the train rollout.", ge=0)
    top_p: float = setting(1.0, "Nucleus sampling of the train rollout (1: off).", gt=0, le=1)
    eval_tasks: int = setting(0, "Prompts per evaluation; 0: the whole eval split.",
                              unit="prompts", ge=0)
    eval_group_size: int = setting(1, "Samples per eval prompt.", unit="samples", ge=1)
    eval_temperature: float = setting(
        0.0, "Sampling temperature of evaluation; 0: greedy, accuracy without sampling "
        "noise.", ge=0)
    # A killed rank redoes at most this many groups, or this many seconds of
    # generation, whichever is less.
    checkpoint_every_groups: int = setting(
        32, "A rank saves its rollout so far every this many groups.", unit="groups", ge=1)
    checkpoint_every_s: float = setting(
        60.0, "... or every this many seconds of generation, whichever comes first.",
        unit="s", gt=0)
    concurrency: int = setting(
        0, "Requests in flight; 0 keeps each engine replica's batch full: 64 per replica "
        "(engine.data_parallel_size).", ge=0,
        fix="give the requests to keep in flight, or 0 for 64 per engine replica")
    request_retries: int = setting(3, "Retries of a failed request before its group fails.",
                                   ge=0)
    max_failed_fraction: float = setting(
        0.1, "More failed samples than this fraction of a rollout fail the phase.", ge=0, le=1)
    # Failed samples and groups left with too few answers are what a batch loses.
    min_batch_fraction: float = setting(
        0.5, "A train batch with fewer samples than this fraction of those rolled out fails "
        "phase 4 rather than train on scraps (an empty batch always does).", ge=0, le=1)
    progress_interval_s: float = setting(
        5.0, "Between two progress lines of a rollout in the log.", unit="s", gt=0)
    keep_rank_files: bool = setting(
        False, "Keep the ranks' trajectory files once an iteration completes.")
    # Code each node imports and runs: named by the node's own config, never by
    # run.json (phase 1 checks every rank ran the same).
    agent: str = setting(
        "", "An agent plugin 'package.module:Name' (rollout/agents.py) that turns each task "
        "into an episode; '' for built-in single-turn sampling.", node_local=True)
    episode_timeout_s: float = setting(600.0, "An agent's episode running longer fails.",
                                       unit="s", gt=0)

    def check(self) -> None:
        if self.agent and ":" not in self.agent:
            raise SettingError(f"rollout.agent={self.agent!r} must look like "
                               "'package.module:Name' (a class or a function)",
                               key="rollout.agent", value=self.agent)


# Requests in flight per engine replica when rollout.concurrency is 0: enough
# to keep a vLLM replica's continuous batch full on one GPU group.
REQUESTS_PER_REPLICA = 64


def requests_in_flight(rollout: RolloutSection, engine: EngineConfig) -> int:
    return rollout.concurrency or REQUESTS_PER_REPLICA * engine.data_parallel_size


@dataclass(frozen=True, kw_only=True)
class TorchrunSection(Section):
    """How phase 10 launches the trainer."""

    SECTION: ClassVar[str] = "torchrun"

    nproc_per_node: int = setting(1, "Trainer processes per node (one per GPU).", ge=1)
    wall_limit_s: float = setting(21600.0, "Phase 10 fails after this long.", unit="s", gt=0)
    extra_args: tuple[str, ...] = setting((), "Appended verbatim to the torchrun command.",
                                          node_local=True)
    resident: bool = setting(
        True, "Keep one torchrun group per session between iterations (rl/trainer_host.py); "
        "false starts one per iteration and saves the training state every time.")
    # Its CUDA context and the communicator's buffers.
    offload_residual_mib: int = setting(
        3072, "GPU memory a trainer may keep beside the engine after a job; more, past "
        "release_timeout_s, and its group is stopped so the engine has the GPU.",
        unit="MiB", ge=0)
    release_timeout_s: float = setting(60.0, "How long that release is waited for.",
                                       unit="s", gt=0)


@dataclass(frozen=True, kw_only=True)
class CheckpointSection(Section):
    """Each node's cache of the run's checkpoints, and how many published ones to keep."""

    SECTION: ClassVar[str] = "checkpoint"

    # Shared by the daemons of one node under a node-local lock; the last daemon
    # of the run on a node removes it as it exits, unless keep_local_cache.
    local_cache: str = setting(
        "", "Node-local directory of the run's checkpoint copies, in <local_cache>/<run id>/ "
        "('': $TMPDIR/coordinator-<uid>, rl/node_local.py).", node_local=True,
        flag="--local-cache")
    keep_local_cache: bool = setting(
        False, "Keep that directory when the node's last daemon of the run exits.",
        node_local=True)
    keep: int = setting(
        2, "Published checkpoints kept (the initial model is never removed).", ge=1,
        flag="--keep-checkpoints",
        fix="the newest checkpoint is the policy the next iteration samples from; keep 1 or more")
    full_every: int = setting(
        10, "Publish a full checkpoint every N iterations (0, N, 2N, ...); the others are "
        "deltas of the previous one, each weights file as the elements that changed "
        "(trainer/delta.py). 1: every checkpoint full.", unit="iterations", ge=1,
        fix="give 1 for full checkpoints only, or N > 1 for a full one every N iterations")
    keep_best: str = setting(
        "", "An eval metric: the best checkpoint by it is kept beside the newest `keep` ones "
        "and named in checkpoints/best.json; eval/accuracy or eval/reward_mean (higher is "
        "better), eval/num_failed (lower), another eval.json key (lower if it ends in loss "
        "or error), NAME:max or NAME:min to say which (rl/keep_best.py).")

    def check(self) -> None:
        if self.keep_best:
            self.best_metric  # noqa: B018  (parsed now: a bad name is a usage error at start)

    @property
    def best_metric(self) -> Metric:
        """keep_best parsed (rl/keep_best.py); only when it is set."""
        return parse_metric(self.keep_best, what="checkpoint.keep_best")


@dataclass(frozen=True, kw_only=True)
class MetricsSection(Section):
    """Where the master reports each iteration's metrics besides metrics/*.json."""

    SECTION: ClassVar[str] = "metrics"

    tensorboard: bool = setting(True, "Write TensorBoard event files in <run dir>/tensorboard/.")
    wandb_project: str = setting(
        "", "A Weights & Biases project turns W&B on (pip install 'coordinator[wandb]').")
    wandb_entity: str = setting("", "The W&B entity (team or user); '': the login's default.")


@dataclass(frozen=True, kw_only=True)
class RlSections:
    schedule: ScheduleSection
    model: ModelSection
    data: DataSection
    reward: RewardSection
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
    "model": ModelSection, "data": DataSection, "reward": RewardSection,
    "rollout": RolloutSection,
    "engine": EngineConfig, "train": TrainConfig, "torchrun": TorchrunSection,
    "checkpoint": CheckpointSection, "metrics": MetricsSection,
}

# Each node's own business, never written to run.json and never taken from it
# (docs/PROTOCOL.md, node-local keys): what a node executes and with which
# environment, secrets, and where its local disk is.  Each daemon reads them
# from its own --config and --set; the run directory cannot make a node run
# a program or leak a key.  Declared with node_local=True.
NODE_LOCAL_KEYS: Final = tuple(
    key for name, cls in SECTION_CLASSES.items()
    for key, declared, _, _ in iter_settings(cls, name) if declared.node_local)

# What a verl user (or one of another framework) is likely to write for a setting,
# where the name is too far from ours for difflib to find it (train.learning_rate
# is not close to train.lr): verl's table (rl/verl_keys.py) and the declared aliases.
VERL_NAMES: Final[Mapping[str, str]] = suggestions(SECTION_CLASSES)


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


def _dotted(prefix: str, tree: Mapping[str, Any]) -> list[str]:
    """The dotted keys of every value under `tree`, sorted."""
    return sorted(key for name, value in tree.items() for key in (
        _dotted(f"{prefix}.{name}", value) if isinstance(value, Mapping)
        else [f"{prefix}.{name}"]))


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
            verl = next((key for key in _dotted(section, value) if key in VERL_NAMES), None)
            if verl is not None:  # [custom_reward_function] path = ..., or --set
                # actor_rollout_ref.rollout.n=8: verl's table (rl/verl_keys.py)
                raise UnknownSettingError(f"{verl}: no such setting; did you mean "
                                          f"{VERL_NAMES[verl]}?", key=verl,
                                          suggestion=VERL_NAMES[verl])
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
    train = from_mapping(TrainConfig, raw.get("train", {}), "train")
    try:
        engine = from_mapping(EngineConfig, raw.get("engine", {}), "engine")
    except UsageError:
        raise
    except ValueError as exc:  # a rule of the engine's own code, not of a declaration
        raise UsageError(f"[engine]: {exc}") from exc
    sections = RlSections(
        schedule=schedule_of(raw),
        model=from_mapping(ModelSection, raw.get("model", {}), "model"),
        data=from_mapping(DataSection, raw.get("data", {}), "data"),
        reward=from_mapping(RewardSection, raw.get("reward", {}), "reward"),
        rollout=from_mapping(RolloutSection, raw.get("rollout", {}), "rollout"),
        engine=engine,
        train=train,
        torchrun=from_mapping(TorchrunSection, raw.get("torchrun", {}), "torchrun"),
        checkpoint=from_mapping(CheckpointSection, raw.get("checkpoint", {}), "checkpoint"),
        metrics=from_mapping(MetricsSection, raw.get("metrics", {}), "metrics"),
    )
    check_reward_choice(sections)
    check_eval_rules(sections)
    return sections


def check_eval_rules(s: RlSections) -> None:
    """Eval settings that could only end in failed samples or a setting that does
    nothing, refused at start instead."""
    never = (s.schedule.rollout_split is RolloutSplit.TRAIN_ONLY
             or (s.schedule.rollout_split is RolloutSplit.BOTH and s.schedule.eval_interval <= 0))
    if s.checkpoint.keep_best and never:
        raise UsageError(
            f"checkpoint.keep_best={s.checkpoint.keep_best!r}, but the run never evaluates "
            f"(schedule.rollout_split={s.schedule.rollout_split.value}, schedule.eval_interval="
            f"{s.schedule.eval_interval}): no checkpoint would ever be scored; set "
            "schedule.eval_interval (and data.val_files when the data has no eval split), or "
            "drop checkpoint.keep_best")
    if (s.engine.kind is EngineKind.VLLM and s.rollout.eval_group_size > 1
            and s.rollout.eval_temperature == 0):
        raise UsageError(
            f"rollout.eval_group_size={s.rollout.eval_group_size} with rollout.eval_temperature=0 "
            "on engine.kind=vllm: greedy decoding gives every sample of a prompt the same "
            "answer, and vLLM refuses n > 1 without sampling (every eval sample would fail); "
            "set eval_group_size=1, or eval_temperature above 0")


def check_reward_choice(s: RlSections) -> None:
    """One way to choose the reward: reward.path (verl's custom_reward_function), or
    data.reward (a registered name), or neither (each data_source's default); and a
    reward file only where built-in sampling scores (an agent scores its episodes)."""
    if s.reward.path and s.data.reward:
        raise UsageError(
            f"data.reward={s.data.reward!r} and reward.path={s.reward.path!r} both choose the "
            "reward: give one (reward.path's function scores every task; data.reward names a "
            "registered reward)")
    if s.reward.path and s.rollout.agent:
        raise UsageError(
            f"reward.path={s.reward.path!r} with rollout.agent={s.rollout.agent!r}: an agent "
            "scores its own episodes, so the file would never be called; drop reward.path, or "
            "call rollout.reward_file.FileReward(path=...).score(task, text) in the agent")


def resolve_sections(raw: Mapping[str, Any]) -> dict[str, Any]:
    """Defaults filled in (the model's own first), as plain JSON for the manifest."""
    s = parse_sections(with_model_defaults(without_eval_data(raw)))
    out = {name: to_plain(getattr(s, name)) for name in SECTIONS if name != "train"}
    out["train"] = s.train.to_dict()
    return out
