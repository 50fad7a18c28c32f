"""Where a path of the run directory lives: on a filesystem, or in a bucket.

A bucket run directory (coordinator/storage/objstore.py) stands on each node as a
node-local root, mounted here with the object store behind it (`Backend`).
`routed` tells the functions of coordinator/storage/fsio.py and coordinator/storage/trees.py
whether a path is beneath such a root, and its key there; on a filesystem the
answer costs one check of an empty table.  `display` gives the name messages
use: the bucket's URL, never the local root.  A writer's hidden staging names
stay local beneath a root: they are prepared there and published under their
final name, never read by another node.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final, Protocol

# The suffix of a staged file's name (fsio.temp_name); a checkpoint's staging
# directory carries ".tmp-" (trainer/checkpoint.py tmp_sibling).
TMP_SUFFIX: Final = ".tmp"


class Backend(Protocol):
    """A run directory that is not a filesystem (coordinator/storage/objstore.py): what the
    functions below do to a path beneath a mounted root, by key."""

    def publish(self, key: str, data: bytes) -> None: ...

    def read_bytes(self, key: str, *, max_bytes: int = ...) -> bytes: ...

    def create_exclusive(self, key: str, data: bytes) -> bool: ...

    def remove(self, key: str) -> bool: ...

    def remove_prefix(self, key: str) -> bool: ...

    def rename(self, src: str, dst: str) -> None: ...

    def listdir(self, key: str) -> list[str]: ...

    def download(self, key: str, target: Path, *, max_bytes: int | None = None) -> None: ...

    def upload(self, key: str, source: Path) -> None: ...

    def list_files(self, key: str) -> list[str]: ...

    def exists(self, key: str) -> bool: ...


# Node-local roots that stand for a bucket run directory (objstore.attach), and
# the URL messages name each by.
_MOUNTS: dict[Path, Backend] = {}
_LABELS: dict[Path, str] = {}


def mount(root: Path, backend: Backend, *, label: str) -> None:
    _MOUNTS[root], _LABELS[root] = backend, label


def unmount(root: Path) -> None:
    _MOUNTS.pop(root, None)
    _LABELS.pop(root, None)


def display(path: object) -> str:
    """`path` as messages name it: its URL beneath a bucket's root, else itself (and
    anything that is not a path, such as an in-memory record's None, as str does)."""
    if not _LABELS or not isinstance(path, (str, Path)):
        return str(path)
    path = Path(path)
    for root, url in _LABELS.items():
        if path == root or root in path.parents:
            rel = path.relative_to(root).as_posix()
            return url if rel == "." else f"{url}/{rel}"
    return str(path)


def routed(path: Path) -> tuple[Backend, str] | None:
    """The backend and key of a path beneath a mounted root; None on a filesystem
    (one empty-dict check: the POSIX path pays nothing more)."""
    if not _MOUNTS:
        return None
    for root, backend in _MOUNTS.items():
        if path == root or root in path.parents:
            key = path.relative_to(root).as_posix()
            if any(_staging(part) for part in key.split("/")):
                return None  # a writer's staging file or directory: node-local
            return backend, key
    return None


def _staging(name: str) -> bool:
    """A hidden temporary name (temp_name, a checkpoint's tmp_sibling): what a writer
    prepares before publishing, never read by another node under that name."""
    return name.startswith(".") and (name.endswith(TMP_SUFFIX) or ".tmp-" in name)
