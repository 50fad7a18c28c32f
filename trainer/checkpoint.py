"""Publishing, verifying and caching Hugging Face checkpoints on a shared filesystem.

A checkpoint directory is complete or absent, never half-written: the files
are written into a hidden temporary sibling, hashed into `manifest.json`,
fsynced, and the directory is renamed into place.  Readers on other nodes
trust a checkpoint only after `verify_checkpoint` has matched every file
against the manifest, so a truncated copy, a stray file or a bit flip is
reported with the name of the file instead of being loaded.

    write files -> manifest.json -> fsync all -> rename tmp -> final -> fsync parent

The manifest is a coordinator record (coordinator/records.py), on disk:

    {"schema": "coordinator/checkpoint-manifest", "version": 1, "iteration": 3,
     "files": {"model.safetensors": {"sha256": "<64 hex>", "size": 81920}, ...},
     "probes": {"dtype": "float32", "sequences": [{"token_ids": [...],
                "logprobs": [...]}, ...]} or null}

Every failure a caller should act on is a `CheckpointError` (rollout.errors,
the one class for unusable checkpoints) carrying the offending path.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import stat
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Final

from coordinator import routing, trees
from coordinator.errors import MalformedRecordError, UnsafeFileError
from coordinator.fsio import (
    DIR_MODE,
    FILE_MODE,
    ensure_dir,
    fsync_dir,
    open_regular,
    remove_tree,
    rename,
)
from coordinator.records import Record
from coordinator.store import read_document
from coordinator.verified import (
    copy_hashed,
    copy_verified,
    file_digest,
    in_parallel,
    read_verified,
)
from rollout.errors import CheckpointError
from trainer.probes import ProbeSet

log = logging.getLogger(__name__)

MANIFEST_NAME: Final = "manifest.json"
MANIFEST_SCHEMA: Final = "coordinator/checkpoint-manifest"
_SHA256: Final = re.compile(r"[0-9a-f]{64}")
# Files that hold weights; everything else in a checkpoint (config, tokenizer,
# generation config, chat template) is carried over verbatim by training.
_WEIGHT_SUFFIXES: Final = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json")
# The dtypes a checkpoint's weights may be published in (saved_dtype).
SAVED_DTYPES: Final = ("float32", "bfloat16", "float16")


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
class Manifest(Record):
    """What a complete checkpoint holds: its iteration and every file's hash and size."""

    SCHEMA: ClassVar[str] = MANIFEST_SCHEMA
    iteration: int
    files: dict[str, FileEntry]  # relative path with "/" separators -> entry
    # What the trainer's weights say about fixed sequences (trainer/probes.py):
    # phase 12 checks the engine serves these weights.  None: not trained here.
    probes: ProbeSet | None = None

    def __post_init__(self) -> None:
        if type(self.iteration) is not int or self.iteration < 0:
            raise ValueError(f"iteration {self.iteration!r} is not an integer >= 0")
        if not self.files:
            raise ValueError("files is empty: a checkpoint lists at least one file")
        for name in self.files:
            _check_file_name(name)

    def to_bytes(self) -> bytes:
        # Keys sorted: the bytes are the checkpoint's content id (`digest`) and
        # must not depend on the order the files were listed in.  Indented so
        # that an operator can read the manifest.
        return (json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n").encode()

    @property
    def digest(self) -> str:
        """A short content id: equal manifests, equal digests."""
        return hashlib.sha256(self.to_bytes()).hexdigest()[:16]


def _list_files(root: Path) -> list[str]:
    try:
        names = trees.list_files(root)
    except UnsafeFileError as exc:
        raise CheckpointError(f"{exc.path}: checkpoints may not contain symlinks: remove it",
                              path=exc.path) from None
    return [name for name in names if name != MANIFEST_NAME]


def _build_manifest(root: Path, iteration: int, probes: ProbeSet | None,
                    hashed: Mapping[str, tuple[int, str]] | None = None) -> Manifest:
    """The manifest of the files under `root`: (size, SHA-256) from `hashed` where the
    copy that wrote a file hashed it, otherwise read back (every file at once); the
    size is that of what was read or written, never a cached stat."""
    hashed = dict(hashed or {})
    names = _list_files(root)
    hashed.update(in_parallel({rel: functools.partial(file_digest, root / rel)
                               for rel in names if rel not in hashed}))
    files = {rel: FileEntry(size=hashed[rel][0], sha256=hashed[rel][1]) for rel in names}
    try:
        return Manifest(iteration=iteration, files=files, probes=probes)
    except ValueError as exc:  # nothing written, or a name no reader would accept
        raise CheckpointError(f"cannot publish {root}: {exc}", path=root) from exc


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


def verify_checkpoint(directory: Path, *, contents: bool = True) -> Manifest:
    """Check every file against the manifest; raise CheckpointError naming the first bad one.

    `contents=False` checks the names only: for a caller that hashes every file as it
    copies it (copy_to_local_cache, coordinator export, phase 11 before every node's
    copy at phase 12), which would otherwise read each file twice.
    """
    if not trees.is_dir(directory):
        raise CheckpointError(f"checkpoint {directory} does not exist", path=directory)
    manifest = read_manifest(directory)
    present = set(_list_files(directory))
    extra = sorted(present - manifest.files.keys())
    if extra:
        path = directory / extra[0]
        raise CheckpointError(
            f"{path}: extra file not in the manifest of {directory}: "
            "the checkpoint was modified after publishing",
            path=path,
        )
    for name, entry in sorted(manifest.files.items()):
        path = directory / name
        if name not in present:
            raise CheckpointError(f"{path}: file listed in the manifest is missing", path=path)
        if not contents:
            continue
        try:
            read_verified(path, size=entry.size, sha256=entry.sha256, allow_map=False).close()
        except MalformedRecordError as exc:
            raise CheckpointError(str(exc), path=path) from exc
    return manifest


def _finalise_dir(tmp: Path, manifest: Manifest, final_dir: Path) -> Manifest:
    """Rename a fully written, fsynced tmp dir to final_dir, or accept an identical one."""
    bucket = routing.routed(final_dir) is not None
    try:
        if not bucket and final_dir.exists() and any(final_dir.iterdir()):
            raise FileExistsError(final_dir)
        # On Linux rename() onto an empty directory replaces it atomically; in a
        # bucket the manifest object, written last, publishes it (trees.publish_tree).
        trees.publish_tree(tmp, final_dir, last=MANIFEST_NAME)
    except OSError as exc:
        if not trees.is_dir(final_dir):
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
    if not bucket:
        fsync_dir(final_dir.parent)
    return manifest


def tmp_sibling(final_dir: Path) -> Path:
    """A new hidden directory beside `final_dir` (made beneath the run directory
    without following symlinks, mode 0755)."""
    tmp = final_dir.parent / f".{final_dir.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    ensure_dir(tmp)
    return tmp


def _seal(tmp: Path, manifest: Manifest) -> None:
    """Write the manifest, restrict modes, and fsync every file and the dir."""
    (tmp / MANIFEST_NAME).write_bytes(manifest.to_bytes())
    fsync_tree(tmp)


def _fsync_file(path: Path) -> None:
    fd = open_regular(path)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(tmp: Path) -> None:
    """Restrict modes and fsync every file and directory under tmp, then tmp."""
    for path in tmp.rglob("*"):
        os.chmod(path, DIR_MODE if path.is_dir() else FILE_MODE)
        if path.is_file():
            _fsync_file(path)
    for path in sorted((p for p in tmp.rglob("*") if p.is_dir()), reverse=True):
        fsync_dir(path)
    fsync_dir(tmp)


def saved_dtype(model_dir: Path) -> str:
    """The dtype a model directory keeps its weights in, as engines read it: config.json's
    `dtype` (transformers 5) or `torch_dtype` (4.x); float32 when it names none.

    Training keeps fp32 master weights (in memory and in train_state/) and publishes in
    this dtype, so a bf16 model stays bf16 checkpoint after checkpoint.  A checkpoint
    carries its source's config.json, so the initial model's dtype holds for the run.
    """
    path = model_dir / "config.json"
    try:
        config = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot read the model's config ({exc}): a Hugging "
                              "Face model directory has a config.json", path=path) from exc
    value = (config.get("dtype") or config.get("torch_dtype")) if isinstance(config, dict) \
        else None
    if value is None:
        return "float32"
    if value not in SAVED_DTYPES:
        raise CheckpointError(f"{path}: dtype {value!r} is not one of {list(SAVED_DTYPES)}: "
                              "give the dtype the weights are saved in", path=path)
    return str(value)


def cast_state(state: dict[str, Any], dtype: str) -> dict[str, Any]:
    """`state` with its floating tensors in `dtype`; tensors that share storage (tied
    embeddings) still share it, so save_pretrained writes them once."""
    import torch

    target = getattr(torch, dtype)
    done: dict[tuple[int, tuple[int, ...]], Any] = {}
    out = {}
    for name, tensor in state.items():
        if not tensor.is_floating_point() or tensor.dtype == target:
            out[name] = tensor
            continue
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # FSDP2 DTensors
        key = (local.data_ptr(), tuple(tensor.shape))
        if key not in done:
            done[key] = tensor.detach().to(target)
        out[name] = done[key]
    return out


def write_model_files(
    model: Any,
    tokenizer: Any,
    directory: Path,
    *,
    state_dict: dict[str, Any] | None = None,
    carry_files_from: Path | None = None,
    weights_from: Path | None = None,
    dtype: str | None = None,
) -> None:
    """Config, safetensors weights and tokenizer files.

    With `weights_from` (a directory of consolidated safetensors files and their
    index, trainer/sharded_save.py), those files are moved in as the weights and
    only the config is written from the model.  With `dtype`, the weights are
    written in that dtype (saved_dtype: the model's own), whatever the model's
    parameters are in.

    With `carry_files_from`, every non-weight file of that checkpoint is copied
    byte for byte over what transformers wrote: training changes only weights,
    and the source's files may be written for other readers (vLLM pinning
    transformers 4.x) in ways a 5.x save_pretrained would not reproduce.
    """
    if weights_from is None:
        if dtype is not None:
            state_dict = cast_state(state_dict if state_dict is not None
                                    else model.state_dict(), dtype)
        model.save_pretrained(directory, state_dict=state_dict)
    else:
        ensure_dir(directory)
        model.config.save_pretrained(directory)
        moved = [p for p in sorted(weights_from.iterdir())
                 if p.is_file() and not p.is_symlink() and p.name.endswith(_WEIGHT_SUFFIXES)]
        if not any(p.name.endswith(".safetensors") for p in moved):
            raise CheckpointError(f"{weights_from} holds no consolidated safetensors file",
                                  path=weights_from)
        for src in moved:
            rename(src, directory / src.name)
    if dtype is not None:
        # transformers names the parameters' dtype; the file holds `dtype`.
        config_path = directory / "config.json"
        config = json.loads(config_path.read_bytes())
        config["dtype"] = dtype
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
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


def seal_directory(tmp: Path, final_dir: Path, *, iteration: int,
                   probes: ProbeSet | None = None,
                   hashed: Mapping[str, tuple[int, str]] | None = None) -> Manifest:
    """Manifest + fsync a fully written tmp dir, then rename it to final_dir.  `hashed`:
    the (size, SHA-256) of files hashed as they were written, not read back."""
    try:
        manifest = _build_manifest(tmp, iteration, probes, hashed)
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
    probes: ProbeSet | None = None,
    weights_from: Path | None = None,
    dtype: str | None = None,
) -> Manifest:
    """Write model + tokenizer to final_dir atomically with a manifest.

    Idempotent: publishing the same content twice is a no-op; publishing
    different content to an existing final_dir raises CheckpointError.
    `state_dict` overrides the model's own tensors (a gathered FSDP state);
    `carry_files_from` copies the non-weight files of the source checkpoint;
    `dtype` is the weights' dtype on disk (write_model_files).
    """
    if iteration < 0:
        raise CheckpointError(f"iteration={iteration} must be >= 0", path=final_dir)
    tmp = tmp_sibling(final_dir)
    hashed: dict[str, tuple[int, str]] = {}
    try:
        if weights_from is None and routing.routed(final_dir) is None:
            hashed = _write_staged(tmp, lambda staging: write_model_files(
                model, tokenizer, staging, state_dict=state_dict,
                carry_files_from=carry_files_from, dtype=dtype))
        else:  # a bucket's tmp is node-local already; FSDP's weights are on the share
            write_model_files(
                model, tokenizer, tmp, state_dict=state_dict, carry_files_from=carry_files_from,
                weights_from=weights_from, dtype=dtype,
            )
    except BaseException:
        remove_tree(tmp)
        raise
    finally:
        if weights_from is not None:
            remove_tree(weights_from)  # the staged shards: its consolidated files moved in
    return seal_directory(tmp, final_dir, iteration=iteration, probes=probes, hashed=hashed)


def _write_staged(tmp: Path, write: Callable[[Path], None]) -> dict[str, tuple[int, str]]:
    """`write` into a private directory on this node's disk (TMPDIR: under the run's
    node-local root for the trainer, rl/node_local.py), then each file copied to `tmp`
    on the shared filesystem, hashed as it is copied (every file at once): the
    publisher never reads the checkpoint back from the share.  (size, SHA-256) by
    relative name.  Without room on this node's disk, written to `tmp` directly and
    read back to hash it (logged)."""
    staging = Path(tempfile.mkdtemp(prefix="publish-"))
    try:
        try:
            write(staging)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            log.warning("no room to stage the checkpoint in %s (%s): writing it to %s directly "
                        "and reading it back to hash it; give TMPDIR (or "
                        "checkpoint.local_cache) room for one checkpoint", staging, exc, tmp)
            remove_tree(staging)
            write(tmp)
            return {}
        names = _list_files(staging)
        for rel in names:
            ensure_dir((tmp / rel).parent)
        return in_parallel({rel: functools.partial(copy_hashed, staging / rel, tmp / rel)
                            for rel in names})
    finally:
        remove_tree(staging)


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
    if sealed_copy_of(directory, manifest, only=False):
        return directory  # fetched and verified before; its manifest was written last

    def fetch(name: str, entry: FileEntry) -> None:
        path = directory / name
        try:  # fetches the object to `path`, then hashes what it fetched
            read_verified(path, size=entry.size, sha256=entry.sha256, allow_map=False).close()
        except MalformedRecordError as exc:
            raise CheckpointError(str(exc), path=path) from exc

    # The local manifest goes first, and comes back once every file is verified.
    with contextlib.suppress(FileNotFoundError):
        os.unlink(directory / MANIFEST_NAME)
    in_parallel({name: functools.partial(fetch, name, entry)
                 for name, entry in manifest.files.items()})
    local_manifest = directory / MANIFEST_NAME
    local_manifest.write_bytes(manifest.to_bytes())
    os.chmod(local_manifest, FILE_MODE)
    return directory


def sealed_copy_of(local: Path, manifest: Manifest, *, only: bool = True) -> bool:
    """Whether `local`, a copy on this node's disk, holds `manifest`'s checkpoint: its own
    manifest (written last, once every file was verified as it was copied) has the same
    bytes, and every file is there, a regular file of the listed size (and, `only`, no
    other file).  Trusted this way, not hashed again at every use: the copy is this
    user's (mode 0700, rl/node_local.py), and a copy cut short has no manifest or a
    short file.  Plain local reads: beneath a bucket's node-local root too."""
    expected = manifest.to_bytes()
    try:
        with open(local / MANIFEST_NAME, "rb") as handle:
            if handle.read(len(expected) + 1) != expected:
                return False
        for name, entry in manifest.files.items():
            st = os.lstat(local / name)
            if not stat.S_ISREG(st.st_mode) or st.st_size != entry.size:
                return False
        return not only or set(_list_files(local)) == manifest.files.keys()
    except (CheckpointError, OSError):
        return False


def copy_to_local_cache(src_dir: Path, cache_root: Path) -> Path:
    """A verified local copy of a published checkpoint, reused when already cached.

    One pass over the shared filesystem: the names are checked against the manifest,
    then every file is copied (all at once), hashed as it is read and checked against
    the manifest, so a file altered on the share, or changed mid-copy, is caught and
    never cached.  A cached copy is trusted by its sealed manifest and file sizes
    (sealed_copy_of), not hashed again.
    """
    manifest = verify_checkpoint(src_dir, contents=False)
    dest = cache_root / f"{src_dir.name}-{manifest.digest}"
    if dest.exists():
        if sealed_copy_of(dest, manifest):
            return dest
        log.warning("cached copy %s does not match its manifest (cut short or altered): "
                    "copying again", dest)
        remove_tree(dest)
    tmp = tmp_sibling(dest)

    def copy(name: str, entry: FileEntry) -> None:
        try:
            copy_verified(src_dir / name, tmp / name, size=entry.size, sha256=entry.sha256)
        except MalformedRecordError as exc:
            raise CheckpointError(f"{exc}; retry", path=src_dir / name) from exc

    try:
        for name in manifest.files:
            ensure_dir((tmp / name).parent)
        in_parallel({name: functools.partial(copy, name, entry)
                     for name, entry in manifest.files.items()})
        _seal(tmp, manifest)
        _finalise_dir(tmp, manifest, dest)
        return dest
    finally:
        remove_tree(tmp)
