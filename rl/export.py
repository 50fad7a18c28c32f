"""`coordinator export`: a published checkpoint as a plain Hugging Face model directory.

    choose   --iteration N, --best METRIC (rl/keep_best.py), or the newest published
             checkpoint (the newest checkpoints/iter-<N> with a manifest)
    verify   the manifest's names against the directory: no file missing, none extra
    copy     every file the manifest lists (weights as published, in the model's dtype;
             config, generation config, tokenizer, chat template), each hashed as it is
             copied (from a bucket: fetched straight into the copy) and compared with
             the manifest, into a hidden sibling of --out; the manifest stays behind
    place    fsync, then rename the sibling to --out: an absent or empty --out is
             replaced by the rename, a non-empty one only with --force (moved aside
             first, then removed), so --out never holds half an export

The run directory is untrusted (docs/PROTOCOL.md, threat model): nothing of a
checkpoint reaches --out before it matches its manifest, and the manifest's file
names are plain relative paths (trainer/checkpoint.py).  --out is the user's own.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import secrets
import shutil
import struct
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from coordinator import routing
from coordinator.errors import IntegrityError, MalformedRecordError, UsageError
from coordinator.storage import trees
from coordinator.storage.fsio import DIR_MODE, fsync_dir
from coordinator.storage.verified import copy_verified, file_digest
from rl import keep_best, layout
from rl.keep_best import Metric
from rollout.errors import CheckpointError
from trainer.checkpoint import FileEntry, verify_checkpoint
from trainer.delta import verify_result
from trainer.local_copy import copy_to_local_cache
from trainer.manifest import DeltaInfo, ResultEntry

log = logging.getLogger(__name__)
# What makes a directory a model transformers and vLLM load: a config and weights.
_CONFIG: Final = "config.json"
_WEIGHTS: Final = ".safetensors"
_TOKENIZER_FILES: Final = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                           "vocab.json")
_HEADER_LIMIT: Final = 100 << 20  # a safetensors header (JSON) larger than this is not one


@dataclass(frozen=True, kw_only=True)
class Chosen:
    """The checkpoint to export, and why it was chosen (for the user)."""

    iteration: int
    path: Path
    why: str


@dataclass(frozen=True, kw_only=True)
class Exported:
    chosen: Chosen
    out: Path
    files: tuple[str, ...]
    size: int
    dtypes: tuple[str, ...]  # of the weights, from the safetensors headers
    seconds: float

    def describe(self) -> str:
        return (f"exported {routing.display(self.chosen.path)} ({self.chosen.why}) to "
                f"{self.out}: {len(self.files)} files, {self.size / 2**20:.1f} MiB, weights "
                f"{'/'.join(self.dtypes) or '?'}, in {self.seconds:.1f} s")


def _published(run_dir: Path, iteration: int) -> bool:
    return trees.exists(layout.checkpoint(run_dir, iteration) / "manifest.json")


def _listed(run_dir: Path) -> str:
    """The newest ten published checkpoints' iterations: those a choice may name (one
    without its manifest, still publishing or left by a failed publish, is refused)."""
    found = [k for k in keep_best.present(run_dir) if _published(run_dir, k)]
    return ", ".join(f"{k}" for k in found[-10:]) or "none"


def choose(run_dir: Path, *, iteration: int | None = None,
           best: Metric | None = None) -> Chosen:
    """The checkpoint `coordinator export` copies; UsageError naming what there is."""
    if iteration is not None and best is not None:
        raise UsageError(f"--iteration {iteration} and --best {best.name} both choose the "
                         "checkpoint: give one of them (neither: the newest published)")
    if iteration is not None:
        if not 0 <= iteration < 1_000_000:
            raise UsageError(f"--iteration {iteration} is outside 0..999999")
        if not _published(run_dir, iteration):
            raise UsageError(
                f"--iteration {iteration}: {routing.display(layout.checkpoint(run_dir, iteration))}"
                f" is not a published checkpoint (never trained, or pruned beyond "
                f"checkpoint.keep): give one of the checkpoints present: {_listed(run_dir)}")
        return Chosen(iteration=iteration, path=layout.checkpoint(run_dir, iteration),
                      why=f"iteration {iteration}, as asked")
    if best is not None:
        return _best(run_dir, best)
    present = keep_best.present(run_dir)
    for k in reversed(present):
        if _published(run_dir, k):
            return Chosen(iteration=k, path=layout.checkpoint(run_dir, k),
                          why="the newest published checkpoint")
        log.info("iter-%06d has no manifest (being published, or left by a failed "
                 "publish): skipped", k)
    raise UsageError(f"{routing.display(layout.checkpoints(run_dir))} holds no published "
                     "checkpoint: no iteration of this run has trained yet (see `coordinator "
                     "status`)")


def _best(run_dir: Path, metric: Metric) -> Chosen:
    """The record of checkpoint.keep_best when it chose by `metric`; else the best of
    the checkpoints present by their eval metrics (the same rule)."""
    try:
        record = keep_best.read_record(run_dir)
    except MalformedRecordError as exc:
        log.warning("%s: choosing from the eval metrics instead", exc)
        record = None
    if record is not None and record.chosen_by(metric) and _published(run_dir, record.iteration):
        return Chosen(iteration=record.iteration, path=layout.checkpoint(run_dir, record.iteration),
                      why=f"the best by checkpoint.keep_best, {record.describe()}")
    present = [k for k in keep_best.present(run_dir) if _published(run_dir, k)]
    found = keep_best.best_of(run_dir, present, metric)
    if found is None:
        raise UsageError(
            f"--best {metric.name}: none of the published checkpoints ({_listed(run_dir)}) "
            f"has an eval with {metric.key} (checkpoint iter-N is measured by iteration N+1's "
            "metrics/eval.json): check the metric's name in an eval.json, or give --iteration")
    return Chosen(iteration=found.iteration, path=layout.checkpoint(run_dir, found.iteration),
                  why=f"the best of the {len(present)} checkpoints present, {found.describe()}")


def check_out(out: Path, *, force: bool, run_dir: Path) -> Path:
    """--out as an absolute path that may be written; UsageError otherwise."""
    out = Path(os.path.abspath(out.expanduser()))
    run = Path(os.path.abspath(run_dir))
    if run.is_relative_to(out) or out.is_relative_to(layout.checkpoints(run)):
        raise UsageError(f"--out {out} would hold or be inside the run's checkpoints "
                         f"({routing.display(run_dir)}): give a directory outside them")
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise UsageError(f"--out {out} is a symlink or a file: give a new or empty directory "
                         "(the export is renamed into its place)")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UsageError(f"--out {out} is not empty: give a new or empty directory, or "
                         "--force to replace what it holds")
    return out


def export(chosen: Chosen, out: Path, *, force: bool) -> Exported:
    """Copy the chosen checkpoint, verified, to `out` (checked by `check_out`)."""
    started = time.monotonic()
    manifest = verify_checkpoint(chosen.path, contents=False)  # names; contents as copied
    files = manifest.local_files()
    _check_model(chosen.path, files.keys())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.export-{os.getpid()}-{secrets.token_hex(4)}"
    os.mkdir(tmp, DIR_MODE)
    made = out.parent / f".{out.name}.whole-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        source = chosen.path
        if manifest.delta is not None:  # made whole from its chain (trainer/local_copy.py)
            try:
                source = copy_to_local_cache(chosen.path, made)
            except CheckpointError as exc:
                raise CheckpointError(f"{exc}; nothing was written to --out",
                                      path=exc.path) from exc
        for name, entry in sorted(files.items()):
            target = tmp / name
            target.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
            if isinstance(entry, ResultEntry):  # a weights file the delta made
                assert manifest.delta is not None
                _copy_result(source / name, target, name, entry, manifest.delta)
            else:
                _copy(source / name, target, entry)
        dtypes = sorted({d for name in files if name.endswith(_WEIGHTS)
                         for d in _dtypes(tmp / name)})
        _fsync_dirs(tmp)
        _place(tmp, out, force=force)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing left once renamed
        shutil.rmtree(made, ignore_errors=True)
    return Exported(chosen=chosen, out=out, files=tuple(sorted(files)),
                    size=sum(e.size for e in files.values()), dtypes=tuple(dtypes),
                    seconds=time.monotonic() - started)


def _check_model(path: Path, files: Collection[str]) -> None:
    if _CONFIG not in files or not any(n.endswith(_WEIGHTS) for n in files):
        raise CheckpointError(
            f"{routing.display(path)} lists no {_CONFIG} or no {_WEIGHTS} weights in its "
            "manifest: it is not a Hugging Face model checkpoint", path=path)
    if not any(n in files for n in _TOKENIZER_FILES):
        log.warning("%s holds no tokenizer files (%s): the export loads as a model only; copy "
                    "the tokenizer of the run's initial model beside it", routing.display(path),
                    ", ".join(_TOKENIZER_FILES))


def _copy_result(src: Path, dst: Path, name: str, entry: ResultEntry, info: DeltaInfo) -> None:
    """A weights file made whole from a delta's chain (on this machine's disk), copied to
    the new file `dst` and checked there as its manifest lists it: the header's SHA-256
    and every tensor's checksum (trainer/delta.py `verify_result`)."""
    shutil.copyfile(src, dst)
    try:
        verify_result(dst, size=entry.size, header_sha256=entry.header_sha256,
                      digests=info.tensors, algorithm=info.tensor_hash, result=name)
    except CheckpointError as exc:
        raise CheckpointError(f"{exc}; nothing was written to --out", path=exc.path) from exc


def _copy(src: Path, dst: Path, entry: FileEntry) -> None:
    """`src` to the new file `dst`, hashed as copied; CheckpointError when it is not the
    manifest's file.  From a bucket the object is fetched straight to `dst`, not kept
    twice (in the node's local root and here)."""
    try:
        route = routing.routed(src)
        if route is None:
            copy_verified(src, dst, size=entry.size, sha256=entry.sha256)
            return
        route[0].download(route[1], dst, max_bytes=entry.size)
        size, sha256 = file_digest(dst)
        if (size, sha256) != (entry.size, entry.sha256):
            raise IntegrityError(src, f"fetched {size} bytes with SHA-256 {sha256[:16]}..., its "
                                 f"manifest says {entry.size} bytes, {entry.sha256[:16]}...: "
                                 "the object is altered")
    except MalformedRecordError as exc:  # IntegrityError, UnsafeFileError: named by path
        raise CheckpointError(f"{exc}; nothing was written to --out", path=src) from exc


def _dtypes(path: Path) -> set[str]:
    """The tensor dtypes a safetensors file declares in its header (8-byte length, JSON)."""
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8) or b"\0" * 8)
        if not 0 < length <= _HEADER_LIMIT:
            return set()
        try:
            header = json.loads(handle.read(length))
        except ValueError:
            return set()
    return {str(t.get("dtype")) for k, t in header.items()
            if k != "__metadata__" and isinstance(t, dict)}


def _fsync_dirs(root: Path) -> None:
    for directory in [*sorted((p for p in root.rglob("*") if p.is_dir()), reverse=True), root]:
        fsync_dir(directory)


def _place(tmp: Path, out: Path, *, force: bool) -> None:
    """Rename `tmp` to `out`.  rename(2) replaces an empty directory and refuses a
    non-empty one (ENOTEMPTY), so a --out filled meanwhile is never overwritten;
    with --force the old --out is moved aside first, then removed."""
    aside = None
    if force and out.is_dir() and any(out.iterdir()):
        aside = out.parent / f".{out.name}.replaced-{secrets.token_hex(4)}"
        os.rename(out, aside)
    try:
        os.rename(tmp, out)
    except OSError as exc:
        if aside is not None:
            os.rename(aside, out)  # put the user's directory back
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):  # filled since check_out looked
            raise UsageError(f"--out {out} was filled while the export ran: give a new "
                             "directory, or --force") from None
        raise
    fsync_dir(out.parent)
    if aside is not None:
        shutil.rmtree(aside)


def writes_to(exc: OSError, out: Path) -> bool:
    """Whether an OSError of the export names a path of the writing side: --out, its
    staging and set-aside siblings (.<name>.*) or its parent; not the checkpoint's."""
    out = Path(os.path.abspath(out.expanduser()))

    def ours(name: str) -> bool:
        path = Path(os.path.abspath(name))
        if path == out.parent or path.is_relative_to(out):
            return True
        mine = out.parent / path.relative_to(out.parent).parts[0] \
            if path.is_relative_to(out.parent) else None
        return mine is not None and mine.name.startswith(f".{out.name}.")

    return any(isinstance(name, str) and ours(name) for name in (exc.filename, exc.filename2))
