"""The flags of `coordinator run` that set a config key: each declared once, here.

A `ConfigFlag` is the flag's name, the key it sets, its type and its help.
`with_config_flags` gives a typer command one option per entry (inserted
after its `config` parameter, so `--help` lists them beside --config) and
hands the command the values given as `flags`; `overrides` turns them into
config overrides on top of the `--set` items.  Adding a flag is one entry.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Final

import typer

from coordinator import on_failure
from rl.cli_args import parse_set, set_dotted


@dataclass(frozen=True, kw_only=True)
class ConfigFlag:
    name: str  # the flag without dashes, underscores for hyphens: eval_interval
    key: str  # the config key it sets: schedule.eval_interval
    type: type
    help: str
    switch: str = ""  # booleans: "--flag/--no-flag"

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def parameter(self) -> inspect.Parameter:
        decls = (self.switch,) if self.switch else ()
        annotation = Annotated[self.type | None, typer.Option(*decls, help=self.help)]  # type: ignore[name-defined]
        return inspect.Parameter(self.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None,
                                 annotation=annotation)


CONFIG_FLAGS: Final = (
    ConfigFlag(name="iterations", key="run.iterations", type=int,
               help="Number of RL iterations."),
    ConfigFlag(name="eval_interval", key="schedule.eval_interval", type=int,
               help="Evaluate every K-th iteration (0: never)."),
    ConfigFlag(name="eval_before_train", key="schedule.eval_before_train", type=bool,
               switch="--eval-before-train/--no-eval-before-train",
               help="Evaluate the initial model in iteration 0."),
    ConfigFlag(name="rollout_split", key="schedule.rollout_split", type=str,
               help="train-only, eval-only or both."),
    ConfigFlag(name="rl_phase", key="schedule.rl_phase", type=str,
               help="both (phases 0-13), rollout (0-6) or update (7-13)."),
    ConfigFlag(name="actions", key="run.actions", type=str,
               help="rl (default) or scripted (no ML; smoke test)."),
    ConfigFlag(name="seed", key="run.seed", type=int, help="Run seed."),
    ConfigFlag(name="lease", key="coordination.lease_s", type=float,
               help="Seconds without heartbeat before a node is lost."),
    ConfigFlag(name="heartbeat_interval", key="coordination.heartbeat_interval_s", type=float,
               help="Seconds between heartbeats."),
    ConfigFlag(name="on_failure", key="coordination.on_failure", type=str,
               help=on_failure.cli_help()),
    ConfigFlag(name="max_recoveries", key="coordination.max_recoveries", type=int,
               help="Automatic recoveries per run before every node exits."),
    ConfigFlag(name="min_nodes", key="coordination.min_nodes", type=int,
               help="With --on-failure shrink: the fewest nodes (master included) to go on "
                    "with."),
    ConfigFlag(name="model", key="model.path", type=Path,
               help="Hugging Face model directory (default: the tiny demo model)."),
    ConfigFlag(name="data_path", key="data.path", type=str,
               help="Task data: builtin:reverse, a parquet or JSONL file or directory."),
    ConfigFlag(name="engine", key="engine.kind", type=str, help="Inference engine: hf or vllm."),
    ConfigFlag(name="local_cache", key="checkpoint.local_cache", type=Path,
               help="Node-local directory for checkpoint copies."),
    ConfigFlag(name="keep_checkpoints", key="checkpoint.keep", type=int,
               help="Published checkpoints to keep."),
)


def overrides(items: list[str], given: Mapping[str, Any]) -> dict[str, Any]:
    """Config overrides from --set items, then from the flags given (which win)."""
    out = parse_set(items)
    for f in CONFIG_FLAGS:
        value = given.get(f.name)
        if value is not None:
            set_dotted(out, f.key, str(value) if isinstance(value, Path) else value,
                       given=f.flag)
    return out


def with_config_flags(command: Callable[..., None]) -> Callable[..., None]:
    """`command(..., flags)` as a typer command with one option per CONFIG_FLAGS entry."""
    signature = inspect.signature(command)
    hints = typing.get_type_hints(command, include_extras=True)
    own = [p.replace(annotation=hints.get(p.name, p.annotation))
           for p in signature.parameters.values() if p.name != "flags"]
    at = next(i for i, p in enumerate(own) if p.name == "config") + 1
    params = own[:at] + [f.parameter() for f in CONFIG_FLAGS] + own[at:]

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> None:
        flags = {f.name: kwargs.pop(f.name) for f in CONFIG_FLAGS}
        command(**kwargs, flags=flags)

    wrapper.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    return wrapper
