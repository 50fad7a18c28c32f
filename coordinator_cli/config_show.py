"""`coordinator config`: the resolved configuration as TOML, each value with its source.

    [rollout]
    group_size = 4  # --set
    max_tokens = 6  # default (tiny model)
    temperature = 1.0  # default

Resolved exactly as `coordinator run` resolves it on the master (the file, the
`--set` items, then the flags, each section's defaults beneath: the same
`resolve_config`), so a setting `run` refuses is refused here with the same
message (exit 2).  The source of a value is the last of: `default`, `default
(tiny model)` (rl/config.py TINY_MODEL_DEFAULTS), `derived` (a default another
setting changed, e.g. eval turned off for data without an eval split), `file
NAME`, `--set`, or the flag that gave it.  An unset optional (none) is written
as a comment, since TOML has no null; the output read back as a config file
resolves to the same configuration.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from coordinator.config.run_config import deep_merge, load_file, to_plain
from coordinator.config.settings import declared_fields
from coordinator.machine.actions import resolve_config
from coordinator_cli import flags as cli_flags
from coordinator_cli.args import parse_set
from rl.config import TINY_MODEL_DEFAULTS, uses_tiny_model


def _given(tree: Mapping[str, Any], key: str) -> bool:
    node: Any = tree
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False
        node = node[part]
    return True


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return ("inf" if value > 0 else "-inf") if math.isinf(value) else \
            "nan" if math.isnan(value) else repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    return str(value)


def _declared_default(key: str) -> Any:
    section, *path = key.split(".")
    cls: Any = cli_flags.ALL_SECTIONS.get(section)
    default: Any = None
    for part in path:
        if cls is None:
            return None
        found = {name: (hint, d) for name, _, hint, d in declared_fields(cls)}.get(part)
        if found is None:
            return None
        hint, default = found
        cls = hint if isinstance(hint, type) and hasattr(hint, "__dataclass_fields__") else None
    return to_plain(default)


def show(config_file: Path | None, items: list[str], flags: Mapping[str, Any]) -> str:
    """The resolved configuration as commented TOML (UsageError as `run` would raise)."""
    from_file = load_file(config_file) if config_file else {}
    from_set = parse_set(items, cli_flags.DECLARED.get)
    overrides = cli_flags.overrides(items, flags)
    raw = deep_merge(from_file, overrides)
    resolved = resolve_config(raw).to_dict()
    tiny = uses_tiny_model(raw)
    given_flags = {f.key: f.flag for f in cli_flags.CONFIG_FLAGS if flags.get(f.name) is not None}

    def source(key: str, value: Any) -> str:
        if key in given_flags:
            return given_flags[key]
        if _given(from_set, key):
            return "--set"
        if _given(from_file, key):
            return f"file {config_file.name}" if config_file else "file"
        section, _, name = key.partition(".")
        if tiny and name in TINY_MODEL_DEFAULTS.get(section, {}):
            return "default (tiny model)"
        return "default" if value == _declared_default(key) else "derived"

    lines = ["# The resolved configuration (coordinator config): each value's source follows it."]

    def table(prefix: str, node: Mapping[str, Any]) -> None:
        lines.extend(["", f"[{prefix}]"])
        for name, value in node.items():
            if isinstance(value, Mapping):
                continue
            key = f"{prefix}.{name}"
            if value is None:
                lines.append(f"# {name} = (none)  # {source(key, value)}")
            else:
                lines.append(f"{name} = {_toml(value)}  # {source(key, value)}")
        for name, value in node.items():
            if isinstance(value, Mapping):
                table(f"{prefix}.{name}", value)

    for section, node in resolved.items():
        table(section, node)
    return "\n".join(lines) + "\n"
