"""The RL actions' configuration (`run.actions = "rl"`): its sections put together,
a config's keys checked against them, and parsed.

    [schedule]    which phases run, when to evaluate (rl/schedule.py)
    [model] [data] [reward] [rollout] [torchrun] [checkpoint] [metrics]
                  the loop's own (rl/sections.py)
    [engine]      the inference server (rollout/engines/config.py: EngineConfig)
    [train]       GRPO hyper-parameters (trainer/config.py: TrainConfig)

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

from coordinator.config.run_config import (
    CoordinationConfig,
    UnknownSettingError,
    closest_name,
    deep_merge,
    from_mapping,
    to_plain,
    unknown_setting,
)
from coordinator.config.settings import iter_settings
from coordinator.errors import UsageError
from rl.data_source import without_eval_data
from rl.placement import RlRunSection
from rl.schedule import RolloutSplit, ScheduleSection, schedule_of
from rl.sections import (
    CheckpointSection,
    DataSection,
    MetricsSection,
    ModelSection,
    RewardSection,
    RolloutSection,
    TorchrunSection,
)
from rl.verl_keys import suggestions
from rollout.engines.config import EngineKind
from rollout.engines.engine import EngineConfig
from trainer.config import TrainConfig

SECTIONS: Final = ("schedule", "model", "data", "reward", "rollout", "engine", "train",
                   "torchrun", "checkpoint", "metrics")

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


# Each section's dataclass; with [run] (coordinator/config/run_config.py and the rl
# kind's placement keys, rl/placement.py) and [coordination],
# every setting a config file or --set may give.
SECTION_CLASSES: Final[Mapping[str, type]] = {
    "run": RlRunSection, "coordination": CoordinationConfig, "schedule": ScheduleSection,
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
