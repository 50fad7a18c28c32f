"""How the trainer's checkpoint reaches the share: staged on its disk, copied once.

    stage       the checkpoint written into a private directory on this node's disk
                (TMPDIR: the run's node-local .tmp/ for the trainer, rl/node_local.py)
    advance_kept with a parent this node published last (its files kept in
                `last-published/`, named by published.json) whose tensors are the
                model's: the delta taken from the trainer's tensors in memory and
                the kept files advanced to them in place (trainer/kept_delta.py);
                only the files besides the weights are staged
    with_delta  otherwise, the checkpoint staged whole: each weights file is
                encoded as its delta from the parent's kept file (trainer/delta.py)
                into a sibling directory; a file whose header changed goes whole
    upload      every file to publish copied into the hidden temporary directory on
                the share, hashed as it is copied (every file at once): the
                publisher never reads the share back
    remember    once sealed, the staged full files become `last-published/` (or,
                advanced in place, take the staged files besides the weights), the
                parent of the next delta, kept for this machine's boot (not
                fsynced; coordinator/storage/local_seal.py): after a reboot the
                next publication is full

Without room on this node's disk the checkpoint is written to the share directly
and read back to hash it (logged); the next publication is then full.

The private directories are `publish-<pid>-*` and `delta-<pid>-*`: a publisher
killed mid-publication (SIGKILL, or the SIGTERM of a group's teardown: the trainer
has no handler) leaves a whole model there, removed by the next publisher on the
node once no process has that pid.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import psutil

from coordinator.storage import local_seal
from coordinator.storage.fsio import ensure_dir, publish_bytes, remove_tree, rename
from coordinator.storage.verified import copy_hashed, in_parallel
from rollout.errors import CheckpointError
from trainer import delta, kept_delta
from trainer.checkpoint import fsync_tree
from trainer.manifest import (
    DeltaInfo,
    Manifest,
    ResultEntry,
    delta_file,
    list_files,
    read_manifest,
)

log = logging.getLogger(__name__)

LAST_PUBLISHED: Final = "last-published"
# In last-published/: {"name", "digest", "base", "length", "seal"}; "seal" is
# local_seal's mark of the boot the files were kept in.
RECORD: Final = "published.json"


def default_last() -> Path:
    """Where this process keeps the files it published last: beside its staging."""
    return Path(tempfile.gettempdir()) / LAST_PUBLISHED


@dataclass(frozen=True)
class Staged:
    """A checkpoint written on this node's disk, and what of it goes to the share."""

    full: Path  # every file of the checkpoint, weights whole
    upload: dict[str, Path]  # relative name on the share -> the local file to copy there
    delta: DeltaInfo | None = None
    deltas: Path | None = None  # the delta files' directory
    kept: bool = False  # the weights advanced in last-published/ (`full` holds the rest)

    def remove(self) -> None:
        remove_tree(self.full)
        if self.deltas is not None:
            remove_tree(self.deltas)


_PRIVATE: Final = ("publish", "delta")  # the kinds of a publisher's private directories


def private_dir(kind: str, parent: Path | None = None) -> Path:
    """A new directory `<kind>-<pid>-<random>` in `parent` (TMPDIR when None), those of
    every kind a killed publisher left there removed first (their pid gone: a whole
    model each)."""
    where = Path(tempfile.gettempdir()) if parent is None else parent
    for old in (p for k in _PRIVATE for p in where.glob(f"{k}-*-*")):
        owner = old.name.split("-")[1]
        if owner.isdigit() and int(owner) != os.getpid() and not psutil.pid_exists(int(owner)):
            remove_tree(old)
            log.info("removed %s, left by a publisher (pid %s) killed mid-publication", old,
                     owner)
    return Path(tempfile.mkdtemp(prefix=f"{kind}-{os.getpid()}-", dir=where))


def stage(tmp: Path, write: Callable[[Path], None]) -> Staged | None:
    """`write` into a new private directory on this node's disk; None when there is no
    room there: then written into `tmp` on the share directly (logged)."""
    staging = private_dir("publish")
    try:
        write(staging)
    except OSError as exc:
        remove_tree(staging)
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        log.warning("no room to stage the checkpoint in %s (%s): writing it to %s directly "
                    "and reading it back to hash it; give TMPDIR (or checkpoint.local_cache) "
                    "room for two checkpoints", staging, exc, tmp)
        write(tmp)
        return None
    except BaseException:
        remove_tree(staging)
        raise
    return Staged(full=staging, upload={rel: staging / rel for rel in list_files(staging)})


def _parent_record(parent: Path, last: Path) -> tuple[str, int, str] | str:
    """(base, length, manifest digest) of `parent` when `last` holds its files (its
    manifest read once from the share), else why not."""
    try:
        record = json.loads((last / RECORD).read_bytes())
        name, digest = record["name"], record["digest"]
        base, length = str(record["base"]), int(record["length"])
        seal = record["seal"]
    except FileNotFoundError:
        return "this process has published nothing it kept"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{last / RECORD} is unreadable ({exc})"
    if not local_seal.trusted(seal):
        return (f"the files were kept before this machine restarted ({seal!r}), unsynced: "
                "they may not all have reached the disk")
    if name != parent.name:
        return f"the files kept are {name}'s"
    try:
        published = read_manifest(parent)
    except CheckpointError as exc:
        return f"its manifest cannot be read ({exc})"
    if published.digest != digest:
        return f"it was published again (manifest {published.digest}, kept {digest})"
    return base, length, published.digest


def with_delta(staged: Staged, final_dir: Path, parent: Path | None,
               last: Path | None) -> Staged:
    """`staged` with its weights files as deltas from `parent`'s, where this node kept
    the parent's files; as it is otherwise (a full checkpoint, the reason logged)."""
    found = _usable_parent(final_dir, parent, last)
    if found is None:
        return staged
    assert last is not None and parent is not None
    deltas = private_dir("delta", staged.full.parent)
    upload = dict(staged.upload)
    encoded: dict[str, delta.Encoded] = {}
    try:
        for name in sorted(upload):
            if "/" in name or not name.endswith(".safetensors") or not (last / name).is_file():
                continue
            try:
                made = delta.encode(staged.full / name, last / name)
            except (CheckpointError, ValueError) as exc:  # ValueError: mmap of an empty file
                log.warning("%s: %s goes whole (the kept file of %s is unreadable: %s)",
                            final_dir.name, name, parent.name, exc)
                continue
            if made is None:
                log.info("%s: %s goes whole (its header differs from %s's)", final_dir.name,
                         name, parent.name)
                continue
            delta.write(made, deltas / name, result=name)
            del upload[name]
            upload[delta_file(name)] = deltas / name
            encoded[name] = made
    except BaseException:
        remove_tree(deltas)
        raise
    if not encoded:
        remove_tree(deltas)
        return staged
    info = _info(final_dir, parent, found, encoded)
    return dataclasses.replace(staged, upload=upload, delta=info, deltas=deltas)


def advance_kept(state: Mapping[str, Any] | None, dtype: str | None, final_dir: Path,
                 parent: Path | None, last: Path | None,
                 side_files: Callable[[Path], None]) -> Staged | None:
    """The delta of the trainer's tensors `state` (their floating ones published in
    `dtype`, where given) from the parent's files kept in
    `last`, those files advanced to them in place, and `side_files` (the checkpoint's
    files besides its weights) written into a staging directory; None where the kept
    files are not the parent's, `state` is not their tensors or `side_files` wrote
    weights (the reason logged): then the checkpoint is staged whole (`stage`,
    `with_delta`)."""
    if state is None or parent is None or last is None:
        return None
    found = _usable_parent(final_dir, parent, last, quiet=True)
    if found is None:
        return None  # with_delta names why, on the staged path
    files = sorted(last / n for n in list_files(last) if "/" not in n and n.endswith(".safetensors"))
    matched = kept_delta.match(state, files, dtype) if files else "no weights file is kept"
    if isinstance(matched, str):
        log.info("%s: its delta is encoded from the checkpoint written whole, not from the "
                 "trainer's tensors: %s", final_dir.name, matched)
        return None
    staging = private_dir("publish")
    deltas = private_dir("delta", staging.parent)
    try:
        side_files(staging)
        written = [rel for rel in list_files(staging) if rel.endswith(".safetensors")]
        if written:
            log.info("%s: its delta is encoded from the checkpoint written whole: writing "
                     "the files besides the weights wrote %s too", final_dir.name, written)
            remove_tree(staging)
            remove_tree(deltas)
            return None
        for rel in list_files(last):  # a sharded model's index: the parent's (same tensors)
            if rel.endswith(".safetensors.index.json") and not (staging / rel).exists():
                shutil.copyfile(last / rel, staging / rel)
        os.unlink(last / RECORD)  # the kept files change from here: a failure leaves no parent
        # Every weights file at once (a sharded model's), each tensor in a task of its own.
        encoded = in_parallel({path.name: functools.partial(
            _advance, path, tensors, dtype, deltas / path.name)
            for path, tensors in matched.items()})
    except BaseException:  # any failure or an interrupt: this call's two directories
        remove_tree(staging)  # go, and it is raised on (the kept files have no record)
        remove_tree(deltas)
        raise
    upload = {rel: staging / rel for rel in list_files(staging)}
    upload.update({delta_file(name): deltas / name for name in encoded})
    return Staged(full=staging, upload=upload, delta=_info(final_dir, parent, found, encoded),
                  deltas=deltas, kept=True)


def _advance(path: Path, tensors: Mapping[str, Any], dtype: str | None,
             out: Path) -> delta.Encoded:
    """The kept file `path` advanced to `tensors`, its delta written to `out`."""
    encoded = kept_delta.advance(path, tensors, dtype, fsync=local_seal.durable())
    delta.write(encoded, out, result=path.name)
    return encoded


def _usable_parent(final_dir: Path, parent: Path | None, last: Path | None, *,
                   quiet: bool = False) -> tuple[str, int, str] | None:
    """`_parent_record` of `parent` when `last` holds its files, else None (logged
    unless `quiet`)."""
    if parent is None or last is None:
        return None
    if parent.parent != final_dir.parent:
        raise CheckpointError(f"delta parent {parent} is not a sibling of {final_dir}",
                              path=parent)
    found = _parent_record(parent, last)
    if isinstance(found, str):
        if not quiet:
            log.info("%s is published full, not as a delta of %s: %s", final_dir.name,
                     parent.name, found)
        return None
    return found


def _info(final_dir: Path, parent: Path, found: tuple[str, int, str],
          encoded: Mapping[str, delta.Encoded]) -> DeltaInfo:
    """The manifest's account of a delta checkpoint made of `encoded` (by weights file)."""
    base, length, parent_digest = found
    tensors: dict[str, str] = {}
    for made in encoded.values():
        tensors.update(made.digests)
    info = DeltaInfo(parent=parent.name, parent_digest=parent_digest, base=base,
                     length=length + 1, tensor_hash=delta.TENSOR_HASH, tensors=tensors,
                     results={name: ResultEntry(header_sha256=made.header_sha256,
                                                size=made.size)
                              for name, made in encoded.items()})
    changed = sum(made.changed for made in encoded.values())
    elements = sum(made.elements for made in encoded.values())
    log.info("%s is a delta of %s (link %d from %s): %d of %d elements changed (%.2f %%)",
             final_dir.name, parent.name, info.length, base, changed, elements,
             100.0 * changed / max(elements, 1))
    return info


def upload(staged: Staged, tmp: Path) -> dict[str, tuple[int, str]]:
    """Every file to publish copied into `tmp` on the share, hashed as it is copied:
    (size, SHA-256) by relative name."""
    for rel in staged.upload:
        ensure_dir((tmp / rel).parent)
    return in_parallel({rel: functools.partial(copy_hashed, src, tmp / rel)
                        for rel, src in staged.upload.items()})


def remember(staged: Staged | None, name: str, manifest: Manifest, last: Path) -> None:
    """The staged full files become `last` (the next delta's parent), or `last` goes
    when nothing was staged."""
    if staged is not None and staged.deltas is not None:
        remove_tree(staged.deltas)
    if staged is not None and staged.kept:  # the weights are in place: the rest joins them
        for rel in list_files(staged.full):
            ensure_dir((last / rel).parent)
            rename(staged.full / rel, last / rel)
        remove_tree(staged.full)
    else:
        remove_tree(last)
        if staged is None:
            return
        try:
            rename(staged.full, last)
        except OSError as exc:  # another filesystem: the next publication is full
            log.info("the published files are not kept for a delta (%s)", exc)
            remove_tree(staged.full)
            return
    if local_seal.durable():
        fsync_tree(last)
    base, length = (manifest.delta.base, manifest.delta.length) if manifest.delta else (name, 0)
    publish_bytes(last / RECORD, json.dumps({"name": name, "digest": manifest.digest,
                                             "base": base, "length": length,
                                             "seal": local_seal.mark()}).encode())
