"""Settings declared once: a config field carries its type, default, bounds, unit and help.

How to add a setting
    1. Give it a field in its section's dataclass (a subclass of `Section`),
       declared with `setting`; the annotation is its type:

           max_tokens: int = setting(1024, "Most new tokens of one answer.",
                                     unit="tokens", ge=1)

       `help` is one line.  Bounds: ge / gt / le / lt (for a list, each of its
       numbers), `choices` for a string; `flag="--name"` makes it an option of
       `coordinator run` and `coordinator config`; `node_local=True` marks a key
       each node gives itself (never written to run.json); `aliases` are names
       users of other frameworks type for it ("did you mean ...?"); `fix`
       replaces the generated advice of an out-of-bounds message.
    2. A rule that ties settings together goes in the section's `check()`.
    3. Regenerate the reference: `python -m coordinator_cli.config_doc > docs/CONFIG.md`
       (tests/rl/test_config_doc.py fails while it is stale or a setting lacks help).

Everything else is derived from the declaration: the strict parse of a config
file (`from_mapping`, `coerce`) and of `--set` text (`from_text`), the bounds
check at construction with the value, the rule and the fix
(`Section.__post_init__`), the flags and their defaults in `--help`
(coordinator_cli/flags.py), docs/CONFIG.md (coordinator_cli/config_doc.py) and the resolved TOML of
`coordinator config` (coordinator_cli/config_show.py).
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import types
import typing
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar, Final, TypeVar, Union

from coordinator.errors import UsageError

T = TypeVar("T")
# The key of a field's metadata that holds its declaration.
META: Final = "coordinator.setting"
# How alike (difflib's ratio) a mistyped name and a setting must be to offer
# the setting: 0.6 catches a letter dropped, doubled or swapped (lrr -> lr,
# leese_s -> lease_s) without offering an unrelated name.
CLOSE_ENOUGH: Final = 0.6


class SettingError(UsageError):
    """A setting's value breaks its declaration (exit 2 at start)."""

    def __init__(self, message: str, *, key: str, value: Any) -> None:
        super().__init__(message)
        self.key = key  # dotted: rollout.group_size
        self.value = value


class UnknownSettingError(UsageError):
    """A config file or --set names a key no section has (exit 2 at start)."""

    def __init__(self, message: str, *, key: str, suggestion: str | None) -> None:
        super().__init__(message)
        self.key = key  # dotted, as given: train.lrr
        self.suggestion = suggestion  # dotted, the closest setting: train.lr


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else repr(float(x))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Setting:
    """What a field's metadata declares about it (see the module docstring)."""

    help: str
    unit: str = ""
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[str, ...] = ()
    flag: str = ""
    node_local: bool = False
    aliases: tuple[str, ...] = ()
    fix: str = ""

    def __post_init__(self) -> None:
        if not self.help.strip() or "\n" in self.help:
            raise TypeError(f"setting help {self.help!r} must be one non-empty line")
        if self.flag and not (self.flag.startswith("--") and self.flag[2:].islower()):
            raise TypeError(f"flag {self.flag!r} must look like --name")
        if (self.ge is not None and self.gt is not None) or (
                self.le is not None and self.lt is not None):
            raise TypeError("give at most one lower bound (ge, gt) and one upper (le, lt)")

    @property
    def bounds(self) -> str:
        """The bounds as a reader writes them: '>= 1', '0..65535', '(0, 1]', '' for none."""
        low, high = self.ge if self.ge is not None else self.gt, \
            self.le if self.le is not None else self.lt
        if low is not None and high is not None:
            if self.ge is not None and self.le is not None:
                return f"{_num(low)}..{_num(high)}"
            return (f"{'[' if self.ge is not None else '('}{_num(low)}, "
                    f"{_num(high)}{']' if self.le is not None else ')'}")
        if low is not None:
            return f"{'>=' if self.ge is not None else '>'} {_num(low)}"
        if high is not None:
            return f"{'<=' if self.le is not None else '<'} {_num(high)}"
        return ""

    def violation(self, value: float) -> str | None:
        """How a number breaks the bounds ('is below 1'), or None when it keeps them."""
        if isinstance(value, float) and not math.isfinite(value):
            return "is not a finite number"
        if not ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le)
                and (self.lt is None or value < self.lt)):
            lower = self.ge if self.ge is not None else self.gt
            upper = self.le if self.le is not None else self.lt
            if lower is not None and upper is not None:
                return f"is outside {self.bounds}"
            if self.ge is not None:
                return "is negative" if self.ge == 0 else f"is below {_num(self.ge)}"
            if self.gt is not None:
                return "is not positive" if self.gt == 0 else f"is not above {_num(self.gt)}"
            assert upper is not None
            return f"is above {_num(upper)}" if self.le is not None else \
                f"is not below {_num(upper)}"
        return None

    def advice(self, key: str, default: Any) -> str:
        """The fix of an out-of-bounds value: `fix`, or the bounds, the meaning and the default."""
        if self.fix:
            return self.fix
        unit = f" {self.unit}" if self.unit else ""
        example = f", e.g. {key}={_num(default)}" if isinstance(default, (int, float)) \
            and not isinstance(default, bool) and self.violation(default) is None else ""
        return f"give a value {self.bounds}{unit} ({self.help.rstrip('.')}){example}"


def setting(default: T, help: str, **declared: Any) -> T:
    """A field of a config section, declared once: its default, its help and `declared`
    (Setting's other fields).  Typed as its default, as dataclasses.field is."""
    return dataclasses.field(  # type: ignore[no-any-return]
        default=default, metadata={META: Setting(help=help, **declared)})


def subsection(cls: type[T], help: str) -> T:
    """A field holding a nested section (coordination.phase_timeouts_s)."""
    return dataclasses.field(  # type: ignore[no-any-return]
        default_factory=cls, metadata={META: Setting(help=help)})


def declaration(f: dataclasses.Field[Any]) -> Setting | None:
    found = f.metadata.get(META)
    return found if isinstance(found, Setting) else None


_DECLARED: dict[type, tuple[tuple[str, Setting, Any, Any], ...]] = {}


def declared_fields(cls: type) -> tuple[tuple[str, Setting, Any, Any], ...]:
    """(name, declaration, type, default) of every field of section class `cls`."""
    if cls in _DECLARED:
        return _DECLARED[cls]
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        decl = declaration(f)
        if decl is None:
            raise TypeError(f"{cls.__name__}.{f.name} has no declaration: declare it with "
                            "coordinator.config.settings.setting(default, help, ...)")
        default = f.default if f.default is not dataclasses.MISSING else \
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        out.append((f.name, decl, hints[f.name], default))
    _DECLARED[cls] = tuple(out)
    return _DECLARED[cls]


class Section:
    """Base of every config section: a frozen, keyword-only dataclass whose fields are
    declared with `setting`.  Construction coerces each value to its declared type and
    checks its bounds (SettingError naming the key, the value, the rule and the fix),
    then runs `check()`, the section's rules between settings."""

    SECTION: ClassVar[str] = ""  # the dotted prefix of its keys: "engine", "coordination"

    def __post_init__(self) -> None:
        for name, decl, hint, default in declared_fields(type(self)):
            key = f"{self.SECTION}.{name}" if self.SECTION else name
            value = getattr(self, name)
            coerced = coerce(value, hint, key)
            if coerced is not value:
                object.__setattr__(self, name, coerced)
            check_value(key, coerced, decl, default)
        self.check()

    def check(self) -> None:
        """Rules between this section's settings; raise SettingError."""


def check_value(key: str, value: Any, decl: Setting, default: Any) -> None:
    """SettingError when `value` (already of its declared type) breaks `decl`."""
    if decl.choices and isinstance(value, str) and value not in decl.choices:
        raise SettingError(f"{key}={value!r} is not one of: {', '.join(decl.choices)}",
                           key=key, value=value)
    numbers = value if isinstance(value, tuple) else (value,)
    for number in numbers:
        if isinstance(number, (int, float)) and not isinstance(number, bool):
            wrong = decl.violation(number)
            if wrong is not None:
                raise SettingError(f"{key}={value!r} {wrong}: {decl.advice(key, default)}",
                                   key=key, value=value)


def iter_settings(cls: type, prefix: str) -> Iterator[tuple[str, Setting, Any, Any]]:
    """(dotted key, declaration, type, default) of every setting of section `cls`,
    nested sections' settings in place of the section."""
    for name, decl, hint, default in declared_fields(cls):
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            yield from iter_settings(hint, f"{prefix}.{name}")
        else:
            yield f"{prefix}.{name}", decl, hint, default


def closest_name(name: str, known: Collection[str]) -> str | None:
    """The name of `known` most like `name`, if any is close enough to be a typo of it."""
    found = difflib.get_close_matches(name, list(known), n=1, cutoff=CLOSE_ENOUGH)
    return found[0] if found else None


def unknown_setting(key: str, section: str, known: Collection[str],
                    suggestion: str | None = None) -> UnknownSettingError:
    """The error for dotted `key`, which names no setting of `section` (whose settings
    are `known`): the closest setting (`suggestion`, or the closest of `known`),
    else the list of `known`."""
    if suggestion is None:
        near = closest_name(key.rpartition(".")[2], known)
        suggestion = f"{section}.{near}" if near else None
    if suggestion:
        return UnknownSettingError(f"{key}: no such setting; did you mean {suggestion}?",
                                   key=key, suggestion=suggestion)
    return UnknownSettingError(
        f"{key}: no such setting; the settings of [{section}] are {', '.join(sorted(known))}",
        key=key, suggestion=None)


def from_mapping(cls: type[T], raw: Any, where: str) -> T:
    """Build dataclass `cls` from a parsed mapping, strictly: an unknown key names the
    closest setting, a value is coerced to its declared type (or refused)."""
    if isinstance(raw, cls):
        return raw
    if not isinstance(raw, Mapping):
        raise UsageError(f"[{where}] must be a table of keys, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(map(str, raw)) - set(fields))
    if unknown:
        raise unknown_setting(f"{where}.{unknown[0]}", where, fields)
    hints = typing.get_type_hints(cls)
    values = {k: coerce(v, hints[k], f"{where}.{k}") for k, v in raw.items()}
    try:
        return cls(**values)
    except UsageError:
        raise
    except (TypeError, ValueError) as exc:
        raise UsageError(f"[{where}]: {exc}") from exc


def _options(hint: Any) -> tuple[list[Any], bool]:
    """The members of a union hint without None, and whether None is allowed."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        args = list(typing.get_args(hint))
        return [a for a in args if a is not type(None)], type(None) in args
    return [hint], False


def coerce(value: Any, hint: Any, name: str) -> Any:
    """`value` as declared type `hint` (ints as floats, strings as enums, lists as
    tuples), or UsageError naming `name`, the value and the type wanted."""
    options, optional = _options(hint)
    if len(options) > 1 or optional:
        if value is None and optional:
            return None
        last: Exception | None = None
        for arg in options:
            try:
                return coerce(value, arg, name)
            except UsageError as exc:
                last = exc
        raise last or UsageError(f"{name}={value!r} has the wrong type")
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return from_mapping(hint, value, name)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(value)
        except ValueError:
            allowed = ", ".join(str(m.value) for m in hint)
            raise SettingError(f"{name}={value!r} is not one of: {allowed}", key=name,
                               value=value) from None
    checks: dict[Any, tuple[Any, str]] = {
        bool: (bool, "true or false"), int: (int, "an integer"), float: ((int, float), "a number"),
        str: (str, "a string"), Path: ((str, Path), "a path string")}
    if hint in checks:
        kinds, what = checks[hint]
        if not isinstance(value, kinds) or (isinstance(value, bool) and hint is not bool):
            raise SettingError(f"{name}={value!r} must be {what}", key=name, value=value)
        return float(value) if hint is float else Path(value) if hint is Path else value
    if typing.get_origin(hint) is tuple:
        if not isinstance(value, (list, tuple)):
            raise SettingError(f"{name}={value!r} must be a list", key=name, value=value)
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(coerce(v, args[0], name) for v in value)
        if len(value) != len(args):
            raise SettingError(f"{name}={value!r} must be a list of {len(args)} values",
                               key=name, value=value)
        return tuple(coerce(v, a, name) for v, a in zip(value, args, strict=True))
    return value


def type_name(hint: Any) -> str:
    """The declared type as docs and --help write it: 'int', 'list of str', 'float or none'."""
    options, optional = _options(hint)
    names = []
    for arg in options:
        if isinstance(arg, type) and issubclass(arg, enum.Enum):
            names.append(" | ".join(repr(m.value) for m in arg))
        elif typing.get_origin(arg) is tuple:
            args = typing.get_args(arg)
            if len(args) == 2 and args[1] is Ellipsis:
                names.append(f"list of {type_name(args[0])}")
            else:
                names.append(f"[{', '.join(type_name(a) for a in args)}]")
        else:
            names.append({Path: "path"}.get(arg, getattr(arg, "__name__", str(arg))))
    return " or ".join(names) + (" or none" if optional else "")


_TRUE: Final = ("true", "yes", "on", "1")
_FALSE: Final = ("false", "no", "off", "0")


def from_text(text: str, hint: Any, key: str) -> Any:
    """A value typed on the command line (`--set key=TEXT`), read as declared type `hint`:
    a string as it is, numbers and true/false parsed, 'none' for an unset optional, a
    list as JSON or comma-separated.  The result then goes through `coerce` as a
    config file's value does."""
    import json

    options, optional = _options(hint)
    if optional and text.strip().lower() in ("none", "null"):
        return None
    if str in options or Path in options:
        if len(text) >= 2 and text[0] == text[-1] == '"':  # a JSON string: its quotes go
            try:
                return json.loads(text)
            except json.JSONDecodeError:
                pass
        return text
    wrong = SettingError(f"--set {key}={text}: {key} is {type_name(hint)}; give e.g. "
                         f"{key}={_example(hint)}", key=key, value=text)
    for arg in options:
        if isinstance(arg, type) and issubclass(arg, enum.Enum):
            return text
        if arg is bool:
            word = text.strip().lower()
            if word in _TRUE or word in _FALSE:
                return word in _TRUE
        elif arg in (int, float):
            try:
                return arg(text)
            except ValueError:
                continue
        elif typing.get_origin(arg) is tuple:
            if text.lstrip().startswith("["):
                try:
                    return json.loads(text)
                except json.JSONDecodeError:
                    raise wrong from None
            return [p.strip() for p in text.split(",") if p.strip()]
        elif isinstance(arg, type) and dataclasses.is_dataclass(arg):
            if text.lstrip().startswith("{"):
                try:
                    return json.loads(text)
                except json.JSONDecodeError:
                    pass
            raise SettingError(f"--set {key}={text}: {key} is a section: set its keys, e.g. "
                               f"{key}.{dataclasses.fields(arg)[0].name}=...", key=key, value=text)
    raise wrong


def _example(hint: Any) -> str:
    options, _ = _options(hint)
    first = options[0]
    if isinstance(first, type) and issubclass(first, enum.Enum):
        return str(next(iter(first)).value)
    return {bool: "true", int: "8", float: "0.5"}.get(first, "a,b")
