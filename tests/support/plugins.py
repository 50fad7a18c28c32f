"""Installed-package metadata for tests: a `*.dist-info` directory on a path that a
process puts on sys.path (PYTHONPATH), so that importlib.metadata finds its entry
points exactly as it finds those of a package pip installed."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path


def install_entry_points(site: Path, name: str,
                         groups: Mapping[str, Mapping[str, str]]) -> Path:
    """Write `<site>/<name>-0.0.dist-info` declaring `groups` ({group: {name: "module:attr"}});
    the modules must be importable by whoever reads them.  Returns `site`."""
    info = site / f"{name.replace('-', '_')}-0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items()) + "\n"
        for group, entries in groups.items()))
    return site
