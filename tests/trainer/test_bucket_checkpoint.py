"""A checkpoint published to a bucket and read back on another node, on real servers.

In a bucket there is no directory rename: each file is an object and the
manifest, written last, publishes the checkpoint (coordinator/storage/trees.py,
publish_tree).  Two node-local roots stand for two nodes in this process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from coordinator import routing
from rollout.errors import CheckpointError
from tests.support.buckets import Bucket, Server
from trainer.checkpoint import MANIFEST_NAME, Manifest, seal_directory, tmp_sibling
from trainer.local_copy import copy_to_local_cache


@contextlib.contextmanager
def node(bucket: Bucket, root: Path) -> Iterator[Path]:
    """`root` stands for the bucket in this process, as a daemon's local root does."""
    root.mkdir(parents=True)
    routing.mount(root, bucket.store, label=bucket.url)
    try:
        yield root
    finally:
        routing.unmount(root)


def publish_files(model: Path, final: Path, *, iteration: int) -> Manifest:
    """`model`'s files published as checkpoint `final` (a bucket path), by its manifest."""
    tmp = tmp_sibling(final)
    for src in model.iterdir():
        if src.name != MANIFEST_NAME and src.is_file():
            (tmp / src.name).write_bytes(src.read_bytes())
    manifest = seal_directory(tmp, final, iteration=iteration)
    assert not tmp.exists()
    return manifest


def test_a_checkpoint_in_a_bucket_is_published_by_its_manifest_and_verified_on_copy(
        server: Server, tmp_path: Path, tiny_model: Path) -> None:
    bucket = server.bucket("ckpt")
    with node(bucket, tmp_path / "writer") as writer:
        final = writer / "checkpoints/iter-000000"
        # An interrupted earlier publish left objects but no manifest: cleared.
        bucket.put("checkpoints/iter-000000/stale.bin", b"half")
        manifest = publish_files(tiny_model, final, iteration=0)
    names = bucket.store.list_files("checkpoints/iter-000000")
    assert MANIFEST_NAME in names and "stale.bin" not in names
    assert set(names) == {MANIFEST_NAME, *manifest.files}
    with node(bucket, tmp_path / "reader") as reader:
        cached = copy_to_local_cache(reader / "checkpoints/iter-000000", tmp_path / "cache")
        ours = load_file(cached / "model.safetensors")
        theirs = load_file(tiny_model / "model.safetensors")
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[k], theirs[k]) for k in ours)
        # The node's copy is the one local copy: what was fetched to make it is gone
        # (model-sized, every iteration), no file left in the bucket's local root.
        assert [p for p in reader.rglob("*") if p.is_file()] == []
        # Publishing the same content again is a no-op; other content is refused.
        again = tmp_sibling(reader / "checkpoints/iter-000000")
        (again / "model.safetensors").write_bytes(b"other weights")
        with pytest.raises(CheckpointError, match="already holds a different checkpoint"):
            seal_directory(again, reader / "checkpoints/iter-000000", iteration=0)
        # An object replaced after publishing is caught by its hash, named by URL.
        bucket.put("checkpoints/iter-000000/model.safetensors", b"replaced")
        with pytest.raises(CheckpointError) as caught:
            copy_to_local_cache(reader / "checkpoints/iter-000000", tmp_path / "cache2")
        assert f"{bucket.url}/checkpoints/iter-000000/model.safetensors" in str(caught.value)


def test_coordinator_export_takes_the_runs_bucket_url_and_verifies_what_it_fetches(
        azurite: Server, tmp_path: Path, tiny_model: Path) -> None:
    """`coordinator export --run-dir az://...` (rl/export.py): the checkpoint's objects
    fetched straight into the export, each checked against the manifest; an object
    replaced after publishing is named by its URL and nothing reaches --out."""
    import subprocess

    from tests.integration.usage import coordinator

    bucket = azurite.bucket("export")
    with node(bucket, tmp_path / "writer") as writer:
        manifest = publish_files(tiny_model, writer / "checkpoints/iter-000002", iteration=2)
    env = bucket.node_env(tmp_path, "exporter")

    def export(out: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([coordinator(), "export", "--run-dir", bucket.url, "--out",
                               str(out)], env=env, capture_output=True, text=True,
                              timeout=120)  # seconds: imports and a 1.4 MB checkpoint

    done = export(tmp_path / "out")
    assert done.returncode == 0, done.stderr
    assert f"exported {bucket.url}/checkpoints/iter-000002 (the newest published" in done.stdout
    assert {p.name for p in (tmp_path / "out").iterdir()} == set(manifest.files)
    for name in manifest.files:
        assert (tmp_path / "out" / name).read_bytes() == (tiny_model / name).read_bytes()
    # Fetched into the export only, not kept in the node's local root of the bucket too.
    assert not list((tmp_path / "node-exporter").rglob("model.safetensors"))
    bucket.put("checkpoints/iter-000002/model.safetensors", b"replaced")
    refused = export(tmp_path / "out2")
    assert refused.returncode == 7, refused.stderr
    assert f"{bucket.url}/checkpoints/iter-000002/model.safetensors" in refused.stderr
    assert not (tmp_path / "out2").exists()



def test_a_trainers_fetched_files_are_sealed_for_this_boot_and_fetched_again_after_it(
        server: Server, tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """local_view's files in the node-local root (what trainers load) follow the node's
    cache: sealed for the boot that fetched them (not fsynced), fetched again after."""
    import os
    import uuid

    from coordinator.storage import local_seal
    from trainer.local_view import local_view

    first, second = str(uuid.uuid4()), str(uuid.uuid4())
    monkeypatch.setattr(local_seal, "boot_id", lambda: first)
    bucket = server.bucket("view")
    with node(bucket, tmp_path / "writer") as writer:
        publish_files(tiny_model, writer / "checkpoints/iter-000000", iteration=0)
    with node(bucket, tmp_path / "reader") as reader:
        view = local_view(reader / "checkpoints/iter-000000")
        weights = view / "model.safetensors"
        assert local_seal.sealed(view) and weights.read_bytes() == (
            tiny_model / "model.safetensors").read_bytes()
        os.utime(weights, (0, 0))
        assert local_view(view) == view and weights.stat().st_mtime == 0  # not fetched again
        monkeypatch.setattr(local_seal, "boot_id", lambda: second)  # a restart
        assert local_view(view) == view and weights.stat().st_mtime > 0  # fetched again
        assert local_seal.sealed(view)
