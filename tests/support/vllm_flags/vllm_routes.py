"""The `serve` subcommand, the VLLM_SERVER_DEV_MODE switch and the development routes,
as tests/support/vllm_flags/extract_vllm_flags.py reads them from vLLM's source (with `ast`)."""

from __future__ import annotations

import ast
from typing import Any

from vllm_source import (
    API_ROUTERS,
    DEV_MODE_ENV,
    DEV_ROUTERS_FUNCTION,
    ENVS,
    HTTP_METHODS,
    PARSER_FUNCTION,
    SERVE_CLI,
    SERVE_ROUTERS,
    SUBCOMMAND,
    ExtractError,
    SourceTree,
    find_function,
)


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
    register = find_function(src.tree(SERVE_ROUTERS).body, DEV_ROUTERS_FUNCTION, SERVE_ROUTERS)
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


