"""Loading the torch files of the run directory: plain tensors and containers only.

Chunk files and training batches come from other nodes, so they are loaded
with torch.load(weights_only=True): a file that would run code on unpickling
(a planted custom class, a forbidden global) or is not a torch file at all is
refused as malformed, naming the file, instead of being executed.
"""

from __future__ import annotations

from pathlib import Path
from typing import IO, Any

import torch

from coordinator.errors import MalformedRecordError
from coordinator.storage.fsio import STATS


def load_tensors(path: Path, source: str | IO[bytes], *, mmap: bool) -> Any:
    """What torch.load(weights_only=True) makes of `source`, the opened file at `path`.

    `source` is what to read (a /proc/self/fd path of a verified descriptor, or
    an open file or buffer); `path` is the file to name in an error.  With
    `mmap` the tensors stay mapped from the file instead of being copied.
    MalformedRecordError naming `path` when torch refuses the file.
    """
    try:
        STATS.count("read")
        return torch.load(source, weights_only=True, mmap=mmap, map_location="cpu")
    except Exception as exc:  # UnpicklingError (forbidden global), RuntimeError (bad zip)
        first_line = (str(exc).splitlines() or [""])[0]
        raise MalformedRecordError(
            path,
            f"was refused by torch.load(weights_only=True): {type(exc).__name__}: {first_line}",
        ) from exc
