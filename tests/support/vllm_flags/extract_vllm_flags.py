#!/usr/bin/env python3
"""Write what `vllm serve` accepts on its command line, read from vLLM's source, as JSON.

Why: rollout/engines/vllm.py builds a `vllm serve` argv without importing
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

The parts, beside this file: vllm_source.py (the wheel's files parsed with
ast, names resolved across modules, where vLLM keeps each fact),
vllm_hints.py (what a field's annotation lets a flag accept), vllm_routes.py
(the serve subcommand, the dev-mode switch, the dev routes); this file finds
the flags and writes the fixture.

Usage:
    python tests/support/vllm_flags/extract_vllm_flags.py --source /tmp/vllm_wheels/src_v0.29.0/vllm \\
        --out tests/rollout/fixtures/vllm_serve_0.29.0.json
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

# The extractor's other modules sit beside it (scripts/ is not a package):
# importable whether this file is run or loaded by path (the tests do).
sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_hints import HintReader, accepts
from vllm_routes import dev_mode_env, dev_routes, subcommand
from vllm_source import (
    ENGINE_ARGS,
    FRONTEND_ARGS,
    PARSER_FUNCTION,
    SUBCOMMAND,
    VERSION_FILE,
    ExtractError,
    Local,
    SourceTree,
    calls,
    class_body,
    find_function,
    method,
    require_call,
)

# The flags rollout/engines/vllm.py passes (or may pass) to `vllm serve`.
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
    for call in calls(func, "add_argument"):
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
    unpacked = {id(kw.value) for call in calls(func, "add_argument")
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
        for stmt in class_body(owner):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and stmt.target.id == name):
                return owner.module, stmt
    raise ExtractError(f"{cls.module}: class {cls.name} has no field {name}")


def _frontend_sites(src: SourceTree) -> list[FlagSite]:
    """FrontendArgs registers `--<field-name>` for each of its fields, in a loop."""
    frontend = src.resolve_class(FRONTEND_ARGS, "FrontendArgs", "the frontend flags")
    chain = _class_chain(src, frontend)
    methods = [(owner.module, stmt) for owner in chain for stmt in class_body(owner)
               if isinstance(stmt, ast.FunctionDef)]
    loop_call = next((f"{rel}:{call.lineno}" for rel, func in methods
                      if func.name == "add_cli_args" for call in calls(func, "add_argument")
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
        for stmt in class_body(owner):
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
    async_func = method(async_args, "add_cli_args")
    require_call(async_func, "EngineArgs", "add_cli_args", ENGINE_ARGS)
    parser_func = find_function(src.tree(FRONTEND_ARGS).body, PARSER_FUNCTION, FRONTEND_ARGS)
    require_call(parser_func, "FrontendArgs", "add_cli_args", FRONTEND_ARGS)
    require_call(parser_func, "AsyncEngineArgs", "add_cli_args", FRONTEND_ARGS)

    sites = (_argparse_sites(FRONTEND_ARGS, parser_func) + _frontend_sites(src)
             + _argparse_sites(ENGINE_ARGS, async_func)
             + _argparse_sites(ENGINE_ARGS, method(engine_args, "add_cli_args")))
    positionals = []
    for site in [s for s in sites if not s.option_strings[0].startswith("-")]:
        sites.remove(site)
        nargs = site.explicit.get("nargs")
        positionals.append({
            "name": site.option_strings[0],
            "nargs": nargs.value if isinstance(nargs, ast.Constant) else None,
            "source": site.source,
        })
    special = find_function(src.tree(ENGINE_ARGS).body, "_compute_kwargs", ENGINE_ARGS)
    return FlagIndex(sites, positionals, (ENGINE_ARGS, special))


def describe_flag(src: SourceTree, index: FlagIndex, flag: str) -> dict[str, Any]:
    """The fixture entry for one flag; fails naming the flag if it is missing or unreadable."""
    matches = [s for s in index.sites if flag in s.option_strings]
    if not matches:
        raise ExtractError(
            f"{flag} is not an option of `vllm {SUBCOMMAND}` in {src.root}: searched "
            f"{FRONTEND_ARGS} ({PARSER_FUNCTION}, FrontendArgs) and {ENGINE_ARGS} "
            "(EngineArgs/AsyncEngineArgs.add_cli_args); it was renamed or removed in this "
            "release, so update rollout/engines/vllm.py and FLAGS"
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
        "generated_by": "tests/support/vllm_flags/extract_vllm_flags.py",
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
