"""How messages name a place in the run directory.

A bucket run directory stands on each node as a node-local root
(coordinator/objstore.py); every message a person reads names the bucket's URL
instead of that root.  Kept apart from fsio so that errors.py can use it.
"""

from __future__ import annotations

from pathlib import Path

_LABELS: dict[Path, str] = {}


def label(root: Path, url: str) -> None:
    _LABELS[root] = url


def forget(root: Path) -> None:
    _LABELS.pop(root, None)


def display(path: Path | str) -> str:
    """`path` as messages name it: its URL beneath a bucket's root, else itself."""
    path = Path(path)
    for root, url in _LABELS.items():
        if path == root or root in path.parents:
            rel = path.relative_to(root).as_posix()
            return url if rel == "." else f"{url}/{rel}"
    return str(path)
