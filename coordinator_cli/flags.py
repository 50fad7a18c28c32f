"""The flags of `coordinator run` and `coordinator config`, and `--set`, from the declarations.

A setting declared with `flag="--name"` (coordinator/config/settings.py) is an option:
its type, help and default (shown in `--help`, never applied: a flag not given
leaves the config file's value) come from the declaration, so adding a flag is
one `flag=` in the section.  `with_config_flags` gives a typer command one
option per flag (inserted after its `config` parameter, so `--help` lists them
beside --config) and hands the command the values given as `flags`;
`overrides` turns the `--set` items, each read as its setting's declared type,
and then the flags given (which win), into config overrides.
"""

from __future__ import annotations

import enum
import functools
import inspect
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Final

import typer

from coordinator.config.run_config import to_plain
from coordinator.config.settings import iter_settings
from coordinator_cli.args import parse_set, set_dotted
from rl.config import SECTION_CLASSES
from rl.scripted import ScriptedConfig

# Every section a `--set` key may name: the rl kind's, and the scripted kind's.
# A key of any other section is read as JSON (or as text).
ALL_SECTIONS: Final[Mapping[str, type]] = {**SECTION_CLASSES, "scripted": ScriptedConfig}
DECLARED: Final[Mapping[str, Any]] = {
    key: hint for name, cls in ALL_SECTIONS.items() for key, _, hint, _ in iter_settings(cls, name)}


@dataclass(frozen=True, kw_only=True)
class ConfigFlag:
    flag: str  # --eval-interval
    key: str  # the config key it sets: schedule.eval_interval
    hint: Any  # the setting's declared type
    help: str
    default: Any

    @property
    def name(self) -> str:
        """The typer parameter's name: eval_interval."""
        return self.flag[2:].replace("-", "_")

    @property
    def type(self) -> type:
        options = [a for a in typing.get_args(self.hint) if a is not type(None)] or [self.hint]
        first = options[0]
        # Enums are read as text and checked by the declaration (its message lists them).
        return str if isinstance(first, type) and issubclass(first, enum.Enum) else first

    def parameter(self) -> inspect.Parameter:
        switch = (f"{self.flag}/--no-{self.flag[2:]}",) if self.type is bool else ()
        shown = to_plain(self.default)
        option = typer.Option(*switch, help=self.help,
                              show_default=repr(shown) if isinstance(shown, str) else str(shown))
        annotation = Annotated[self.type | None, option]  # type: ignore[name-defined]
        return inspect.Parameter(self.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None,
                                 annotation=annotation)


def config_flags(sections: Mapping[str, type]) -> tuple[ConfigFlag, ...]:
    """One flag per setting of `sections` declared with flag=, in section order."""
    out: list[ConfigFlag] = []
    for name, cls in sections.items():
        for key, declared, hint, default in iter_settings(cls, name):
            if declared.flag:
                unit = f"; {declared.unit}" if declared.unit else ""
                out.append(ConfigFlag(flag=declared.flag, key=key, hint=hint, default=default,
                                      help=f"{declared.help} ({key}{unit})"))
    twice = sorted({f.flag for f in out if [g.flag for g in out].count(f.flag) > 1})
    if twice:
        raise TypeError(f"flags declared by two settings: {', '.join(twice)}")
    return tuple(out)


CONFIG_FLAGS: Final = config_flags(SECTION_CLASSES)


def overrides(items: list[str], given: Mapping[str, Any]) -> dict[str, Any]:
    """Config overrides from --set items (each read as its declared type), then from the
    flags given (which win)."""
    out = parse_set(items, DECLARED.get)
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
