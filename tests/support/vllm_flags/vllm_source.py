"""vLLM's source as tests/support/vllm_flags/extract_vllm_flags.py reads it: files parsed with `ast`,
names resolved across modules, and the small AST queries the extractor needs.

vllm is never imported; only the standard library is used.
"""

from __future__ import annotations

import ast
import builtins
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

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


def find_function(body: list[ast.stmt], name: str, where: str) -> ast.FunctionDef:
    for stmt in body:
        if isinstance(stmt, ast.FunctionDef) and stmt.name == name:
            return stmt
    raise ExtractError(f"{where}: no function {name}: the extractor needs updating for this "
                       "vLLM release")


def class_body(cls: Local) -> list[ast.stmt]:
    assert isinstance(cls.node, ast.ClassDef), cls
    return cls.node.body


def method(cls: Local, name: str) -> ast.FunctionDef:
    return find_function(class_body(cls), name, f"{cls.module} class {cls.name}")


def calls(node: ast.AST, attr: str) -> Iterator[ast.Call]:
    """Calls of `something.attr(...)` anywhere under `node`."""
    for sub in ast.walk(node):
        if (isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute)
                and sub.func.attr == attr):
            yield sub


def require_call(func: ast.FunctionDef, owner: str, attr: str, where: str) -> None:
    if not any(isinstance(c.func, ast.Attribute) and isinstance(c.func.value, ast.Name)
               and c.func.value.id == owner for c in calls(func, attr)):
        raise ExtractError(f"{where}: {func.name} no longer calls {owner}.{attr}: the flags may "
                           "come from elsewhere in this release; update the extractor")


def is_config_class(node: ast.ClassDef) -> bool:
    """Decorated @config / @dataclass: vLLM parses such a field's value as JSON."""
    for deco in node.decorator_list:
        target = deco.func if isinstance(deco, ast.Call) else deco
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if name in ("config", "dataclass"):
            return True
    return False


