"""Publishing, verifying and caching Hugging Face checkpoints on a shared filesystem.

A checkpoint directory is complete or absent, never half-written: the files
are written into a hidden temporary sibling, hashed into `manifest.json`,
fsynced, and the directory is renamed into place.  Readers on other nodes
trust a checkpoint only after `verify_checkpoint` has matched every file
against the manifest, so a truncated copy, a stray file or a bit flip is
reported with the name of the file instead of being loaded.

    write files -> manifest.json -> fsync all -> rename tmp -> final -> fsync parent

The manifest is a coordinator record (coordinator/records/records.py), on disk:

    {"schema": "coordinator/checkpoint-manifest", "version": 1, "iteration": 3,
     "files": {"model.safetensors": {"sha256": "<64 hex>", "size": 81920}, ...},
     "probes": {"dtype": "float32", "sequences": [{"token_ids": [...],
                "logprobs": [...]}, ...]} or null}

Every failure a caller should act on is a `CheckpointError` (rollout.errors,
the one class for unusable checkpoints) carrying the offending path.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import secrets
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from coordinator import routing
from coordinator.errors import MalformedRecordError
from coordinator.storage import trees
from coordinator.storage.fsio import (
    DIR_MODE,
    FILE_MODE,
    ensure_dir,
    fsync_dir,
    open_regular,
    remove_tree,
    rename,
)
from coordinator.storage.verified import (
    file_digest,
    in_parallel,
    read_verified,
)
from rollout.errors import CheckpointError
from trainer.manifest import (
    MANIFEST_NAME,
    MANIFEST_SCHEMA,
    DeltaInfo,
    FileEntry,
    Manifest,
    list_files,
    read_manifest,
)
from trainer.probes import ProbeSet

__all__ = ["MANIFEST_NAME", "MANIFEST_SCHEMA", "CheckpointError", "DeltaInfo", "FileEntry",
           "Manifest", "read_manifest"]

log = logging.getLogger(__name__)

# Files that hold weights; everything else in a checkpoint (config, tokenizer,
# generation config, chat template) is carried over verbatim by training.
_WEIGHT_SUFFIXES: Final = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json")
# The dtypes a checkpoint's weights may be published in (saved_dtype).
SAVED_DTYPES: Final = ("float32", "bfloat16", "float16")


def _build_manifest(root: Path, iteration: int, probes: ProbeSet | None,
                    hashed: Mapping[str, tuple[int, str]] | None = None,
                    delta: DeltaInfo | None = None) -> Manifest:
    """The manifest of the files under `root`: (size, SHA-256) from `hashed` where the
    copy that wrote a file hashed it, otherwise read back (every file at once); the
    size is that of what was read or written, never a cached stat."""
    hashed = dict(hashed or {})
    names = list_files(root)
    hashed.update(in_parallel({rel: functools.partial(file_digest, root / rel)
                               for rel in names if rel not in hashed}))
    files = {rel: FileEntry(size=hashed[rel][0], sha256=hashed[rel][1]) for rel in names}
    try:
        return Manifest(iteration=iteration, files=files, probes=probes, delta=delta)
    except ValueError as exc:  # nothing written, or a name no reader would accept
        raise CheckpointError(f"cannot publish {root}: {exc}", path=root) from exc


def verify_checkpoint(directory: Path, *, contents: bool = True) -> Manifest:
    """Check every file against the manifest; raise CheckpointError naming the first bad one.

    `contents=False` checks the names only: for a caller that hashes every file as it
    copies it (copy_to_local_cache, coordinator export, phase 11 before every node's
    copy at phase 12), which would otherwise read each file twice.
    """
    if not trees.is_dir(directory):
        raise CheckpointError(f"checkpoint {directory} does not exist", path=directory)
    manifest = read_manifest(directory)
    present = set(list_files(directory))
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


def tmp_sibling(final_dir: Path, *, make: bool = True) -> Path:
    """A new hidden directory beside `final_dir` (made beneath the run directory
    without following symlinks, mode 0755; only named without `make`)."""
    tmp = final_dir.parent / f".{final_dir.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    if make:
        ensure_dir(tmp)
    return tmp


def seal_files(tmp: Path, manifest: Manifest, *, fsync: bool = True) -> None:
    """Write the manifest, restrict modes, and fsync every file and the dir (unless
    `fsync` is False: a node-local copy sealed for this boot, local_copy.py)."""
    (tmp / MANIFEST_NAME).write_bytes(manifest.to_bytes())
    fsync_tree(tmp, fsync=fsync)


def _fsync_file(path: Path) -> None:
    fd = open_regular(path)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(tmp: Path, *, fsync: bool = True) -> None:
    """Restrict modes and fsync every file and directory under tmp, then tmp (only
    the modes when `fsync` is False)."""
    for path in tmp.rglob("*"):
        os.chmod(path, DIR_MODE if path.is_dir() else FILE_MODE)
        if fsync and path.is_file():
            _fsync_file(path)
    if not fsync:
        return
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
                   hashed: Mapping[str, tuple[int, str]] | None = None,
                   delta: DeltaInfo | None = None) -> Manifest:
    """Manifest + fsync a fully written tmp dir, then rename it to final_dir.  `hashed`:
    the (size, SHA-256) of files hashed as they were written, not read back; `delta`:
    what a delta checkpoint was made from (trainer/manifest.py)."""
    try:
        manifest = _build_manifest(tmp, iteration, probes, hashed, delta)
        seal_files(tmp, manifest)
        return _finalise_dir(tmp, manifest, final_dir)
    finally:
        remove_tree(tmp)  # a no-op once renamed


def _model_state(model: Any, state_dict: dict[str, Any] | None) -> dict[str, Any] | None:
    """The tensors write_model_files would save (before their cast to `dtype`)."""
    if state_dict is not None:
        return state_dict
    return model.state_dict() if hasattr(model, "state_dict") else None


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
    delta_parent: Path | None = None,
    last_published: Path | None = None,
) -> Manifest:
    """Write model + tokenizer to final_dir atomically with a manifest.

    Idempotent: publishing the same content twice is a no-op; publishing
    different content to an existing final_dir raises CheckpointError.
    `state_dict` overrides the model's own tensors (a gathered FSDP state);
    `carry_files_from` copies the non-weight files of the source checkpoint;
    `dtype` is the weights' dtype on disk (write_model_files).

    The files are written on this node's disk first, then copied to the share, hashed
    as they are copied (trainer/publisher.py).  With `last_published`, a directory on
    this node's disk, the files are kept there for the next publication; with
    `delta_parent` too (a sibling checkpoint whose files are kept there), each weights
    file is published as its delta from the parent's: taken from the model's tensors
    and written into the kept files (trainer/kept_delta.py), or, where those are not
    the kept files' tensors, from the file written whole (trainer/delta.py).
    """
    from trainer import publisher

    if iteration < 0:
        raise CheckpointError(f"iteration={iteration} must be >= 0", path=final_dir)
    tmp = tmp_sibling(final_dir)
    hashed: dict[str, tuple[int, str]] = {}
    staged: publisher.Staged | None = None
    try:
        if weights_from is not None:  # FSDP's consolidated weights are on the share
            write_model_files(  # already: read back once
                model, tokenizer, tmp, state_dict=state_dict, carry_files_from=carry_files_from,
                weights_from=weights_from, dtype=dtype,
            )
        elif delta_parent is not None and last_published is not None:
            # Every file but the weights (save_pretrained of no tensors writes the rest).
            staged = publisher.advance_kept(
                _model_state(model, state_dict), dtype, final_dir, delta_parent,
                last_published, lambda out: write_model_files(
                    model, tokenizer, out, state_dict={}, carry_files_from=carry_files_from,
                    dtype=dtype))
        if weights_from is None and staged is None:
            staged = publisher.stage(tmp, lambda out: write_model_files(
                model, tokenizer, out, state_dict=state_dict,
                carry_files_from=carry_files_from, dtype=dtype))
            if staged is not None:
                staged = publisher.with_delta(staged, final_dir, delta_parent, last_published)
        if staged is not None:
            hashed = publisher.upload(staged, tmp)
        manifest = seal_directory(tmp, final_dir, iteration=iteration, probes=probes,
                                  hashed=hashed, delta=staged.delta if staged else None)
    except BaseException:
        remove_tree(tmp)
        if staged is not None:
            staged.remove()
        raise
    finally:
        if weights_from is not None:
            remove_tree(weights_from)  # the staged shards: its consolidated files moved in
    if last_published is not None:
        publisher.remember(staged, final_dir.name, manifest, last_published)
    elif staged is not None:
        staged.remove()
    return manifest


