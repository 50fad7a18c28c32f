"""Publishing, verifying and caching Hugging Face checkpoints on a shared filesystem.

A checkpoint directory is complete or absent, never half-written: the files
are written into a hidden temporary sibling, hashed into `manifest.json`,
fsynced, and the directory is renamed into place.  Readers on other nodes
trust a checkpoint only after `verify_checkpoint` has matched every file
against the manifest, so a truncated copy, a stray file or a bit flip is
reported with the name of the file instead of being loaded.

    write files -> manifest.json -> fsync all -> rename tmp -> final -> fsync parent

`latest_checkpoint` picks by the iteration written in the manifest, never by
mtime: clocks differ between nodes and a copy refreshes mtimes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from coordinator.errors import MalformedRecordError as CoordinatorMalformed
from coordinator.fsio import ensure_dir, open_regular, publish_bytes, remove_tree, rename
from coordinator.fsio import fsync_dir as _fsync_dir
from coordinator.store import read_document
from coordinator.verified import copy_verified, file_digest, read_verified
from trainer.config import TrainerError

log = logging.getLogger(__name__)

MANIFEST_NAME: Final = "manifest.json"
MANIFEST_SCHEMA: Final = "coordinator/checkpoint-manifest"
MANIFEST_VERSION: Final = 1
_FILE_MODE: Final = 0o644
_DIR_MODE: Final = 0o755


class CheckpointError(TrainerError, ValueError):
    """A checkpoint is missing, incomplete, altered or conflicts with another.

    A ValueError, so that the run directory's reader retries a manifest that
    looked torn (coordinator.store.read_document) before reporting it.
    """

    def __init__(self, message: str, *, path: Path | None = None) -> None:
        super().__init__(message)
        self.path = path


def _fsync_file(path: Path) -> None:
    fd = open_regular(path)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True, kw_only=True)
class FileEntry:
    name: str  # relative path with "/" separators
    sha256: str
    size: int


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """What a complete checkpoint holds: its iteration and every file's hash and size."""

    iteration: int
    files: tuple[FileEntry, ...]

    def to_json(self) -> str:
        data = {
            "schema": MANIFEST_SCHEMA,
            "version": MANIFEST_VERSION,
            "iteration": self.iteration,
            "files": {f.name: {"sha256": f.sha256, "size": f.size} for f in self.files},
        }
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    @property
    def digest(self) -> str:
        """A short content id: equal digests mean equal checkpoints."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    @classmethod
    def parse(cls, text: bytes, *, source: Path) -> Manifest:
        def bad(rule: str) -> CheckpointError:
            return CheckpointError(f"{source}: malformed manifest: {rule}", path=source)

        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise bad(f"not JSON ({exc})") from exc
        if not isinstance(data, dict) or data.get("schema") != MANIFEST_SCHEMA:
            raise bad(f"schema must be {MANIFEST_SCHEMA!r}")
        if data.get("version") != MANIFEST_VERSION:
            raise bad(f"version {data.get('version')!r} is not {MANIFEST_VERSION}")
        iteration = data.get("iteration")
        if not isinstance(iteration, int) or isinstance(iteration, bool) or iteration < 0:
            raise bad(f"iteration {iteration!r} must be an integer >= 0")
        files = data.get("files")
        if not isinstance(files, dict) or not files:
            raise bad("files must be a non-empty object")
        entries = []
        for name, info in sorted(files.items()):
            parts = Path(name).parts
            # Names come from disk and may be hostile: never let one point outside.
            if (
                not name
                or Path(name).is_absolute()
                or ".." in parts
                or name == MANIFEST_NAME
                or "\\" in name
            ):
                raise bad(f"file name {name!r} is not a plain relative path")
            if not isinstance(info, dict):
                raise bad(f"entry for {name!r} must be an object")
            sha, size = info.get("sha256"), info.get("size")
            if (
                not isinstance(sha, str)
                or len(sha) != 64
                or any(c not in "0123456789abcdef" for c in sha)
            ):
                raise bad(f"sha256 of {name!r} is not 64 hex digits")
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise bad(f"size of {name!r} must be an integer >= 0")
            entries.append(FileEntry(name=name, sha256=sha, size=size))
        return cls(iteration=iteration, files=tuple(entries))


def _list_files(root: Path) -> list[str]:
    out = []
    for path in sorted(root.rglob("*")):
        if path.is_symlink():
            raise CheckpointError(
                f"{path}: checkpoints may not contain symlinks: remove it", path=path
            )
        if path.is_file():
            rel = path.relative_to(root).as_posix()
            if rel != MANIFEST_NAME:
                out.append(rel)
    return out


def _build_manifest(root: Path, iteration: int) -> Manifest:
    entries = []
    for rel in _list_files(root):
        size, sha256 = file_digest(root / rel)  # the size of what was read, not a cached stat
        entries.append(FileEntry(name=rel, sha256=sha256, size=size))
    return Manifest(iteration=iteration, files=tuple(entries))


def read_manifest(directory: Path) -> Manifest:
    """A checkpoint's manifest, read like every record of the run directory."""
    path = directory / MANIFEST_NAME
    try:
        manifest = read_document(path, lambda raw, where: Manifest.parse(raw, source=where))
    except CoordinatorMalformed as exc:  # a symlink, FIFO or giant where the manifest belongs
        raise CheckpointError(str(exc), path=path) from exc
    if manifest is None:
        raise CheckpointError(
            f"{path} is missing: {directory} is not a published checkpoint", path=path
        )
    return manifest


def verify_checkpoint(directory: Path) -> Manifest:
    """Check every file against the manifest; raise CheckpointError naming the first bad one."""
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint {directory} does not exist", path=directory)
    manifest = read_manifest(directory)
    expected = {f.name: f for f in manifest.files}
    present = set(_list_files(directory))
    for name in sorted(present - expected.keys()):
        raise CheckpointError(
            f"{directory / name}: extra file not in the manifest of {directory}: "
            "the checkpoint was modified after publishing",
            path=directory / name,
        )
    for name, entry in expected.items():
        path = directory / name
        if name not in present:
            raise CheckpointError(f"{path}: file listed in the manifest is missing", path=path)
        try:
            read_verified(path, size=entry.size, sha256=entry.sha256, allow_map=False).close()
        except CoordinatorMalformed as exc:
            raise CheckpointError(str(exc), path=path) from exc
    return manifest


def _finalise_dir(tmp: Path, manifest: Manifest, final_dir: Path) -> Manifest:
    """Rename a fully written, fsynced tmp dir to final_dir, or accept an identical one."""
    try:
        if final_dir.exists() and any(final_dir.iterdir()):
            raise FileExistsError(final_dir)
        # On Linux rename() onto an empty directory replaces it atomically.
        rename(tmp, final_dir)
    except OSError as exc:
        if not final_dir.exists():
            raise CheckpointError(f"cannot publish {final_dir}: {exc}", path=final_dir) from exc
        # Another writer (or an earlier attempt of ours) got there first.
        existing = verify_checkpoint(final_dir)
        if existing != manifest:
            raise CheckpointError(
                f"{final_dir} already holds a different checkpoint (iteration "
                f"{existing.iteration}, content {existing.digest} vs ours {manifest.digest}): "
                "refusing to overwrite; publish to a new directory",
                path=final_dir,
            ) from None
        remove_tree(tmp)
        return existing
    _fsync_dir(final_dir.parent)
    return manifest


def _tmp_sibling(final_dir: Path) -> Path:
    """A new hidden directory beside `final_dir` (made beneath the run directory
    without following symlinks, mode 0755)."""
    tmp = final_dir.parent / f".{final_dir.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    ensure_dir(tmp)
    return tmp


def _seal(tmp: Path, manifest: Manifest) -> None:
    """Write the manifest, restrict modes, and fsync every file and the dir."""
    (tmp / MANIFEST_NAME).write_text(manifest.to_json())
    fsync_tree(tmp)


def fsync_tree(tmp: Path) -> None:
    """Restrict modes and fsync every file and directory under tmp, then tmp."""
    for path in tmp.rglob("*"):
        os.chmod(path, _DIR_MODE if path.is_dir() else _FILE_MODE)
        if path.is_file():
            _fsync_file(path)
    for path in sorted((p for p in tmp.rglob("*") if p.is_dir()), reverse=True):
        _fsync_dir(path)
    _fsync_dir(tmp)


# Files that hold weights; everything else in a checkpoint (config, tokenizer,
# generation config, chat template) is carried over verbatim by training.
_WEIGHT_SUFFIXES: Final = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json")


def write_model_files(
    model: Any,
    tokenizer: Any,
    directory: Path,
    *,
    state_dict: dict[str, Any] | None = None,
    carry_files_from: Path | None = None,
) -> None:
    """Config, safetensors weights and tokenizer files.

    With `carry_files_from`, every non-weight file of that checkpoint is copied
    byte for byte over what transformers wrote: training changes only weights,
    and the source's files may be written for other readers (vLLM pinning
    transformers 4.x) in ways a 5.x save_pretrained would not reproduce.
    """
    model.save_pretrained(directory, state_dict=state_dict)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    if carry_files_from is not None:
        for src in sorted(carry_files_from.iterdir()):
            if (
                src.is_file()
                and not src.is_symlink()
                and not src.name.startswith(".")
                and src.name != MANIFEST_NAME
                and not src.name.endswith(_WEIGHT_SUFFIXES)
            ):
                shutil.copyfile(src, directory / src.name)
        if not (carry_files_from / "chat_template.jinja").exists():
            # transformers 5 writes the template to its own file; the source
            # kept it inside tokenizer_config.json, which is enough.
            (directory / "chat_template.jinja").unlink(missing_ok=True)


def seal_directory(tmp: Path, final_dir: Path, *, iteration: int) -> Manifest:
    """Manifest + fsync a fully written tmp dir, then rename it to final_dir."""
    try:
        manifest = _build_manifest(tmp, iteration)
        _seal(tmp, manifest)
        return _finalise_dir(tmp, manifest, final_dir)
    finally:
        remove_tree(tmp)  # a no-op once renamed


def publish_checkpoint(
    model: Any,
    tokenizer: Any,
    final_dir: Path,
    *,
    iteration: int,
    state_dict: dict[str, Any] | None = None,
    carry_files_from: Path | None = None,
) -> Manifest:
    """Write model + tokenizer to final_dir atomically with a manifest.

    Idempotent: publishing the same content twice is a no-op; publishing
    different content to an existing final_dir raises CheckpointError.
    `state_dict` overrides the model's own tensors (a gathered FSDP state);
    `carry_files_from` copies the non-weight files of the source checkpoint.
    """
    if iteration < 0:
        raise CheckpointError(f"iteration={iteration} must be >= 0", path=final_dir)
    tmp = _tmp_sibling(final_dir)
    try:
        write_model_files(
            model, tokenizer, tmp, state_dict=state_dict, carry_files_from=carry_files_from
        )
    except BaseException:
        remove_tree(tmp)
        raise
    return seal_directory(tmp, final_dir, iteration=iteration)


def copy_to_local_cache(src_dir: Path, cache_root: Path) -> Path:
    """A verified local copy of a published checkpoint, reused when already cached.

    The copy is hashed against the manifest verified on the source *before*
    copying, so a source file changed mid-copy is caught, not cached.
    """
    manifest = verify_checkpoint(src_dir)
    dest = cache_root / f"{src_dir.name}-{manifest.digest}"
    if dest.exists():
        try:
            if verify_checkpoint(dest) == manifest:
                return dest
        except CheckpointError as exc:
            log.warning("cached copy %s is damaged (%s): copying again", dest, exc)
        remove_tree(dest)
    tmp = _tmp_sibling(dest)
    try:
        for entry in manifest.files:
            target = tmp / entry.name
            ensure_dir(target.parent)
            try:
                copy_verified(src_dir / entry.name, target, size=entry.size,
                              sha256=entry.sha256)
            except CoordinatorMalformed as exc:
                raise CheckpointError(f"{exc}; retry", path=src_dir / entry.name) from exc
        _seal(tmp, manifest)
        _finalise_dir(tmp, manifest, dest)
        return dest
    finally:
        remove_tree(tmp)


def latest_checkpoint(root: Path, *, verify: bool = True) -> Path | None:
    """The published checkpoint under root with the highest manifest iteration.

    Hidden (temporary) dirs and dirs without a readable manifest are skipped;
    with verify=True a damaged newest checkpoint is skipped for the next one.
    """
    if not root.is_dir():
        return None
    candidates: list[tuple[int, str, Path]] = []
    for child in root.iterdir():
        if child.name.startswith(".") or not child.is_dir() or child.is_symlink():
            continue
        try:
            candidates.append((read_manifest(child).iteration, child.name, child))
        except (CheckpointError, OSError) as exc:
            log.warning("skipping %s: %s", child, exc)
    for _, _, path in sorted(candidates, reverse=True):
        if not verify:
            return path
        try:
            verify_checkpoint(path)
            return path
        except (CheckpointError, OSError) as exc:
            log.warning("skipping damaged checkpoint %s: %s", path, exc)
    return None


# ---------------------------------------------------------------- optimizer state
#
# One file per rank, optim_dir/rank-R.pt.  When a new state is saved the
# previous iteration's file is kept as rank-R.prev.pt: if the iteration is then
# retried (its checkpoint never got published), the retry restores the state
# from *before* the failed attempt instead of applying its moments twice.

OPTIM_SCHEMA: Final = "coordinator/optimizer-state"
OPTIM_VERSION: Final = 1


@dataclass(frozen=True, kw_only=True)
class OptimizerState:
    iteration: int  # the iteration whose update produced this state
    rank: int
    world_size: int
    strategy: str
    step: int  # optimizer steps taken so far, over all iterations
    optimizer: dict[str, Any]  # torch.optim.Optimizer.state_dict()


def optimizer_state_path(optim_dir: Path, rank: int, *, previous: bool = False) -> Path:
    return optim_dir / (f"rank-{rank}.prev.pt" if previous else f"rank-{rank}.pt")


def _load_optimizer_file(path: Path) -> OptimizerState:
    import torch

    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # any unpickling failure means a corrupt or foreign file
        raise CheckpointError(f"{path}: unreadable optimizer state ({exc})", path=path) from exc
    if not isinstance(data, dict) or data.get("schema") != OPTIM_SCHEMA:
        raise CheckpointError(
            f"{path}: not an optimizer state (schema {OPTIM_SCHEMA!r})", path=path
        )
    if data.get("version") != OPTIM_VERSION:
        raise CheckpointError(
            f"{path}: version {data.get('version')!r} is not {OPTIM_VERSION}", path=path
        )
    for key in ("iteration", "rank", "world_size", "step"):
        value = data.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise CheckpointError(
                f"{path}: field {key}={value!r} must be an integer >= 0", path=path
            )
    optimizer = data.get("optimizer")
    if not isinstance(optimizer, dict) or set(optimizer) != {"state", "param_groups"}:
        raise CheckpointError(f"{path}: field optimizer is not an optimizer state_dict", path=path)
    return OptimizerState(
        iteration=data["iteration"],
        rank=data["rank"],
        world_size=data["world_size"],
        strategy=str(data.get("strategy")),
        step=data["step"],
        optimizer=optimizer,
    )


def save_optimizer_state(state: OptimizerState, optim_dir: Path) -> Path:
    """Publish this rank's state atomically, keeping the previous iteration's as .prev."""
    import io

    import torch

    path = optimizer_state_path(optim_dir, state.rank)
    if path.exists():
        try:
            older = _load_optimizer_file(path)
        except CheckpointError as exc:
            log.warning("replacing unreadable %s: %s", path, exc)
        else:
            if older.iteration < state.iteration:
                os.replace(path, optimizer_state_path(optim_dir, state.rank, previous=True))
    buffer = io.BytesIO()
    torch.save(
        {
            "schema": OPTIM_SCHEMA,
            "version": OPTIM_VERSION,
            "iteration": state.iteration,
            "rank": state.rank,
            "world_size": state.world_size,
            "strategy": state.strategy,
            "step": state.step,
            "optimizer": state.optimizer,
        },
        buffer,
    )
    publish_bytes(path, buffer.getvalue())
    return path


def load_optimizer_state(
    optim_dir: Path, *, rank: int, before_iteration: int
) -> OptimizerState | None:
    """This rank's newest saved state from an iteration before `before_iteration`, if any.

    Unreadable files are logged and skipped: losing Adam's moments costs a
    little progress, refusing to train would stall the run.
    """
    best: OptimizerState | None = None
    for previous in (False, True):
        path = optimizer_state_path(optim_dir, rank, previous=previous)
        if not path.exists():
            continue
        try:
            state = _load_optimizer_file(path)
        except CheckpointError as exc:
            log.warning("ignoring optimizer state: %s", exc)
            continue
        if state.rank != rank:
            log.warning("ignoring %s: it belongs to rank %d", path, state.rank)
            continue
        if state.iteration < before_iteration and (
            best is None or state.iteration > best.iteration
        ):
            best = state
    return best
