"""The RL actions' own configuration sections, each setting declared once (its type,
default, bounds, unit and help: coordinator/config/settings.py), validated on construction.

    [model]       which model to start from
    [data]        where tasks come from, which reward
    [reward]      a reward function in a Python file (verl's custom_reward_function)
    [rollout]     sampling and checkpointing of the rollout
    [torchrun]    how phase 10 launches the trainer
    [checkpoint]  node-local cache, deltas, and how many published checkpoints to keep
    [metrics]     where the metrics go

[schedule] (rl/schedule.py), [engine] (rollout/engines/config.py) and [train]
(trainer/config.py) are declared beside the code that reads them; rl/config.py
puts them all together and parses a config into them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from coordinator.config.settings import Section, SettingError, setting
from rl.keep_best import Metric, parse_metric
from rollout.engines.engine import EngineConfig
from rollout.reward_file import DEFAULT_FUNCTION, FileReward
from rollout.rewards import DEFAULT_CALL_SECONDS
from rollout.tasks import BUILTIN_REVERSE
from trainer.config import WARMSTART_STEPS


@dataclass(frozen=True, kw_only=True)
class ModelSection(Section):
    """Which model the run starts from."""

    SECTION: ClassVar[str] = "model"

    path: str = setting(
        "", "A local Hugging Face causal LM directory; '' builds the tiny demo model (with a "
        "short supervised warm start) under <run-dir>/model-init.", flag="--model")
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
        "list; none: no eval split (eval turned off with a WARNING, or the run refused "
        "at start where schedule.eval_interval or eval_before_train is set).")
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
    episode_concurrency: int = setting(
        0, "Agent episodes run at once (rollout.agent); 0 for 4 per request in flight: an "
        "episode also waits on its tools and environment, and the engine still receives at "
        "most the requests in flight.", ge=0,
        fix="give the episodes to run at once, or 0 for 4 per request in flight")
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


# Agent episodes per request in flight when rollout.episode_concurrency is 0.  An
# episode holds no request while its tools or environment run; verl, SkyRL and
# prime-rl's verifiers start a batch's episodes all at once and let the engine
# queue.  One thread each here, so a bound: 4x keeps the engine's batch full for
# episodes that spend up to three quarters of their time outside it.
EPISODES_PER_REQUEST = 4


def episodes_in_flight(rollout: RolloutSection, engine: EngineConfig) -> int:
    return rollout.episode_concurrency or EPISODES_PER_REQUEST * requests_in_flight(rollout,
                                                                                    engine)


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
