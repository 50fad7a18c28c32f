"""A node's verified copy of a published checkpoint, on its own disk.

    copy_to_local_cache(iter-N on the share, cache root)
        cached copy sealed with iter-N's manifest?  -- yes --> use it (not hashed again)
          | no
          v
        full checkpoint:  every file copied (all at once), hashed as it is read
        delta checkpoint: the parent's copy first (the same call: cached, or made from
                          its own parent, down to the full base), then its plain files
                          copied as above (those of the parent's size and SHA-256,
                          as config and tokenizer files are, taken from the parent's
                          copy: not read again), and each delta/<file> read once and
                          applied to a kernel-side clone of the parent's file
                          (trainer/delta.py; the parent's copy is never written),
                          every tensor and the header checked against the
                          manifest (which makes the whole file checked)
                          `advance`: the parent's copy itself, held by no reader, is
                          taken (renamed hidden, unsealed) and the delta applied to
                          its files in place: no clone; the parent's copy is gone
          v
        manifest.json, then the seal (coordinator/storage/local_seal.py) written
        last, the directory renamed into place

The files are not fsynced where the kernel names its boot: the seal names the
boot that wrote them, and a copy sealed before a reboot is made again (a
process killed mid-copy loses nothing written: its pages are in the page cache).

A process that reads a copy (an engine loading it) holds it (`held_copy`: a shared
flock on `.<copy>.readers` beside it, taken before the cache's lock is let go); a
copy held by a reader is never advanced in place (cloned instead) nor removed by
`remove_copy`.  Node-local flocks: the cache is this node's.

Each byte crosses the shared filesystem once per node (docs/PROTOCOL.md, "How a
checkpoint's bytes travel").  A copy cut short (a node killed while copying or
applying) is a hidden temporary directory, never the cache's name: removed and
made again at the next use.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import logging
import mmap
import os
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO, Final

import filelock

from coordinator.errors import MalformedRecordError
from coordinator.storage import local_seal
from coordinator.storage.fsio import ensure_dir, fsync_dir, remove_tree, rename
from coordinator.storage.verified import copy_verified, in_parallel, read_verified
from rollout.errors import CheckpointError
from trainer import delta
from trainer.checkpoint import seal_files, tmp_sibling, verify_checkpoint
from trainer.manifest import (
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    ResultEntry,
    delta_file,
    list_files,
    read_manifest,
)

log = logging.getLogger(__name__)

# A copy takes seconds to minutes; waiting an hour for another copier means it is stuck.
COPY_LOCK_S: Final = 3600.0
# A chain longer than this is refused: checkpoint.full_every bounds a run's chains.
MAX_CHAIN: Final = 1000


def sealed_copy_of(local: Path, manifest: Manifest, *, only: bool = True) -> bool:
    """Whether `local`, a copy on this node's disk, holds `manifest`'s checkpoint: it is
    sealed for this boot (local_seal: the seal is written last, once every file was
    verified as it was made), its own manifest has the same bytes, and every file is
    there, a regular file of the listed size (and, `only`, no other file).  Trusted
    this way, not hashed again at every use: the copy is this user's (mode 0700,
    rl/node_local.py), and a copy cut short has no seal.  Plain local reads: beneath a
    bucket's node-local root too."""
    expected = manifest.to_bytes()
    files = manifest.local_files()
    if not local_seal.sealed(local):
        return False
    try:
        with open(local / MANIFEST_NAME, "rb") as handle:
            if handle.read(len(expected) + 1) != expected:
                return False
        for name, entry in files.items():
            st = os.lstat(local / name)
            if not stat.S_ISREG(st.st_mode) or st.st_size != entry.size:
                return False
        return not only or set(list_files(local)) == files.keys()
    except (CheckpointError, OSError):
        return False


def chain(checkpoint: Path) -> list[str]:
    """The directory names a checkpoint needs besides its own: a delta's parent, its
    parent's, down to the full base (none for a full checkpoint).  CheckpointError
    when a manifest on the way cannot be read."""
    names: list[str] = []
    manifest = read_manifest(checkpoint)
    while manifest.delta is not None and len(names) < MAX_CHAIN:
        names.append(manifest.delta.parent)
        manifest = read_manifest(checkpoint.parent / manifest.delta.parent)
    return names


def copy_to_local_cache(src_dir: Path, cache_root: Path, *, advance: bool = False) -> Path:
    """A verified copy of the published checkpoint `src_dir` in `cache_root`, made or
    reused (module docstring); CheckpointError naming the file that is wrong.
    `advance`: a delta is applied to its parent's copy in place where no reader holds
    it (the caller keeps one model: rl/engine_host.py)."""
    with held_copy(src_dir, cache_root, advance=advance) as copy:
        return copy


@contextlib.contextmanager
def held_copy(src_dir: Path, cache_root: Path, *, advance: bool = False) -> Iterator[Path]:
    """copy_to_local_cache's copy, held for reading until the block ends: no copier
    advances it in place or removes it meanwhile."""
    manifest = verify_checkpoint(src_dir, contents=False)
    ensure_dir(cache_root)
    # One copier per cache: the local ranks of a trainer share one (a flock: node-local).
    with filelock.FileLock(str(cache_root / ".copy.lock"), timeout=COPY_LOCK_S):
        dest = _local_copy(src_dir, manifest, cache_root, 0, advance)
        hold = _lock_readers(dest, exclusive=False)
    try:
        yield dest
    finally:
        os.close(hold)


def remove_others(cache_root: Path, keep: Path) -> list[tuple[Path, bool]]:
    """Every copy in `cache_root` but `keep` removed, unless a reader holds it: each
    with whether it went.  Under the copiers' lock, so no copy is being made; the
    hidden temporaries of a copier killed mid-copy go at the next copy."""
    if not cache_root.is_dir():
        return []
    with filelock.FileLock(str(cache_root / ".copy.lock"), timeout=COPY_LOCK_S):
        return [(child, remove_copy(child)) for child in sorted(cache_root.iterdir())
                if child != keep and child.is_dir() and not child.name.startswith(".")]


def _readers(copy: Path) -> Path:
    return copy.parent / f".{copy.name}.readers"


def _lock_readers(copy: Path, *, exclusive: bool) -> int:
    """An open descriptor of `copy`'s readers' lock, flocked shared (waiting) or
    exclusive (OSError EWOULDBLOCK at once when a reader holds it)."""
    fd = os.open(_readers(copy), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB if exclusive else fcntl.LOCK_SH)
    except BaseException:  # EWOULDBLOCK (a reader holds it), or an interrupt while
        os.close(fd)         # waiting for a shared lock: the descriptor closed, the
        raise                # error raised on, never a lock reported held
    return fd


def remove_copy(copy: Path) -> bool:
    """`copy` removed from its cache, unless a reader holds it (False)."""
    try:
        fd = _lock_readers(copy, exclusive=True)
    except BlockingIOError:
        return False
    try:
        remove_tree(copy)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_readers(copy))
    finally:
        os.close(fd)
    return True


def _take(parent: Path, dest: Path) -> Path | None:
    """`parent`'s copy renamed to a hidden temporary directory for `dest`, unsealed,
    its files but the weights removed; None when a reader holds it."""
    try:
        fd = _lock_readers(parent, exclusive=True)
    except BlockingIOError:
        log.info("%s is held by a reader: the delta goes into a clone of it", parent)
        return None
    try:
        tmp = tmp_sibling(dest, make=False)
        rename(parent, tmp)  # from here the parent's copy is gone (a kill: made again)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_readers(parent))
    finally:
        os.close(fd)
    local_seal.unseal(tmp)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp / MANIFEST_NAME)
    return tmp


def _local_copy(src_dir: Path, manifest: Manifest, cache_root: Path, depth: int,
                advance: bool) -> Path:
    dest = cache_root / f"{src_dir.name}-{manifest.digest}"
    if dest.exists():
        if sealed_copy_of(dest, manifest):
            return dest
        log.warning("cached copy %s does not match its manifest (cut short or altered): "
                    "making it again", dest)
        remove_tree(dest)
    parent = _parent_copy(src_dir, manifest, cache_root, depth, advance)
    # A copier killed mid-copy left its temporary: any there now is one, of this
    # checkpoint or another (one copier per cache at a time: held_copy's lock).
    for stale in cache_root.glob(".*.tmp-*"):
        remove_tree(stale)
    made = manifest.delta.results if manifest.delta is not None else {}
    deltas = {delta_file(result) for result in made}
    plain = {name: entry for name, entry in manifest.files.items() if name not in deltas}
    same = _as_in_parent(parent, plain)
    taken = _take(parent, dest) if advance and parent is not None else None
    tmp = taken if taken is not None else tmp_sibling(dest)
    fsync = local_seal.durable()  # else sealed for this boot (module docstring)
    try:
        if taken is not None:  # the parent's weights and unchanged files stay; the rest goes
            for name in list_files(taken):
                if name not in made and name not in same:
                    os.unlink(taken / name)
        for name in plain:
            ensure_dir((tmp / name).parent)
        work: dict[str, Callable[[], None]] = {}
        for name, entry in plain.items():
            if name not in same:
                work[name] = functools.partial(_copy, src_dir / name, tmp / name, entry, fsync)
            elif taken is None:  # (taken: already in place)
                assert parent is not None
                work[name] = functools.partial(_reuse, parent / name, tmp / name, fsync)
        in_parallel(work)
        for result, made_entry in sorted(made.items()):  # one at a time: each in memory
            assert parent is not None and manifest.delta is not None
            _apply(src_dir, manifest, (tmp if taken is not None else parent) / result,
                   tmp / result, result, made_entry, fsync)
        seal_files(tmp, manifest, fsync=fsync)
        local_seal.write_seal(tmp)
        rename(tmp, dest)
        fsync_dir(cache_root)
        if manifest.delta is not None:
            log.info("made %s whole: its delta applied to %s's copy%s (link %d of the chain "
                     "from %s)", src_dir.name, manifest.delta.parent,
                     " in place" if taken is not None else "", manifest.delta.length,
                     manifest.delta.base)
        return dest
    finally:
        remove_tree(tmp)


def _parent_copy(src_dir: Path, manifest: Manifest, cache_root: Path,
                 depth: int, advance: bool) -> Path | None:
    """A delta checkpoint's parent, copied (or found) first; None for a full one."""
    if manifest.delta is None:
        return None
    info = manifest.delta
    parent_dir = src_dir.parent / info.parent
    if depth >= MAX_CHAIN:
        raise CheckpointError(f"{src_dir}: its chain of deltas is longer than {MAX_CHAIN}: "
                              "publish a full checkpoint (checkpoint.full_every)", path=src_dir)
    try:
        parent = verify_checkpoint(parent_dir, contents=False)
    except CheckpointError as exc:
        raise CheckpointError(
            f"{src_dir} is a delta of {info.parent}, which cannot be used ({exc}): the "
            f"chain back to its base {info.base} must stay published", path=parent_dir) from exc
    if parent.digest != info.parent_digest:
        raise CheckpointError(
            f"{src_dir} is a delta of {info.parent} as published with manifest "
            f"{info.parent_digest}, but {parent_dir} now has manifest {parent.digest} (it was "
            "published again): the chain is broken; rerun the training of "
            f"iteration {manifest.iteration} (coordinator recover)", path=parent_dir)
    return _local_copy(parent_dir, parent, cache_root, depth + 1, advance)


def _as_in_parent(parent: Path | None, plain: dict[str, FileEntry]) -> set[str]:
    """The files of `plain` (a delta's files besides its weights: config, tokenizer)
    whose size and SHA-256 are those of the same file in the parent's copy: taken from
    that copy (verified as it was made, sealed), not read from the share again."""
    if parent is None:
        return set()
    try:
        theirs = read_manifest(parent).local_files()
    except CheckpointError:
        return set()
    return {name for name, entry in plain.items() if theirs.get(name) == entry}


def _reuse(source: Path, dst: Path, fsync: bool) -> None:
    """A file of the parent's copy, unchanged in the child, cloned into the child's."""
    with open(source, "rb") as handle:
        _clone(handle, dst)
    if fsync:
        with open(dst, "rb") as handle:
            os.fsync(handle.fileno())


def _copy(src: Path, dst: Path, entry: FileEntry, fsync: bool) -> None:
    try:
        copy_verified(src, dst, size=entry.size, sha256=entry.sha256, fsync=fsync)
    except MalformedRecordError as exc:
        raise CheckpointError(f"{exc}; retry", path=src) from exc


def _apply(src_dir: Path, manifest: Manifest, parent_file: Path, out: Path, result: str,
           entry: FileEntry | ResultEntry, fsync: bool) -> None:
    """delta/<result> read once from the share (checked against its manifest entry),
    applied to the parent's file (a clone of it; `out` itself when it is the parent's
    file, taken: _take), the result checked and written (and fsynced, with `fsync`;
    else left to the kernel's writeback: sealed for this boot)."""
    assert manifest.delta is not None
    name = delta_file(result)
    listed = manifest.files[name]
    try:
        with read_verified(src_dir / name, size=listed.size, sha256=listed.sha256,
                           allow_map=False) as verified:
            data = verified.data
    except MalformedRecordError as exc:
        raise CheckpointError(str(exc), path=src_dir / name) from exc
    assert data is not None
    try:
        source = open(parent_file, "rb")  # noqa: SIM115 (closed by the with below)
    except OSError as exc:
        raise CheckpointError(f"{parent_file}: the parent's copy cannot be read ({exc})",
                              path=parent_file) from exc
    with source:
        if parent_file != out:
            _clone(source, out)
    # The delta goes into the clone (or the taken parent) in place: only the changed
    # elements are written (a node killed here leaves a hidden temporary directory,
    # removed at the next use).
    with open(out, "r+b") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size != entry.size or size < 8:
            raise CheckpointError(
                f"{src_dir / name}: applied to {parent_file.name}, it makes {size} bytes, "
                f"its manifest says {entry.size}: the delta or the parent is altered",
                path=src_dir / name)
        try:
            mapped: mmap.mmap | None = mmap.mmap(handle.fileno(), 0)
        except OSError as exc:  # a filesystem without shared writable maps (some FUSE)
            log.info("%s cannot be mapped for writing (%s): the delta is applied in memory "
                     "and the file written whole", out, exc)
            mapped = None
        try:
            if mapped is None:
                buffer = bytearray(size)
                if handle.readinto(buffer) != size:
                    raise CheckpointError(f"{out}: the clone of {parent_file} reads short "
                                          f"of its {size} bytes", path=out)
            delta.apply(buffer if mapped is None else mapped, data, result=result,
                        where=src_dir / name, digests=manifest.delta.tensors,
                        algorithm=manifest.delta.tensor_hash,
                        header_sha256=entry.header_sha256 if isinstance(entry, ResultEntry) else None)
            if mapped is None:
                handle.seek(0)
                handle.write(buffer)
                handle.flush()
            elif fsync:
                mapped.flush()
        finally:
            # A failed check's traceback may still hold views of the map: it is then
            # unmapped when they go (the file is removed with its temporary directory).
            if mapped is not None:
                with contextlib.suppress(BufferError):
                    mapped.close()
        if fsync:
            os.fsync(handle.fileno())


def _clone(source: BinaryIO, dst: Path) -> None:
    """The open file `source` copied to the new file `dst` on the same local disk by the
    kernel (copy_file_range: no pass through this process, a shared extent where the
    filesystem has them), through this process where the kernel cannot."""
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "wb") as target:
        left = os.fstat(source.fileno()).st_size
        try:
            while left > 0:
                done = os.copy_file_range(source.fileno(), fd, min(left, 1 << 30))
                if done == 0:
                    raise OSError(errno.EIO, f"{source.name} ended {left} bytes short of its size")
                left -= done
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP,
                                 errno.EINVAL):
                raise
            source.seek(0)
            target.seek(0)
            target.truncate()
            shutil.copyfileobj(source, target, 16 << 20)

