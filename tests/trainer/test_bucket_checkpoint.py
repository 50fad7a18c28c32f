"""A checkpoint published to a bucket and read back on another node, on real servers.

In a bucket there is no directory rename: each file is an object and the
manifest, written last, publishes the checkpoint (coordinator/trees.py,
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
from trainer.checkpoint import MANIFEST_NAME, copy_to_local_cache, seal_directory, tmp_sibling


@contextlib.contextmanager
def node(bucket: Bucket, root: Path) -> Iterator[Path]:
    """`root` stands for the bucket in this process, as a daemon's local root does."""
    root.mkdir(parents=True)
    routing.mount(root, bucket.store, label=bucket.url)
    try:
        yield root
    finally:
        routing.unmount(root)


def test_a_checkpoint_in_a_bucket_is_published_by_its_manifest_and_verified_on_copy(
        server: Server, tmp_path: Path, tiny_model: Path) -> None:
    bucket = server.bucket("ckpt")
    with node(bucket, tmp_path / "writer") as writer:
        final = writer / "checkpoints/iter-000000"
        tmp = tmp_sibling(final)
        for src in tiny_model.iterdir():
            if src.name != MANIFEST_NAME and src.is_file():
                (tmp / src.name).write_bytes(src.read_bytes())
        # An interrupted earlier publish left objects but no manifest: cleared.
        bucket.put("checkpoints/iter-000000/stale.bin", b"half")
        manifest = seal_directory(tmp, final, iteration=0)
        assert not tmp.exists()
    names = bucket.store.list_files("checkpoints/iter-000000")
    assert MANIFEST_NAME in names and "stale.bin" not in names
    assert set(names) == {MANIFEST_NAME, *manifest.files}
    with node(bucket, tmp_path / "reader") as reader:
        cached = copy_to_local_cache(reader / "checkpoints/iter-000000", tmp_path / "cache")
        ours = load_file(cached / "model.safetensors")
        theirs = load_file(tiny_model / "model.safetensors")
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[k], theirs[k]) for k in ours)
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
