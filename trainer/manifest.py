"""A published checkpoint's manifest: what it holds, and what it was made from.

    {"schema": "coordinator/checkpoint-manifest", "version": 1, "iteration": 3,
     "files": {"model.safetensors": {"sha256": "<64 hex>", "size": 81920}, ...},
     "probes": {...} or null,
     "delta": null, or absent (a full checkpoint), or, for a delta checkpoint:
       {"parent": "iter-000002", "parent_digest": "<16 hex>", "base": "iter-000000",
        "length": 2,
        "results": {"model.safetensors": {"header_sha256": ..., "size": ...}},
        "tensor_hash": "blake3",
        "tensors": {"model.embed_tokens.weight": "<64 hex>", ...}}}

A full checkpoint lists every file it holds.  A delta checkpoint (trainer/delta.py)
holds `delta/<weights file>` in place of each weights file in `results`: what
changed since `parent` (a sibling directory whose manifest has `parent_digest`);
`results` are the weights files the parent's plus the delta make (as the trainer
wrote them, byte for byte: each one's size and the SHA-256 of its safetensors
header; written before that, the whole file's SHA-256), `tensors` the checksum of
every tensor in them
(`tensor_hash`: "blake3", or "sha256"; absent before it was named: "sha256"), `base`
the full checkpoint the chain starts from and `length` its links.

Names and values come from the shared filesystem and may be hostile: every file
name is a plain relative path inside the checkpoint, every hash 64 hex digits.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Final

from coordinator.errors import MalformedRecordError, UnsafeFileError
from coordinator.records.records import JsonObject, Record
from coordinator.storage import trees
from coordinator.storage.local_seal import SEAL_NAME
from coordinator.storage.store import read_document
from rollout.errors import CheckpointError
from trainer.probes import ProbeSet

MANIFEST_NAME: Final = "manifest.json"
MANIFEST_SCHEMA: Final = "coordinator/checkpoint-manifest"
_SHA256: Final = re.compile(r"[0-9a-f]{64}")  # SHA-256's and BLAKE3's hex digests alike
TENSOR_HASHES: Final = ("blake3", "sha256")


def _check_file_name(name: str) -> None:
    """A manifest's file name is a plain relative path inside the checkpoint.

    Names come from disk and may be hostile: none may point outside the
    directory, use Windows separators, or stand for the manifest itself.
    """
    path = Path(name)
    if (
        not name
        or path.is_absolute()
        or ".." in path.parts
        or name == MANIFEST_NAME
        or "\\" in name
    ):
        raise ValueError(
            f"file name {name!r} is not a plain relative path inside the checkpoint "
            f"(no '..', no leading '/', no '\\', not {MANIFEST_NAME})"
        )


@dataclass(frozen=True, kw_only=True)
class FileEntry(Record):
    """One file of a checkpoint as its manifest lists it (under its name)."""

    # Only ever nested in a Manifest, where it is written without schema and
    # version; the name identifies the type in errors and tests.
    SCHEMA: ClassVar[str] = "coordinator/checkpoint-manifest/file"
    sha256: str
    size: int

    def __post_init__(self) -> None:
        if not isinstance(self.sha256, str) or not _SHA256.fullmatch(self.sha256):
            raise ValueError(f"sha256 {self.sha256!r} is not 64 lowercase hex digits")
        if type(self.size) is not int or self.size < 0:
            raise ValueError(f"size {self.size!r} is not an integer >= 0")


@dataclass(frozen=True, kw_only=True)
class ResultEntry(Record):
    """A weights file a delta makes, as its manifest lists it (under its name): its
    size and the SHA-256 of its safetensors header (the length prefix included).
    With the checksum of every tensor in it (DeltaInfo.tensors) they decide the whole
    file: its tensors tile the bytes after the header (trainer/delta.py `header`).
    No whole-file hash: one stream on one core at every publication, where the
    tensors' run on every core (a manifest written before this lists a result as a
    FileEntry, the whole file's SHA-256)."""

    SCHEMA: ClassVar[str] = "coordinator/checkpoint-manifest/result"
    header_sha256: str
    size: int

    def __post_init__(self) -> None:
        if not isinstance(self.header_sha256, str) or not _SHA256.fullmatch(self.header_sha256):
            raise ValueError(f"header_sha256 {self.header_sha256!r} is not 64 lowercase hex "
                             "digits")
        if type(self.size) is not int or self.size < 8:
            raise ValueError(f"size {self.size!r} is not an integer >= 8 (a safetensors file)")


_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
DELTA_DIR: Final = "delta"  # a delta checkpoint's delta/<weights file>


def delta_file(result: str) -> str:
    """Where a delta checkpoint holds the delta that makes weights file `result`."""
    return f"{DELTA_DIR}/{result}"


@dataclass(frozen=True, kw_only=True)
class DeltaInfo(Record):
    """What a delta checkpoint was made from and makes (module docstring)."""

    SCHEMA: ClassVar[str] = "coordinator/checkpoint-manifest/delta"
    parent: str  # the parent checkpoint's directory name (a sibling)
    parent_digest: str  # its manifest's digest
    base: str  # the full checkpoint the chain starts from
    length: int  # links from the base: 1 for a delta of a full checkpoint
    results: dict[str, ResultEntry | FileEntry]  # weights file -> the file it makes
    tensor_hash: str  # what `tensors` are: "blake3" or "sha256"
    tensors: dict[str, str]  # tensor name -> `tensor_hash` of its bytes in the results

    def __post_init__(self) -> None:
        for what, name in (("parent", self.parent), ("base", self.base)):
            if not isinstance(name, str) or not _NAME.fullmatch(name):
                raise ValueError(f"{what} {name!r} is not a checkpoint directory's name")
        if not isinstance(self.parent_digest, str) or not re.fullmatch(r"[0-9a-f]{16}",
                                                                         self.parent_digest):
            raise ValueError(f"parent_digest {self.parent_digest!r} is not 16 hex digits")
        if type(self.length) is not int or self.length < 1:
            raise ValueError(f"length {self.length!r} is not an integer >= 1")
        if not self.results:
            raise ValueError("results is empty: a delta makes at least one weights file")
        if self.tensor_hash not in TENSOR_HASHES:
            raise ValueError(f"tensor_hash {self.tensor_hash!r} is not one of {TENSOR_HASHES}")
        for name in self.results:
            _check_file_name(name)
            if "/" in name:
                raise ValueError(f"result {name!r} is not a file at the checkpoint's top")
        for tensor, digest in self.tensors.items():
            if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
                raise ValueError(f"tensor {tensor!r}: {self.tensor_hash} {digest!r} is not "
                                 "64 hex digits")

    @classmethod
    def from_json(cls, obj: object, path: Path) -> DeltaInfo:
        if isinstance(obj, dict) and "tensor_hash" not in obj:
            obj = {**obj, "tensor_hash": "sha256"}  # written before the hash was named
        return super().from_json(obj, path)


@dataclass(frozen=True, kw_only=True)
class Manifest(Record):
    """What a complete checkpoint holds: its iteration and every file's hash and size."""

    SCHEMA: ClassVar[str] = MANIFEST_SCHEMA
    iteration: int
    files: dict[str, FileEntry]  # relative path with "/" separators -> entry
    # What the trainer's weights say about fixed sequences (trainer/probes.py):
    # phase 12 checks the engine serves these weights.  None: not trained here.
    probes: ProbeSet | None = None
    # A delta checkpoint's parent, chain and results (trainer/delta.py); None: full.
    delta: DeltaInfo | None = None

    def __post_init__(self) -> None:
        if type(self.iteration) is not int or self.iteration < 0:
            raise ValueError(f"iteration {self.iteration!r} is not an integer >= 0")
        if not self.files:
            raise ValueError("files is empty: a checkpoint lists at least one file")
        for name in self.files:
            _check_file_name(name)
        if self.delta is not None:
            for result in self.delta.results:
                if delta_file(result) not in self.files or result in self.files:
                    raise ValueError(f"result {result!r} is not listed as "
                                     f"{delta_file(result)!r} alone")

    @classmethod
    def from_json(cls, obj: object, path: Path) -> Manifest:
        if isinstance(obj, dict) and "delta" not in obj:
            obj = {**obj, "delta": None}  # a full checkpoint's manifest names no delta
        return super().from_json(obj, path)

    def to_json(self) -> JsonObject:
        body = super().to_json()
        if self.delta is None:
            del body["delta"]  # a full checkpoint's bytes (its digest) as before deltas
        return body

    def local_files(self) -> dict[str, FileEntry | ResultEntry]:
        """The files a node's copy holds: the listed ones, and for a delta checkpoint
        the weights files it makes in place of delta/<file>."""
        if self.delta is None:
            return dict(self.files)
        made = {delta_file(r) for r in self.delta.results}
        return {**{n: e for n, e in self.files.items() if n not in made}, **self.delta.results}

    def to_bytes(self) -> bytes:
        # Keys sorted: the bytes are the checkpoint's content id (`digest`) and
        # must not depend on the order the files were listed in.  Indented so
        # that an operator can read the manifest.
        return (json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n").encode()

    @property
    def digest(self) -> str:
        """A short content id: equal manifests, equal digests."""
        return hashlib.sha256(self.to_bytes()).hexdigest()[:16]


def list_files(root: Path) -> list[str]:
    """Every file under `root` but the manifest and a node-local copy's seal
    (coordinator/storage/local_seal.py), relative, with "/" separators."""
    try:
        names = trees.list_files(root)
    except UnsafeFileError as exc:
        raise CheckpointError(f"{exc.path}: checkpoints may not contain symlinks: remove it",
                              path=exc.path) from None
    return [name for name in names if name not in (MANIFEST_NAME, SEAL_NAME)]



def read_manifest(directory: Path) -> Manifest:
    """A checkpoint's manifest, read like every record of the run directory.

    A manifest that does not parse is retried by the reader (it may be a torn
    read), then reported as a CheckpointError naming the manifest's path.
    """
    path = directory / MANIFEST_NAME
    try:
        manifest = read_document(path, Manifest.from_bytes)
    except MalformedRecordError as exc:  # malformed, or a symlink/FIFO/giant in its place
        raise CheckpointError(
            f"{exc}: {directory} is not a usable checkpoint; publish it again or remove it",
            path=path,
        ) from exc
    if manifest is None:
        raise CheckpointError(
            f"{path} is missing: {directory} is not a published checkpoint", path=path
        )
    return manifest


