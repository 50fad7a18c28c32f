"""A published checkpoint beneath a bucket's node-local root, readable as local files.

On a filesystem run directory a checkpoint is read where it is.  In a bucket run
directory (coordinator/storage/objstore.py, routing) its files are fetched to the
node-local root once, checked against the manifest as they come, and sealed for
this boot (coordinator/storage/local_seal.py) with the manifest: used as they are
at the next use (trainer/local_copy.py sealed_copy_of).  A delta checkpoint is
made whole by copy_to_local_cache instead.
"""

from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path

from coordinator import routing
from coordinator.errors import MalformedRecordError
from coordinator.storage import local_seal
from coordinator.storage.fsio import FILE_MODE
from coordinator.storage.verified import in_parallel, read_verified
from rollout.errors import CheckpointError
from trainer.checkpoint import fsync_tree, verify_checkpoint
from trainer.local_copy import sealed_copy_of
from trainer.manifest import MANIFEST_NAME, FileEntry


def local_view(directory: Path) -> Path:
    """`directory` with its files readable as plain local files (what transformers and
    safetensors open).  On a filesystem, the directory itself.  Beneath a bucket's
    node-local root, every file of the published checkpoint is fetched to its own path
    there (all at once) and checked against the manifest as it is fetched; the manifest
    is written there last, and a copy whose manifest and sizes match is used as it is
    (sealed_copy_of)."""
    if routing.routed(directory) is None:
        return directory
    manifest = verify_checkpoint(directory, contents=False)
    if manifest.delta is not None:
        raise CheckpointError(f"{directory} is a delta checkpoint: make its copy with "
                              "copy_to_local_cache", path=directory)
    if sealed_copy_of(directory, manifest, only=False):
        return directory  # fetched and verified before; its manifest was written last

    def fetch(name: str, entry: FileEntry) -> None:
        path = directory / name
        try:  # fetches the object to `path`, then hashes what it fetched
            read_verified(path, size=entry.size, sha256=entry.sha256, allow_map=False,
                          keep_local=True).close()
        except MalformedRecordError as exc:
            raise CheckpointError(str(exc), path=path) from exc

    # The seal and the local manifest go first, and come back once every file is
    # verified (the files fsynced first where the kernel names no boot: local_seal).
    local_seal.unseal(directory)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(directory / MANIFEST_NAME)
    in_parallel({name: functools.partial(fetch, name, entry)
                 for name, entry in manifest.files.items()})
    local_manifest = directory / MANIFEST_NAME
    local_manifest.write_bytes(manifest.to_bytes())
    os.chmod(local_manifest, FILE_MODE)
    if local_seal.durable():
        fsync_tree(directory)
    local_seal.write_seal(directory)
    return directory
