"""A delta taken from the trainer's own tensors: no weights file written whole.

    publish_checkpoint, with the parent's files kept in last-published/ (publisher.py)
      the trainer's tensors (each cast to the published dtype in its own task below)
        matched to the kept files' headers: every tensor of a header has the
        model's tensor of that name, dtype and shape; every tensor of the model is
        in a header or is one that is, under another name (tied embeddings)
        (else `match` says why, and the checkpoint is written whole and its delta
        encoded from that file: trainer/delta.py `encode`)
      -> per tensor, a thread per core: cast, the changed elements found against the kept
         file's (mapped), put in the delta and written into the kept file (it
         becomes the new file in place, as a node's copy does: local_copy.py), then
         the tensor's BLAKE3 taken; with the header's SHA-256 they are the
         manifest's account of the result (no whole-file hash: trainer/manifest.py
         `ResultEntry`)

So a delta publication writes no 2-bytes-per-parameter file and reads none back:
it reads the kept file once and writes the pages that changed.  The kept file is
byte for byte the file the delta makes on a node: its header is the parent's and
its tensors the trainer's, as the manifest's checksums of the result say.  The
caller removes the record naming the kept files' checkpoint before `advance`
writes into them: a process killed mid-way leaves no parent, and the next
publication is full.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import mmap
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from rollout.errors import CheckpointError
from trainer import delta

# torch's dtype names -> safetensors' (what a header says).
_SAFETENSORS: Final = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64",
                       "int8": "I8", "uint8": "U8", "int16": "I16", "int32": "I32",
                       "int64": "I64", "bool": "BOOL", "float8_e4m3fn": "F8_E4M3",
                       "float8_e5m2": "F8_E5M2"}
# Fewer changed elements than this share of a tensor's are written one by one (its
# other pages stay clean); more, and the tensor is copied whole (every page of it
# changes anyway: a page holds 2,048 bf16 elements).
_SCATTER_BELOW: Final = 1 / 4096


def match(state: Mapping[str, Any], files: Sequence[Path],
          dtype: str | None = None) -> dict[Path, dict[str, Any]] | str:
    """`state`'s tensors by the kept file whose header holds each, or why they are not
    that file's tensors (then nothing was written); floating tensors are compared as
    published in `dtype`, where given (checkpoint.py `cast_state`'s rule)."""
    import torch

    by_file: dict[Path, dict[str, Any]] = {}
    for path in files:
        try:
            with open(path, "rb") as handle, \
                    mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
                _, spans = delta.header(data, path)
        except (CheckpointError, OSError, ValueError) as exc:  # ValueError: an empty file
            return f"the kept {path.name} is unreadable ({exc})"
        mine = {}
        for name, span in spans.items():
            tensor = state.get(name)
            if not isinstance(tensor, torch.Tensor) or hasattr(tensor, "to_local"):
                return f"{path.name} holds {name!r}, of which the model has no plain tensor"
            named = _SAFETENSORS.get(str(_published(tensor, dtype)).removeprefix("torch."))
            if (named, tuple(tensor.shape)) != (span.dtype, span.shape):
                return (f"{name!r} is {named} {tuple(tensor.shape)} in the model, "
                        f"{span.dtype} {span.shape} in {path.name}")
            mine[name] = tensor
        by_file[path] = mine
    held = {n for tensors in by_file.values() for n in tensors}
    stored = {_storage(state[n]) for n in held}
    for name in sorted(state.keys() - held):
        if _storage(state[name]) not in stored:
            return f"the model's {name!r} is in no kept file"
    return by_file


def _published(tensor: Any, dtype: str | None) -> Any:
    """The torch dtype `tensor` is published in: `dtype` for a floating one."""
    import torch

    return getattr(torch, dtype) if dtype is not None and tensor.is_floating_point() \
        else tensor.dtype


def _storage(tensor: Any) -> tuple[str, int, tuple[int, ...], tuple[int, ...]]:
    """Where a tensor's elements are: equal for tied tensors (one parameter under two
    names), not for two views of one storage."""
    return str(tensor.device), tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride())


def advance(path: Path, tensors: Mapping[str, Any], dtype: str | None = None, *,
            fsync: bool) -> delta.Encoded:
    """The kept file `path` made the file of `tensors` (matched to it by `match`, the
    floating ones cast to `dtype`) in place, and the delta from what it held: the
    module docstring.  Every tensor is cast, compared, written and hashed in one task
    (a thread per core, in the file's order: a cast copy of the model never exists
    whole)."""
    with open(path, "r+b") as handle:
        data = mmap.mmap(handle.fileno(), 0)
        try:
            raw, spans = delta.header(data, path)
            order = sorted(spans.values(), key=lambda span: span.begin)
            workers = max(1, min(len(order), os.cpu_count() or 1))
            with concurrent.futures.ThreadPoolExecutor(workers) as pool:
                futures = {span.name: pool.submit(_patch, data, handle.fileno(), span,
                                                  tensors[span.name], dtype)
                           for span in order}
            found = {name: future.result() for name, future in sorted(futures.items())}
            if fsync:
                data.flush()
            size = len(data)
        finally:
            # A failed task's traceback may still hold a view of the map: it is then
            # unmapped when that goes.
            with contextlib.suppress(BufferError):
                data.close()
        if fsync:
            os.fsync(handle.fileno())
    parts: dict[str, Any] = {}
    digests: dict[str, str] = {}
    changed = 0
    for name, (tensor_parts, count, digest) in found.items():
        parts.update(tensor_parts)
        digests[name] = digest
        changed += count
    return delta.Encoded(tensors=parts, digests=digests, size=size,
                         header_sha256=hashlib.sha256(raw).hexdigest(), changed=changed,
                         elements=sum(s.count for s in spans.values()))


def _patch(data: mmap.mmap, fd: int, span: delta.Span, tensor: Any,
           dtype: str | None) -> tuple[dict[str, Any], int, str]:
    """One tensor's part of the delta (cast to `dtype` where it is floating), its new
    elements written into the kept file (`data`, its map; `fd`, its descriptor), and
    the digest of its bytes after (of the cast tensor: those bytes)."""
    import numpy as np
    import torch

    now = tensor.detach().to(_published(tensor, dtype)).to("cpu").contiguous()
    now = now.view(getattr(torch, span.int_dtype))
    now = now.numpy().reshape(-1)
    was = np.frombuffer(data, dtype=span.int_dtype, count=span.count, offset=span.begin)
    parts, count = delta.changes(now, was, span)
    if count and count < span.count * _SCATTER_BELOW:
        index = parts[f"{span.name}{delta.SEP}index"].numpy()
        was[index] = now[index]
    del was  # the map's view
    with memoryview(now).cast("B") as raw:
        if count >= span.count * _SCATTER_BELOW:
            # Written, not copied into the map: a store into a clean page of a shared
            # map faults into the kernel, and every page changes here (twice the time).
            _write_at(fd, raw, span.begin)
        return parts, count, delta.hash_bytes(raw)


def _write_at(fd: int, raw: memoryview, offset: int) -> None:
    """`raw` written at `offset` of the file `fd`, whole (a write returns at most
    2 GiB: a tensor can be bigger)."""
    done = 0
    while done < len(raw):
        done += os.pwrite(fd, raw[done:], offset + done)
