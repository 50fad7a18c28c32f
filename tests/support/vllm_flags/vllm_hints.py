"""What a flag accepts, derived from its dataclass field's type annotation the way
vLLM's engine/arg_utils.py `get_kwargs` derives argparse keywords from it
(bool -> BooleanOptionalAction, Literal -> choices, list -> nargs "+",
int/float -> that type, Optional -> the same plus "None").  Only the shapes
our flags have are modelled; anything else raises ExtractError naming the flag.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any, Final

from vllm_source import External, ExtractError, Local, SourceTree, is_config_class

_TYPING_MODULES: Final = ("typing", "typing_extensions")

# --- type hints ------------------------------------------------------------


@dataclass(frozen=True)
class Hint:
    """One member of a field annotation's union, reduced to what argparse cares about.

    kind: none, bool, int, float, str, literal, list, tuple, set, dict, config, other.
    """

    kind: str
    literals: tuple[Any, ...] = ()  # literal
    items: frozenset[Hint] = frozenset()  # list/tuple/set element hints
    fixed_length: int | None = None  # tuple[int, int] (not tuple[int, ...])
    name: str = ""  # config/other: the class


_BUILTIN_KINDS: Final = {"bool", "int", "float", "str", "list", "tuple", "set", "dict"}
_TYPING_COLLECTIONS: Final = {"List": "list", "Tuple": "tuple", "Set": "set", "Dict": "dict"}


class HintReader:
    """Evaluates annotations (AST) in their module to a set of Hints."""

    def __init__(self, src: SourceTree) -> None:
        self.src = src

    def hints(self, rel: str, node: ast.expr, depth: int = 0) -> frozenset[Hint]:
        if depth > 30:
            raise ExtractError(f"{rel}:{node.lineno}: annotation nests too deeply to read")
        if isinstance(node, ast.Constant):
            if node.value is None:
                return frozenset({Hint("none")})
            if isinstance(node.value, str):  # a forward reference
                return self.hints(rel, ast.parse(node.value, mode="eval").body, depth + 1)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            return self.hints(rel, node.left, depth + 1) | self.hints(rel, node.right, depth + 1)
        if isinstance(node, ast.Name):
            return self._named(self.src.resolve(rel, node.id), depth)
        if isinstance(node, ast.Attribute):
            return frozenset({Hint("other", name=ast.unparse(node))})
        if isinstance(node, ast.Subscript):
            return self._subscript(rel, node, depth)
        raise ExtractError(f"{rel}:{node.lineno}: cannot read the annotation "
                           f"{ast.unparse(node)!r}")

    def _named(self, found: Local | External, depth: int) -> frozenset[Hint]:
        if isinstance(found, External):
            module, _, name = found.dotted.rpartition(".")
            if module == "builtins" and name in _BUILTIN_KINDS:
                return frozenset({Hint(name)})
            if module == "builtins" and name == "None":
                return frozenset({Hint("none")})
            return frozenset({Hint("other", name=found.dotted)})
        node = found.node
        if isinstance(node, ast.ClassDef):
            kind = "config" if is_config_class(node) else "other"
            return frozenset({Hint(kind, name=node.name)})
        if node.value is None or isinstance(node.value, ast.Call):
            raise ExtractError(f"{found.module}:{node.lineno}: a type alias built by a call "
                               "(NewType, TypeVar) is not understood")
        return self.hints(found.module, node.value, depth + 1)  # a type alias

    def _origin(self, rel: str, node: ast.expr) -> str:
        """The generic a subscript applies: "Literal", "Optional", "list", or "other"."""
        if isinstance(node, ast.Name):
            found = self.src.resolve(rel, node.id)
            if isinstance(found, External):
                module, _, name = found.dotted.rpartition(".")
                if module == "builtins" and name in _BUILTIN_KINDS:
                    return name
                if module in _TYPING_MODULES:
                    return _TYPING_COLLECTIONS.get(name, name)
        elif isinstance(node, ast.Attribute) and ast.unparse(node.value) in _TYPING_MODULES:
            return _TYPING_COLLECTIONS.get(node.attr, node.attr)
        return "other"

    def _subscript(self, rel: str, node: ast.Subscript, depth: int) -> frozenset[Hint]:
        origin = self._origin(rel, node.value)
        args = list(node.slice.elts) if isinstance(node.slice, ast.Tuple) else [node.slice]
        if origin == "Optional":
            return self.hints(rel, args[0], depth + 1) | {Hint("none")}
        if origin == "Union":
            return frozenset().union(*(self.hints(rel, a, depth + 1) for a in args))
        if origin == "Annotated":
            return self.hints(rel, args[0], depth + 1)
        if origin == "Literal":
            return frozenset({Hint("literal", literals=self._literals(rel, args, depth))})
        if origin in ("list", "set"):
            return frozenset({Hint(origin, items=self.hints(rel, args[0], depth + 1))})
        if origin == "tuple":
            variadic = any(isinstance(a, ast.Constant) and a.value is Ellipsis for a in args)
            items = [a for a in args
                     if not (isinstance(a, ast.Constant) and a.value is Ellipsis)]
            return frozenset({Hint(
                "tuple",
                items=frozenset().union(*(self.hints(rel, a, depth + 1) for a in items)),
                fixed_length=None if variadic else len(args),
            )})
        if origin == "dict":
            return frozenset({Hint("dict")})
        if origin == "ClassVar":
            raise ExtractError(f"{rel}:{node.lineno}: a ClassVar is not a config field")
        return frozenset({Hint("other", name=ast.unparse(node.value))})

    def _literals(self, rel: str, args: list[ast.expr], depth: int) -> tuple[Any, ...]:
        values: list[Any] = []
        for arg in args:
            if isinstance(arg, ast.Constant):
                values.append(arg.value)
                continue
            nested = self.hints(rel, arg, depth + 1)  # Literal[Alias, ...]
            if len(nested) != 1 or next(iter(nested)).kind != "literal":
                raise ExtractError(f"{rel}:{arg.lineno}: Literal member "
                                   f"{ast.unparse(arg)!r} is not a literal")
            values.extend(next(iter(nested)).literals)
        return tuple(values)


def _type_name(value_type: type, flag: str, where: str) -> str:
    if value_type in (int, float, str):
        return value_type.__name__
    raise ExtractError(f"{where}: {flag} takes {value_type.__name__} values, which the "
                       "fixture cannot describe (int, float or str)")


def _literal_accepts(hint: Hint, all_hints: frozenset[Hint], flag: str,
                     where: str) -> tuple[str, list[Any] | None]:
    """Type and choices of a Literal; choices are left out when plain str is allowed too."""
    kinds = {type(v) for v in hint.literals}
    if len(kinds) != 1:
        names = sorted(k.__name__ for k in kinds)
        raise ExtractError(f"{where}: {flag}'s Literal mixes types {names}")
    type_name = _type_name(kinds.pop(), flag, where)
    if any(h.kind == "str" for h in all_hints):
        return type_name, None  # vLLM shows the options as a metavar, not choices
    return type_name, sorted(hint.literals)


def accepts(hints: frozenset[Hint], flag: str, where: str) -> dict[str, Any]:
    """What argparse accepts for a field with these hints, in vLLM's order of precedence."""
    kinds = {h.kind for h in hints}
    by_kind = {h.kind: h for h in hints}

    def unsupported(what: str) -> ExtractError:
        return ExtractError(f"{where}: {flag} is {what}, which the fixture does not describe; "
                            "extend tests/support/vllm_flags/extract_vllm_flags.py before using this flag")

    if "config" in kinds:
        raise unsupported(f"a nested config ({by_kind['config'].name}) given as JSON")
    if kinds == {"bool", "str", "none"}:
        raise unsupported("optional-valued (a bare flag or one value)")
    if "bool" in kinds:
        return {"kind": "boolean_optional"}
    choices: list[Any] | None = None
    nargs: str | None = None
    if "literal" in kinds:
        if sum(h.kind == "literal" for h in hints) > 1:
            raise unsupported("a union of several Literals")
        type_name, choices = _literal_accepts(by_kind["literal"], hints, flag, where)
    elif kinds & {"tuple", "list", "set"}:
        collection = by_kind[next(k for k in ("tuple", "list", "set") if k in kinds)]
        if collection.fixed_length is not None:
            raise unsupported(f"a fixed-length tuple of {collection.fixed_length}")
        items = collection.items
        nargs = "+"
        if len(items) > 1:  # list[int | str]: vLLM takes such elements as str
            if not any(h.kind == "str" for h in items):
                raise unsupported("a list of a union without str")
            type_name = "str"
        elif next(iter(items)).kind == "literal":
            type_name, choices = _literal_accepts(next(iter(items)), items, flag, where)
        elif next(iter(items)).kind in ("int", "float", "str"):
            type_name = next(iter(items)).kind
        else:
            raise unsupported(f"a list of {next(iter(items)).kind}")
    elif "int" in kinds:
        type_name = "int"
    elif "float" in kinds:
        type_name = "float"
    elif "dict" in kinds:
        raise unsupported("a dict given as JSON")
    elif kinds & {"str", "other"}:
        type_name = "str"
    else:
        raise unsupported(f"typed {sorted(kinds)}")
    if "none" in kinds and choices:
        choices = [*choices, "None"]  # Optional: vLLM accepts the word None too
    return {"kind": "value", "type": type_name, "choices": choices, "nargs": nargs}


