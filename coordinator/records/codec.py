"""Strict JSON encoding and decoding of record fields, driven by type hints.

`coordinator.records.records` declares records as frozen dataclasses; this module
turns a field's type hint into a decoder once (the hot path of every poll
reads records, and resolving hints per value cost more than the JSON parse)
and checks every value: a corrupt or hostile file fails with the field's name
and what was expected, never with a stray exception.
"""

from __future__ import annotations

import enum
import functools
import math
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Union

from coordinator.errors import MalformedRecordError


def _is_record(obj: Any) -> bool:
    """A records.Record (class or instance): it encodes and decodes itself."""
    return hasattr(obj, "to_json") and hasattr(obj, "from_fields")


def encode(value: Any) -> Any:
    """A record field's value as JSON: enums by value, tuples as lists, records as objects."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return [encode(v) for v in value]
    if _is_record(value):
        return {k: v for k, v in value.to_json().items() if k not in ("schema", "version")}
    if isinstance(value, dict):
        return {str(k): encode(v) for k, v in value.items()}
    return value


Decoder = Callable[[Any, str, Path], Any]


@functools.cache
def decoder(hint: Any) -> Decoder:
    """A strict decoder for one type hint, built once per hint.

    Reading records is the hot path of every poll; resolving the hint's shape
    (typing.get_origin and friends) on every value cost more than the JSON
    parse, so it happens here, once.
    """
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        return _union(hint)
    if hint is Any:
        return lambda value, name, path: value
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return _member(hint)
    if isinstance(hint, type) and _is_record(hint):
        return _nested(hint)
    if origin is tuple:
        return _tuple(hint)
    if origin is dict or hint is dict:
        return _mapping(hint)
    if hint in _SCALARS:
        return _SCALARS[hint]
    raise TypeError(f"records.py cannot decode type {hint!r}")


def _union(hint: Any) -> Decoder:
    args = typing.get_args(hint)
    nullable = type(None) in args
    options = [decoder(arg) for arg in args if arg is not type(None)]

    def union(value: Any, name: str, path: Path) -> Any:
        if value is None and nullable:
            return None
        errors = []
        for option in options:
            try:
                return option(value, name, path)
            except MalformedRecordError as exc:
                errors.append(exc.problem)
        raise MalformedRecordError(path, "; ".join(errors))

    return union


def _member(hint: type[enum.Enum]) -> Decoder:
    members = {m.value: m for m in hint}
    allowed = ", ".join(repr(v) for v in members)

    def member(value: Any, name: str, path: Path) -> Any:
        try:
            return members[value]
        except (KeyError, TypeError):
            raise MalformedRecordError(
                path, f"field {name!r} is {value!r}, expected one of {allowed}"
            ) from None

    return member


def _nested(hint: Any) -> Decoder:
    def nested(value: Any, name: str, path: Path) -> Any:
        if not isinstance(value, dict):
            raise MalformedRecordError(path, f"field {name!r} must be an object")
        return hint.from_fields(value, path)

    return nested


def _tuple(hint: Any) -> Decoder:
    args = typing.get_args(hint)
    if len(args) == 2 and args[1] is Ellipsis:
        item = decoder(args[0])

        def sequence(value: Any, name: str, path: Path) -> Any:
            if not isinstance(value, list):
                raise MalformedRecordError(path, f"field {name!r} must be a list, got {value!r}")
            return tuple(item(v, name, path) for v in value)

        return sequence
    items = [decoder(a) for a in args]

    def fixed(value: Any, name: str, path: Path) -> Any:
        if not isinstance(value, list):
            raise MalformedRecordError(path, f"field {name!r} must be a list, got {value!r}")
        if len(value) != len(items):
            raise MalformedRecordError(path, f"field {name!r} must have {len(items)} items")
        return tuple(d(v, name, path) for v, d in zip(value, items, strict=True))

    return fixed


def _mapping(hint: Any) -> Decoder:
    args = typing.get_args(hint)
    entry = decoder(args[1]) if args else None

    def mapping(value: Any, name: str, path: Path) -> Any:
        if not isinstance(value, dict):
            raise MalformedRecordError(path, f"field {name!r} must be an object")
        if entry is None:
            return dict(value)
        return {str(k): entry(v, name, path) for k, v in value.items()}

    return mapping


def _boolean(value: Any, name: str, path: Path) -> Any:
    if not isinstance(value, bool):
        raise MalformedRecordError(path, f"field {name!r} must be true or false")
    return value


def _integer(value: Any, name: str, path: Path) -> Any:
    if isinstance(value, bool) or not isinstance(value, int):
        raise MalformedRecordError(path, f"field {name!r} must be an integer, got {value!r}")
    return value


def _number(value: Any, name: str, path: Path) -> Any:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value):
        raise MalformedRecordError(path, f"field {name!r} must be a finite number")
    return float(value)


def _string(value: Any, name: str, path: Path) -> Any:
    if not isinstance(value, str):
        raise MalformedRecordError(path, f"field {name!r} must be a string, got {value!r}")
    return value


_SCALARS: dict[Any, Decoder] = {bool: _boolean, int: _integer, float: _number, str: _string}
