"""Weight deltas: a weights file published as what changed since the parent's.

    publisher (trainer rank 0)                   a node (phase 12, trainer/local_copy.py)
    the new file, staged on its disk             the parent's file, in its node-local copy
      vs the file it published last (its disk)     + delta/<file> read once from the share
      -> per tensor: nothing (unchanged), the      -> the parent's file cloned by the kernel
         changed elements (flat indices, new          (or itself, where the cache keeps one
         bits), or the whole tensor, whichever        model), the changes written into it in
         is smaller                                   place, every tensor's BLAKE3 and the
                                                      size checked against the manifest
      -> delta/<file> (safetensors), the new
         file's size and its header's SHA-256,
         each tensor's BLAKE3 (`TENSOR_HASH`)

A safetensors file is an 8-byte header length, a JSON header naming each tensor's
dtype, shape and byte span, then the bytes.  Both files must have the same header
(the same tensors, shapes, dtypes and metadata: one model trained), so the result
is the parent's bytes with the changed elements replaced: byte for byte the file
the trainer wrote, which the manifest's checksums of the result's header and of
each of its tensors confirm (the tensors tile the bytes after the header: no
whole-file hash, whose one stream would run on one core).  Each node hashes the
whole result at every delta: BLAKE3, 3.23x SHA-256's throughput here
(benchmarks/hash_bench.py, BENCHMARKS.md section 11); a manifest naming "sha256"
is checked with SHA-256.  Elements are compared and replaced as integers of their
width (bfloat16 as int16), so every bit pattern (NaN, -0.0) travels exactly.

A delta file holds, for tensor T, either `T::index` (int32 or int64 flat indices)
and `T::value` (the new elements' bits), or `T::whole`; an unchanged tensor is absent.
At RL learning rates 1-3 % of bf16 elements change per step (ANCHORS.md, "Weight
transfer"): 6 bytes per changed element against 2 per element for the whole file.
"""

from __future__ import annotations

import functools
import hashlib
import json
import mmap
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import blake3
from safetensors import SafetensorError

from coordinator.storage.verified import in_parallel
from rollout.errors import CheckpointError
from trainer.manifest import TENSOR_HASHES

# safetensors dtype -> the integer dtype of the same width the elements are compared as.
_INT_VIEW: Final = {"BF16": "int16", "F16": "int16", "F32": "int32", "F64": "int64",
                    "I8": "int8", "U8": "uint8", "I16": "int16", "I32": "int32",
                    "I64": "int64", "BOOL": "uint8", "F8_E4M3": "uint8", "F8_E5M2": "uint8"}
_WIDTH: Final = {"int8": 1, "uint8": 1, "int16": 2, "int32": 4, "int64": 8}
_MAX_HEADER: Final = 100 << 20  # safetensors' own bound on a header
SEP: Final = "::"  # between a tensor's name and its part in a delta file
FORMAT: Final = "coordinator-delta"
TENSOR_HASH: Final = "blake3"  # what the publisher checksums each tensor of a result with


@dataclass(frozen=True)
class Span:
    """Where one tensor's bytes lie in a safetensors file, from its start."""

    name: str
    int_dtype: str
    begin: int
    end: int
    dtype: str = ""  # as the header names it ("BF16")
    shape: tuple[int, ...] = ()

    @property
    def count(self) -> int:
        return (self.end - self.begin) // _WIDTH[self.int_dtype]


@dataclass(frozen=True)
class Encoded:
    """One weights file's delta: the tensors of delta/<file>, and what it makes."""

    tensors: dict[str, Any]  # "T::index", "T::value", "T::whole" -> torch tensors
    digests: dict[str, str]  # every tensor of the new file -> TENSOR_HASH of its bytes
    size: int  # the new file's bytes
    header_sha256: str  # the SHA-256 of its header (`header`'s raw bytes)
    changed: int  # elements that changed
    elements: int  # elements in the file


def header(data: bytes | bytearray | mmap.mmap, where: Path) -> tuple[bytes, dict[str, Span]]:
    """The raw header (its length prefix included) and each tensor's span, checked:
    spans inside the file, of whole elements, of a known dtype."""
    if len(data) < 8:
        raise CheckpointError(f"{where}: {len(data)} bytes is no safetensors file", path=where)
    (length,) = struct.unpack("<Q", data[:8])
    if length > min(_MAX_HEADER, len(data) - 8):
        raise CheckpointError(f"{where}: header of {length} bytes does not fit the file",
                              path=where)
    raw = bytes(data[:8 + length])
    try:
        table = json.loads(raw[8:])
    except ValueError as exc:
        raise CheckpointError(f"{where}: the header is not JSON ({exc})", path=where) from None
    if not isinstance(table, dict):
        raise CheckpointError(f"{where}: the header is not a JSON object", path=where)
    spans = {}
    for name, info in table.items():
        if name == "__metadata__":
            continue
        try:
            int_dtype = _INT_VIEW[info["dtype"]]
            begin, end = (8 + length + int(x) for x in info["data_offsets"])
            shape = tuple(int(x) for x in info.get("shape", ()))
        except (AttributeError, KeyError, TypeError, ValueError):
            raise CheckpointError(f"{where}: tensor {name!r} has no usable dtype and offsets "
                                  f"({str(info)[:200]})", path=where) from None
        if not 8 + length <= begin <= end <= len(data) or (end - begin) % _WIDTH[int_dtype]:
            raise CheckpointError(f"{where}: tensor {name!r} spans bytes {begin}-{end} of "
                                  f"{len(data)}, not whole elements inside the file", path=where)
        spans[name] = Span(name, int_dtype, begin, end, dtype=info["dtype"], shape=shape)
    # The tensors tile the bytes after the header, as safetensors requires: no byte of
    # the file lies outside the header and the spans, so the header and every tensor's
    # digest determine the whole file.
    edge = 8 + length
    for span in sorted(spans.values(), key=lambda s: (s.begin, s.end)):
        if span.begin != edge:
            raise CheckpointError(f"{where}: tensor {span.name!r} starts at byte {span.begin}, "
                                  f"not at {edge} where the one before it ends", path=where)
        edge = span.end
    if edge != len(data):
        raise CheckpointError(f"{where}: the tensors end at byte {edge}, the file at "
                              f"{len(data)}", path=where)
    return raw, spans


def _view(data: Any, span: Span) -> Any:
    import torch

    return torch.frombuffer(data, dtype=getattr(torch, span.int_dtype), count=span.count,
                            offset=span.begin)


def digest(data: Any, span: Span, algorithm: str = TENSOR_HASH) -> str:
    """`algorithm` ("blake3" or "sha256") of one tensor's bytes in `data`."""
    with memoryview(data) as view:
        return hash_bytes(view[span.begin:span.end], algorithm)


def hash_bytes(raw: Any, algorithm: str = TENSOR_HASH) -> str:
    """`algorithm` ("blake3" or "sha256") of the bytes `raw` (a bytes-like object)."""
    if algorithm == "blake3":
        return blake3.blake3(raw).hexdigest()
    return hashlib.sha256(raw).hexdigest()


def tensor_digests(data: Any, spans: Mapping[str, Span],
                   algorithm: str = TENSOR_HASH) -> dict[str, str]:
    """`algorithm` ("blake3" or "sha256") of every tensor's bytes (every tensor at
    once: both free the GIL while they hash)."""
    if algorithm not in TENSOR_HASHES:
        raise ValueError(f"tensor hash {algorithm!r} is not one of {TENSOR_HASHES}")
    return in_parallel({name: functools.partial(digest, data, span, algorithm)
                        for name, span in spans.items()})


def changes(now: Any, was: Any, span: Span) -> tuple[dict[str, Any], int]:
    """One tensor's part of a delta ("T::index" and "T::value", "T::whole", or none:
    unchanged) and how many of its elements changed: `now` and `was` are its elements
    as flat numpy arrays of `span.int_dtype`."""
    import numpy as np
    import torch

    index = np.flatnonzero(now != was)
    if not index.size:
        return {}, 0
    width = _WIDTH[span.int_dtype]
    index_dtype = np.int32 if now.size < 2**31 else np.int64
    if index.size * (np.dtype(index_dtype).itemsize + width) < now.size * width:
        return {f"{span.name}{SEP}index": torch.from_numpy(index.astype(index_dtype)),
                f"{span.name}{SEP}value": torch.from_numpy(now[index])}, index.size
    return {f"{span.name}{SEP}whole": torch.from_numpy(now.copy())}, index.size


def _elements(data: Any, span: Span) -> Any:
    """A tensor's elements in `data` (a map: writable where it is), flat, as integers."""
    import numpy as np

    return np.frombuffer(data, dtype=span.int_dtype, count=span.count, offset=span.begin)


def encode(new: Path, old: Path) -> Encoded | None:
    """The delta from `old` (the file published last) to `new` (both on this node's disk),
    or None when their headers differ (publish `new` whole)."""
    with open(new, "rb") as nf, open(old, "rb") as of, \
            mmap.mmap(nf.fileno(), 0, access=mmap.ACCESS_READ) as nm, \
            mmap.mmap(of.fileno(), 0, access=mmap.ACCESS_READ) as om:
        new_head, spans = header(nm, new)
        if len(nm) != len(om) or header(om, old)[0] != new_head:
            return None
        tensors: dict[str, Any] = {}
        changed = elements = 0
        for span in spans.values():
            parts, count = changes(_elements(nm, span), _elements(om, span), span)
            tensors.update(parts)
            changed, elements = changed + count, elements + span.count
        return Encoded(tensors=tensors, digests=tensor_digests(nm, spans), size=len(nm),
                       header_sha256=hashlib.sha256(new_head).hexdigest(), changed=changed,
                       elements=elements)


def write(encoded: Encoded, path: Path, *, result: str) -> None:
    """delta/<result> on this node's disk (safetensors)."""
    from safetensors.torch import save_file

    save_file(encoded.tensors, str(path), metadata={"format": FORMAT, "result": result})


def load_parts(data: bytes) -> dict[str, Any]:
    """A delta file's tensors ("T::index", "T::value", "T::whole")."""
    from safetensors.torch import load

    return load(data)


def apply(parent: bytearray | mmap.mmap, delta: bytes, *, result: str, where: Path,
          digests: Mapping[str, str], algorithm: str = TENSOR_HASH,
          header_sha256: str | None = None) -> None:
    """`parent` (a weights file's bytes, writable: a map of its copy) made into the
    result in place: the delta's changes put back and every tensor checked against
    `digests` (of `algorithm`; CheckpointError naming the first that differs: a broken
    chain or an altered delta), each tensor's both in one task, every tensor at once.
    The header is the parent's (a delta is published only between files with the
    same header), checked against `header_sha256` where the manifest has it, and the
    tensors tile the rest (header()), so matching digests make the file the trainer
    wrote, byte for byte: no whole-file hash, whose one stream runs on one core while
    the tensors' run on all of them."""
    raw, spans = header(parent, where)
    if header_sha256 is not None:
        _check_header(raw, header_sha256, result=result, where=where)
    try:
        parts = load_parts(delta)
    except (SafetensorError, ValueError) as exc:  # what safetensors raises on a bad file
        raise CheckpointError(f"{where}: not a readable delta ({exc})", path=where) from None
    by_tensor: dict[str, dict[str, Any]] = {name: {} for name in spans}
    for key, tensor in parts.items():
        name, _, part = key.rpartition(SEP)
        if name not in spans or part not in ("index", "value", "whole"):
            raise CheckpointError(f"{where}: {key!r} names no tensor of {result}", path=where)
        by_tensor[name][part] = tensor
    actual = in_parallel({name: functools.partial(_put, parent, spans[name], changes_of,
                                                  where, algorithm)
                          for name, changes_of in by_tensor.items()})
    _check_tensors(actual, digests, algorithm, result=result, where=where,
                   why="after the delta: the delta or the parent it applies to is altered")


def verify_result(path: Path, *, size: int, header_sha256: str, digests: Mapping[str, str],
                  algorithm: str = TENSOR_HASH, result: str) -> None:
    """The weights file `path` checked as the manifest lists the delta's `result`: its
    size, its header's SHA-256 and every tensor's checksum (every tensor at once);
    CheckpointError naming what differs."""
    with open(path, "rb") as handle:
        actual = os.fstat(handle.fileno()).st_size
        if actual != size or size < 8:
            raise CheckpointError(f"{path}: {actual} bytes, the manifest's {result} has "
                                  f"{size}: not the file the delta makes", path=path)
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            raw, spans = header(data, path)
            _check_header(raw, header_sha256, result=result, where=path)
            _check_tensors(tensor_digests(data, spans, algorithm), digests, algorithm,
                           result=result, where=path, why="not the file the delta makes")


def _check_header(raw: bytes, expected: str, *, result: str, where: Path) -> None:
    actual = hashlib.sha256(raw).hexdigest()
    if actual != expected:
        raise CheckpointError(f"{where}: the header of {result} has SHA-256 {actual[:16]}..., "
                              f"its manifest says {expected[:16]}...: the parent's copy is "
                              "not the file the delta applies to", path=where)


def _check_tensors(actual: Mapping[str, str], digests: Mapping[str, str], algorithm: str, *,
                   result: str, where: Path, why: str) -> None:
    """CheckpointError naming the first tensor (by name) whose `actual` digest is not the
    manifest's `digests`."""
    for name in sorted(actual):
        if digests.get(name) != actual[name]:
            raise CheckpointError(
                f"{where}: tensor {name} of {result} has {algorithm} {actual[name][:16]}..., "
                f"its manifest says {str(digests.get(name))[:16]}...: {why}", path=where)


def _put(parent: bytearray | mmap.mmap, span: Span, parts: Mapping[str, Any], where: Path,
         algorithm: str) -> str:
    """One tensor's changes (`parts`: "index" and "value", "whole", or none) put into
    `parent`, checked as they are read; the digest of its bytes after."""
    import torch

    target = _view(parent, span)
    name = span.name
    for part, tensor in parts.items():
        if tensor.dtype != target.dtype and part != "index":
            raise CheckpointError(f"{where}: '{name}{SEP}{part}' is {tensor.dtype}, {name} is "
                                  f"{target.dtype}", path=where)
    if "whole" in parts:
        whole = parts["whole"]
        if whole.numel() != target.numel() or len(parts) != 1:
            raise CheckpointError(f"{where}: '{name}{SEP}whole' has {whole.numel()} elements, "
                                  f"{name} {target.numel()}", path=where)
        target.copy_(whole.flatten())
    elif parts:
        value, index = parts.get("value"), parts.get("index")
        if index is not None:
            index = index.to(torch.int64).flatten()
        if value is None or index is None or value.numel() != index.numel() or (
                index.numel() and not 0 <= int(index.min()) <= int(index.max())
                < target.numel()):
            raise CheckpointError(f"{where}: {name}'s indices and values do not match "
                                  "its elements", path=where)
        target[index] = value.flatten()
    del target  # the map's view, before the digest's
    return digest(parent, span, algorithm)
