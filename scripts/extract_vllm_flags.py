#!/usr/bin/env python3
"""Write what `vllm serve` accepts on its command line, read from vLLM's source, as JSON.

Why: rollout/vllm_engine.py builds a `vllm serve` argv without importing
vllm, so nothing at run time notices when a release renames a flag, changes
the type of its value or turns it into a --x/--no-x switch.  The fixture this
script writes (tests/rollout/fixtures/vllm_serve_<version>.json) lets
tests/rollout/test_vllm_flags.py check that argv flag by flag on a CPU box.

How: the source is an unpacked wheel of the pinned release (the `vllm`
package directory), parsed with `ast`; vllm is never imported, and only the
standard library is used.  What each flag accepts is derived from its
dataclass field's annotation the way vLLM derives argparse keywords from it
(engine/arg_utils.py `get_kwargs`): bool -> BooleanOptionalAction, Literal ->
choices, list -> nargs "+", int/float -> that type, Optional -> the same plus
"None".  Only the shapes our flags have are modelled; anything else (a nested
config parsed as JSON, dict values, an add_argument call with its own
keywords, kwargs edited after get_kwargs) stops the script with an error that
names the file and the flag instead of guessing.

The fixture holds facts only (names, types, choices, file:line), no vLLM code:
  vllm_version, commit  vllm/_version.py
  sources               the files read, relative to the wheel root
  subcommand            `serve` and the parser function it uses
  positionals           positional arguments of that parser (model_tag)
  flags                 for each flag in FLAGS: option_strings, kind
                        ("value": type, choices, nargs | "boolean_optional"),
                        field (the config dataclass field), source (file:line
                        of the add_argument call), and special_cased_at when
                        vLLM's get_kwargs treats the field by name
  dev_mode_env          VLLM_SERVER_DEV_MODE: how envs.py parses it, and where
                        it gates the development routes
  dev_routes            [method, path] of every development route

Usage:
    python scripts/extract_vllm_flags.py --source /tmp/vllm_wheels/src_v0.29.0/vllm \\
        --out tests/rollout/fixtures/vllm_serve_0.29.0.json
"""

from __future__ import annotations

import argparse
import ast
import builtins
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

# The flags rollout/vllm_engine.py passes (or may pass) to `vllm serve`.
FLAGS: Final = (
    "--host",
    "--port",
    "--api-key",
    "--served-model-name",
    "--tensor-parallel-size",
    "--data-parallel-size",
    "--gpu-memory-utilization",
    "--max-model-len",
    "--dtype",
    "--seed",
    "--generation-config",
    "--enable-sleep-mode",
    "--max-logprobs",
)

# Where vLLM keeps each fact, relative to the wheel root.
VERSION_FILE: Final = "vllm/_version.py"
ENGINE_ARGS: Final = "vllm/engine/arg_utils.py"  # EngineArgs/AsyncEngineArgs.add_cli_args
FRONTEND_ARGS: Final = "vllm/entrypoints/launchers/cli_args.py"  # FrontendArgs, make_arg_parser
SERVE_CLI: Final = "vllm/entrypoints/cli/serve.py"  # the `serve` subcommand
ENVS: Final = "vllm/envs.py"
API_ROUTERS: Final = "vllm/entrypoints/launchers/api_server/routers.py"  # dev-mode gate
SERVE_ROUTERS: Final = "vllm/entrypoints/serve/__init__.py"  # which dev routers exist

SUBCOMMAND: Final = "serve"
PARSER_FUNCTION: Final = "make_arg_parser"
DEV_MODE_ENV: Final = "VLLM_SERVER_DEV_MODE"
DEV_ROUTERS_FUNCTION: Final = "register_vllm_dev_api_routers"
HTTP_METHODS: Final = ("get", "post", "put", "patch", "delete")
_TYPING_MODULES: Final = ("typing", "typing_extensions")


class ExtractError(Exception):
    """The source is not shaped the way this script understands; the message says where."""


# --- the source tree -------------------------------------------------------


@dataclass(frozen=True)
class Local:
    """A name defined in the wheel: a class or an assignment at module level."""

    module: str  # relative path, e.g. "vllm/config/model.py"
    node: ast.ClassDef | ast.Assign | ast.AnnAssign

    @property
    def name(self) -> str:
        return self.node.name if isinstance(self.node, ast.ClassDef) else ast.unparse(self.node)


@dataclass(frozen=True)
class External:
    """A name from outside the wheel (or a builtin), by dotted path."""

    dotted: str  # "typing.Literal", "torch.dtype", "builtins.int"


class SourceTree:
    """The unpacked `vllm` package: parsed modules, name lookup, and the files read."""

    def __init__(self, package_dir: Path) -> None:
        if package_dir.name != "vllm" or not (package_dir / "__init__.py").is_file():
            raise ExtractError(
                f"--source {package_dir} is not the `vllm` package directory of an unpacked "
                "wheel (it must be named vllm and hold __init__.py), e.g. "
                "/tmp/vllm_wheels/src_v0.29.0/vllm"
            )
        self.root = package_dir.parent
        self.read: set[str] = set()
        self._trees: dict[str, ast.Module] = {}

    def tree(self, rel: str) -> ast.Module:
        if rel not in self._trees:
            path = self.root / rel
            if not path.is_file():
                raise ExtractError(f"{rel} is missing from {self.root}: is this a vLLM wheel?")
            self._trees[rel] = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
            self.read.add(rel)
        return self._trees[rel]

    def module_file(self, dotted: str) -> str | None:
        """"vllm.config" -> "vllm/config/__init__.py"; None outside the wheel."""
        parts = dotted.split(".")
        if parts[0] != "vllm":
            return None
        base = self.root.joinpath(*parts)
        for candidate in (base / "__init__.py", base.with_suffix(".py")):
            if candidate.is_file():
                return candidate.relative_to(self.root).as_posix()
        return None

    @staticmethod
    def absolute(rel: str, node: ast.ImportFrom) -> str:
        """The module an `from X import` in `rel` names, resolving relative imports."""
        if node.level == 0:
            return node.module or ""
        package = rel.removesuffix(".py").split("/")
        package = package[: len(package) - node.level]  # drops the module (or __init__)
        return ".".join(package + ([node.module] if node.module else []))

    def resolve(self, rel: str, name: str, depth: int = 0) -> Local | External:
        """What `name` means at module level in `rel`, following re-exports."""
        if depth > 20:
            raise ExtractError(f"{rel}: import cycle while looking up {name}")
        for stmt in _top_level(self.tree(rel)):
            if isinstance(stmt, ast.ClassDef) and stmt.name == name:
                return Local(rel, stmt)
            if isinstance(stmt, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in stmt.targets
            ):
                return Local(rel, stmt)
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and stmt.target.id == name and stmt.value is not None):
                return Local(rel, stmt)
            if isinstance(stmt, ast.ImportFrom):
                for alias in stmt.names:
                    if (alias.asname or alias.name) == name:
                        module = self.absolute(rel, stmt)
                        target = self.module_file(module)
                        if target is not None:
                            return self.resolve(target, alias.name, depth + 1)
                        return External(f"{module}.{alias.name}")
            if isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    if (alias.asname or alias.name.split(".")[0]) == name:
                        return External(alias.name if alias.asname else name)
        if hasattr(builtins, name):
            return External(f"builtins.{name}")
        raise ExtractError(f"{rel}: {name} is neither defined nor imported at module level")

    def resolve_class(self, rel: str, name: str, why: str) -> Local:
        found = self.resolve(rel, name)
        if not (isinstance(found, Local) and isinstance(found.node, ast.ClassDef)):
            raise ExtractError(f"{rel}: {name} ({why}) is not a class defined in the wheel")
        return found


def _top_level(tree: ast.Module) -> Iterator[ast.stmt]:
    """Module-level statements, including those under `if TYPE_CHECKING:` and try/except."""
    stack = list(reversed(tree.body))
    while stack:
        stmt = stack.pop()
        yield stmt
        if isinstance(stmt, ast.If):
            stack.extend(reversed(stmt.body + stmt.orelse))
        elif isinstance(stmt, ast.Try):
            nested = stmt.body + [s for h in stmt.handlers for s in h.body] + stmt.orelse
            stack.extend(reversed(nested))


def _function(body: list[ast.stmt], name: str, where: str) -> ast.FunctionDef:
    for stmt in body:
        if isinstance(stmt, ast.FunctionDef) and stmt.name == name:
            return stmt
    raise ExtractError(f"{where}: no function {name}: the extractor needs updating for this "
                       "vLLM release")


def _class_body(cls: Local) -> list[ast.stmt]:
    assert isinstance(cls.node, ast.ClassDef), cls
    return cls.node.body


def _method(cls: Local, name: str) -> ast.FunctionDef:
    return _function(_class_body(cls), name, f"{cls.module} class {cls.name}")


def _calls(node: ast.AST, attr: str) -> Iterator[ast.Call]:
    """Calls of `something.attr(...)` anywhere under `node`."""
    for sub in ast.walk(node):
        if (isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute)
                and sub.func.attr == attr):
            yield sub


def _require_call(func: ast.FunctionDef, owner: str, attr: str, where: str) -> None:
    if not any(isinstance(c.func, ast.Attribute) and isinstance(c.func.value, ast.Name)
               and c.func.value.id == owner for c in _calls(func, attr)):
        raise ExtractError(f"{where}: {func.name} no longer calls {owner}.{attr}: the flags may "
                           "come from elsewhere in this release; update the extractor")


def _is_config_class(node: ast.ClassDef) -> bool:
    """Decorated @config / @dataclass: vLLM parses such a field's value as JSON."""
    for deco in node.decorator_list:
        target = deco.func if isinstance(deco, ast.Call) else deco
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if name in ("config", "dataclass"):
            return True
    return False


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
            kind = "config" if _is_config_class(node) else "other"
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
                            "extend scripts/extract_vllm_flags.py before using this flag")

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


# --- flags -----------------------------------------------------------------


@dataclass
class FlagSite:
    """One add_argument call (or FrontendArgs field) that defines an option."""

    option_strings: list[str]
    source: str  # rel:line of the add_argument call
    # The dataclass whose field gives the kwargs: (module it is named in, class name).
    config: tuple[str, str] | None = None
    field_name: str | None = None
    explicit: dict[str, ast.expr] = field(default_factory=dict)  # keywords given by hand
    # Functions that may edit the kwargs after get_kwargs: (rel, function, variables).
    editors: list[tuple[str, ast.FunctionDef, frozenset[str]]] = field(default_factory=list)


def _kwargs_vars(func: ast.FunctionDef) -> dict[str, str]:
    """`x_kwargs = get_kwargs(SomeConfig)` assignments in func: variable -> class name."""
    found: dict[str, str] = {}
    for node in ast.walk(func):
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name) and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Name) and node.value.func.id == "get_kwargs"
                and len(node.value.args) == 1 and isinstance(node.value.args[0], ast.Name)):
            found[node.targets[0].id] = node.value.args[0].id
    return found


def _subscript_key(node: ast.AST) -> tuple[str, str] | None:
    """`var["key"]` -> (var, key)."""
    if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name)
            and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str)):
        return node.value.id, node.slice.value
    return None


def _argparse_sites(rel: str, func: ast.FunctionDef) -> list[FlagSite]:
    """The add_argument calls in func, with the config field their `**x_kwargs["f"]` names."""
    kwargs_vars = _kwargs_vars(func)
    sites: list[FlagSite] = []
    for call in _calls(func, "add_argument"):
        options = [a.value for a in call.args
                   if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        if not options:
            continue  # built from a variable: FrontendArgs' loop, handled on its own
        site = FlagSite(options, f"{rel}:{call.lineno}",
                        explicit={k.arg: k.value for k in call.keywords if k.arg is not None})
        for kw in call.keywords:
            key = _subscript_key(kw.value) if kw.arg is None else None
            if key is not None and key[0] in kwargs_vars:
                class_name = kwargs_vars[key[0]]
                site.config = (rel, class_name)
                site.field_name = key[1]
                same = frozenset(v for v, c in kwargs_vars.items() if c == class_name)
                site.editors = [(rel, func, same)]
        sites.append(site)
    return sites


def _edits(func: ast.FunctionDef, variables: frozenset[str], field_name: str) -> list[int]:
    """Lines in func that touch `var["field_name"]` (var in variables) other than to unpack it."""
    unpacked = {id(kw.value) for call in _calls(func, "add_argument")
                for kw in call.keywords if kw.arg is None}
    return [node.lineno for node in ast.walk(func) if isinstance(node, ast.Subscript)
            and (key := _subscript_key(node)) is not None and key[0] in variables
            and key[1] == field_name and id(node) not in unpacked]


def _class_chain(src: SourceTree, cls: Local) -> list[Local]:
    """cls and its bases defined in the wheel, most derived first."""
    assert isinstance(cls.node, ast.ClassDef), cls
    chain = [cls]
    for base in cls.node.bases:
        if isinstance(base, ast.Name):
            found = src.resolve(cls.module, base.id)
            if isinstance(found, Local) and isinstance(found.node, ast.ClassDef):
                chain += _class_chain(src, found)
    return chain


def _field(src: SourceTree, cls: Local, name: str) -> tuple[str, ast.AnnAssign]:
    for owner in _class_chain(src, cls):
        for stmt in _class_body(owner):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and stmt.target.id == name):
                return owner.module, stmt
    raise ExtractError(f"{cls.module}: class {cls.name} has no field {name}")


def _frontend_sites(src: SourceTree) -> list[FlagSite]:
    """FrontendArgs registers `--<field-name>` for each of its fields, in a loop."""
    frontend = src.resolve_class(FRONTEND_ARGS, "FrontendArgs", "the frontend flags")
    chain = _class_chain(src, frontend)
    methods = [(owner.module, stmt) for owner in chain for stmt in _class_body(owner)
               if isinstance(stmt, ast.FunctionDef)]
    loop_call = next((f"{rel}:{call.lineno}" for rel, func in methods
                      if func.name == "add_cli_args" for call in _calls(func, "add_argument")
                      if any(isinstance(a, ast.JoinedStr) for a in call.args)), None)
    if loop_call is None:
        raise ExtractError(f"{FRONTEND_ARGS}: FrontendArgs.add_cli_args no longer registers "
                           "`--<field>` for each field; update the extractor")
    # _customize_cli_kwargs(cls, frontend_kwargs) may edit any field's keywords.
    editors = [(rel, func, frozenset(a.arg for a in func.args.args if a.arg.endswith("kwargs")))
               for rel, func in methods if func.name == "_customize_cli_kwargs"]
    sites: list[FlagSite] = []
    seen: set[str] = set()
    for owner in chain:
        for stmt in _class_body(owner):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and stmt.target.id not in seen
                    and "ClassVar" not in ast.unparse(stmt.annotation)):
                seen.add(stmt.target.id)
                sites.append(FlagSite([f"--{stmt.target.id.replace('_', '-')}"], loop_call,
                                      config=(FRONTEND_ARGS, "FrontendArgs"),
                                      field_name=stmt.target.id,
                                      editors=editors))
    return sites


@dataclass
class FlagIndex:
    """Every option of `vllm serve` this script can see."""

    sites: list[FlagSite]
    positionals: list[dict[str, Any]]
    special_cases: tuple[str, ast.FunctionDef]  # vLLM's get_kwargs worker: names it treats apart


def index_flags(src: SourceTree) -> FlagIndex:
    """The parser make_arg_parser builds: its own arguments, FrontendArgs', the engine's."""
    engine_args = src.resolve_class(ENGINE_ARGS, "EngineArgs", "the engine flags")
    async_args = src.resolve_class(ENGINE_ARGS, "AsyncEngineArgs", "the serve engine flags")
    async_func = _method(async_args, "add_cli_args")
    _require_call(async_func, "EngineArgs", "add_cli_args", ENGINE_ARGS)
    parser_func = _function(src.tree(FRONTEND_ARGS).body, PARSER_FUNCTION, FRONTEND_ARGS)
    _require_call(parser_func, "FrontendArgs", "add_cli_args", FRONTEND_ARGS)
    _require_call(parser_func, "AsyncEngineArgs", "add_cli_args", FRONTEND_ARGS)

    sites = (_argparse_sites(FRONTEND_ARGS, parser_func) + _frontend_sites(src)
             + _argparse_sites(ENGINE_ARGS, async_func)
             + _argparse_sites(ENGINE_ARGS, _method(engine_args, "add_cli_args")))
    positionals = []
    for site in [s for s in sites if not s.option_strings[0].startswith("-")]:
        sites.remove(site)
        nargs = site.explicit.get("nargs")
        positionals.append({
            "name": site.option_strings[0],
            "nargs": nargs.value if isinstance(nargs, ast.Constant) else None,
            "source": site.source,
        })
    special = _function(src.tree(ENGINE_ARGS).body, "_compute_kwargs", ENGINE_ARGS)
    return FlagIndex(sites, positionals, (ENGINE_ARGS, special))


def describe_flag(src: SourceTree, index: FlagIndex, flag: str) -> dict[str, Any]:
    """The fixture entry for one flag; fails naming the flag if it is missing or unreadable."""
    matches = [s for s in index.sites if flag in s.option_strings]
    if not matches:
        raise ExtractError(
            f"{flag} is not an option of `vllm {SUBCOMMAND}` in {src.root}: searched "
            f"{FRONTEND_ARGS} ({PARSER_FUNCTION}, FrontendArgs) and {ENGINE_ARGS} "
            "(EngineArgs/AsyncEngineArgs.add_cli_args); it was renamed or removed in this "
            "release, so update rollout/vllm_engine.py and FLAGS"
        )
    if len(matches) > 1:
        raise ExtractError(f"{flag} is registered twice: {[s.source for s in matches]}")
    site = matches[0]
    if site.explicit or site.config is None or site.field_name is None:
        raise ExtractError(f"{site.source}: {flag} is defined with its own add_argument keywords "
                           f"{sorted(site.explicit)}, not from a config field; extend the "
                           "extractor")
    config = src.resolve_class(*site.config, f"the config class of {flag}")
    field_id = f"{site.config[1]}.{site.field_name}"
    for rel, func, variables in site.editors:
        lines = _edits(func, variables, site.field_name)
        if lines:
            raise ExtractError(
                f"{rel}:{lines[0]}: {func.name} edits the argparse keywords of {flag} "
                f"({field_id}) after get_kwargs; the fixture cannot tell what changed, so "
                "read it there and extend the extractor"
            )
    field_rel, stmt = _field(src, config, site.field_name)
    where = f"{field_rel}:{stmt.lineno}"
    entry: dict[str, Any] = {"option_strings": list(site.option_strings)}
    entry.update(accepts(HintReader(src).hints(field_rel, stmt.annotation), flag, where))
    if entry["kind"] == "boolean_optional":  # argparse adds --no-X for each --X
        entry["option_strings"] += [f"--no-{o[2:]}" for o in site.option_strings
                                    if o.startswith("--")]
    entry.update(field=field_id, field_source=where, source=site.source)
    rel, special = index.special_cases
    named = [n.lineno for n in ast.walk(special)
             if isinstance(n, ast.Constant) and n.value == site.field_name]
    if named:  # e.g. max_model_len: a parser that also takes "4k" or "auto"
        entry["special_cased_at"] = f"{rel}:{named[0]}"
    return entry


# --- the serve subcommand, the dev-mode switch, the dev routes -------------


def subcommand(src: SourceTree) -> dict[str, Any]:
    """Checks that `vllm serve` builds its parser with make_arg_parser."""
    for stmt in src.tree(SERVE_CLI).body:
        if not isinstance(stmt, ast.ClassDef):
            continue
        named = any(isinstance(s, ast.Assign) and isinstance(s.value, ast.Constant)
                    and s.value.value == SUBCOMMAND
                    and any(isinstance(t, ast.Name) and t.id == "name" for t in s.targets)
                    for s in stmt.body)
        if not named:
            continue
        for node in ast.walk(stmt):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == PARSER_FUNCTION):
                return {"name": SUBCOMMAND, "parser": PARSER_FUNCTION,
                        "source": f"{SERVE_CLI}:{node.lineno}"}
    raise ExtractError(f"{SERVE_CLI}: no `{SUBCOMMAND}` subcommand class calling "
                       f"{PARSER_FUNCTION}; update the extractor")


def dev_mode_env(src: SourceTree) -> dict[str, Any]:
    """How envs.py reads VLLM_SERVER_DEV_MODE, and where it gates the dev routes."""
    parse: dict[str, Any] | None = None
    for node in ast.walk(src.tree(ENVS)):
        if not isinstance(node, ast.Dict):
            continue
        for key, value in zip(node.keys, node.values, strict=True):
            if not (isinstance(key, ast.Constant) and key.value == DEV_MODE_ENV):
                continue
            # Expected: lambda: bool(<conv>(os.getenv(NAME, default)))
            body = value.body if isinstance(value, ast.Lambda) else value
            outer = body.args[0] if (isinstance(body, ast.Call) and isinstance(
                body.func, ast.Name) and body.func.id == "bool" and body.args) else None
            getenv = outer.args[0] if (isinstance(outer, ast.Call) and isinstance(
                outer.func, ast.Name) and outer.args) else None
            if not (isinstance(outer, ast.Call) and isinstance(outer.func, ast.Name)
                    and isinstance(getenv, ast.Call) and isinstance(getenv.func, ast.Attribute)
                    and getenv.func.attr == "getenv"):
                raise ExtractError(f"{ENVS}:{key.lineno}: {DEV_MODE_ENV} is no longer parsed as "
                                   "bool(<conversion>(os.getenv(...))); read it and update the "
                                   "extractor")
            default = getenv.args[1] if len(getenv.args) > 1 else None
            parse = {"name": DEV_MODE_ENV, "parse": outer.func.id,
                     "default": default.value if isinstance(default, ast.Constant) else None,
                     "source": f"{ENVS}:{key.lineno}"}
    if parse is None:
        raise ExtractError(f"{ENVS}: no entry for {DEV_MODE_ENV}: the development routes may "
                           "be enabled differently in this release")
    for node in ast.walk(src.tree(API_ROUTERS)):
        if (isinstance(node, ast.If) and isinstance(node.test, ast.Attribute)
                and node.test.attr == DEV_MODE_ENV
                and any(isinstance(c, ast.Call) and isinstance(c.func, ast.Name)
                        and c.func.id == DEV_ROUTERS_FUNCTION
                        for s in node.body for c in ast.walk(s))):
            parse["gates_dev_routes_at"] = f"{API_ROUTERS}:{node.lineno}"
            return parse
    raise ExtractError(f"{API_ROUTERS}: {DEV_ROUTERS_FUNCTION} is not called under "
                       f"`if envs.{DEV_MODE_ENV}:`; read how the dev routes are enabled")


def dev_routes(src: SourceTree) -> list[list[str]]:
    """[METHOD, path] of each route the dev routers registered in serve/__init__.py define."""
    register = _function(src.tree(SERVE_ROUTERS).body, DEV_ROUTERS_FUNCTION, SERVE_ROUTERS)
    routes: list[list[str]] = []
    for node in ast.walk(register):
        if not isinstance(node, ast.ImportFrom):
            continue
        rel = src.module_file(src.absolute(SERVE_ROUTERS, node))
        if rel is None:
            raise ExtractError(f"{SERVE_ROUTERS}:{node.lineno}: cannot find the module of "
                               f"{ast.unparse(node)!r}")
        routes += _router_routes(src, rel)
    if not routes:
        raise ExtractError(f"{SERVE_ROUTERS}: {DEV_ROUTERS_FUNCTION} imports no routers")
    return routes


def _router_routes(src: SourceTree, rel: str) -> list[list[str]]:
    prefixes: dict[str, str] = {}  # router variable -> its prefix
    for stmt in src.tree(rel).body:
        if (isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call)
                and isinstance(stmt.value.func, ast.Name) and stmt.value.func.id == "APIRouter"
                and isinstance(stmt.targets[0], ast.Name)):
            prefix = next((k.value for k in stmt.value.keywords if k.arg == "prefix"), None)
            if prefix is None:
                prefixes[stmt.targets[0].id] = ""
            elif isinstance(prefix, ast.Constant) and isinstance(prefix.value, str):
                prefixes[stmt.targets[0].id] = prefix.value
            else:
                raise ExtractError(f"{rel}:{stmt.lineno}: the router prefix is not a string "
                                   "constant; read the routes there by hand")
    routes: list[list[str]] = []
    for stmt in src.tree(rel).body:
        if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for deco in stmt.decorator_list:
            if not (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute)
                    and isinstance(deco.func.value, ast.Name)
                    and deco.func.value.id in prefixes and deco.args
                    and isinstance(deco.args[0], ast.Constant)):
                continue
            path = prefixes[deco.func.value.id] + str(deco.args[0].value)
            if deco.func.attr in HTTP_METHODS:
                routes.append([deco.func.attr.upper(), path])
            elif deco.func.attr == "api_route":
                methods = next((k.value for k in deco.keywords if k.arg == "methods"), None)
                if not isinstance(methods, (ast.List, ast.Tuple)):
                    raise ExtractError(f"{rel}:{deco.lineno}: api_route without literal methods")
                routes += [[str(ast.literal_eval(m)).upper(), path] for m in methods.elts]
    return routes


# --- the whole fixture -----------------------------------------------------


def read_version(src: SourceTree) -> tuple[str, str]:
    values: dict[str, str] = {}
    for stmt in src.tree(VERSION_FILE).body:
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Constant):
            for target in stmt.targets:
                if isinstance(target, ast.Name) and isinstance(stmt.value.value, str):
                    values[target.id] = stmt.value.value
    if "__version__" not in values or "__commit_id__" not in values:
        raise ExtractError(f"{VERSION_FILE}: no string __version__ and __commit_id__; is this "
                           "a released wheel (a source checkout has no _version.py)?")
    return values["__version__"], values["__commit_id__"]


def extract(package_dir: Path, flags: tuple[str, ...] = FLAGS) -> dict[str, Any]:
    """The fixture for the vLLM package unpacked at package_dir (its `vllm` directory)."""
    src = SourceTree(package_dir)
    version, commit = read_version(src)
    index = index_flags(src)
    fixture: dict[str, Any] = {
        "vllm_version": version,
        "commit": commit,
        "generated_by": "scripts/extract_vllm_flags.py",
        "sources": [],  # filled in last, when every file has been read
        "subcommand": subcommand(src),
        "positionals": index.positionals,
        "flags": {flag: describe_flag(src, index, flag) for flag in flags},
        "dev_mode_env": dev_mode_env(src),
        "dev_routes": dev_routes(src),
    }
    fixture["sources"] = sorted(src.read)
    return fixture


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, required=True,
                        help="the `vllm` package directory of an unpacked wheel")
    parser.add_argument("--out", type=Path, required=True, help="the JSON fixture to write")
    args = parser.parse_args(argv)
    try:
        fixture = extract(args.source)
    except (ExtractError, SyntaxError) as exc:
        print(f"extract_vllm_flags: error: {exc}", file=sys.stderr)
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(fixture, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}: vLLM {fixture['vllm_version']} ({fixture['commit']}), "
          f"{len(fixture['flags'])} flags, {len(fixture['dev_routes'])} dev routes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
