"""Publishing, verifying, caching and choosing checkpoints on a real filesystem."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest

import rollout.errors
from coordinator.errors import MalformedRecordError
from trainer.checkpoint import (
    MANIFEST_NAME,
    CheckpointError,
    FileEntry,
    Manifest,
    publish_checkpoint,
    read_manifest,
    verify_checkpoint,
)
from trainer.local_copy import copy_to_local_cache

# Damaged files are reported after the read deadline: 1 s here (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("quick_read_retry")


class FakeModel:
    """Implements the save_pretrained interface publish_checkpoint uses."""

    def __init__(
        self,
        weights: bytes = b"\x00" * 64,
        *,
        pause: threading.Event | None = None,
        resume: threading.Event | None = None,
        fail: bool = False,
    ) -> None:
        self.weights, self.pause, self.resume, self.fail = weights, pause, resume, fail
        self.written_to: Path | None = None

    def save_pretrained(self, directory: Path, state_dict: dict[str, Any] | None = None) -> None:
        self.written_to = Path(directory)
        (self.written_to / "config.json").write_text('{"model_type": "llama"}\n')
        if self.pause is not None and self.resume is not None:
            self.pause.set()
            assert self.resume.wait(10)
        if self.fail:
            raise OSError(28, "No space left on device")
        (self.written_to / "model.safetensors").write_bytes(self.weights)


class FakeTokenizer:
    def save_pretrained(self, directory: Path) -> None:
        (Path(directory) / "tokenizer.json").write_text('{"model": {}}\n')


def publish(final: Path, iteration: int = 1, weights: bytes = b"\x00" * 64) -> None:
    publish_checkpoint(FakeModel(weights), FakeTokenizer(), final, iteration=iteration)


def test_published_checkpoint_lists_every_file_with_hash_and_size(tmp_path: Path) -> None:
    final = tmp_path / "ckpt" / "iter-000001"
    publish(final, iteration=1)
    manifest = verify_checkpoint(final)
    assert manifest.iteration == 1
    assert {name: f.size for name, f in manifest.files.items()} == {
        "config.json": 24,
        "model.safetensors": 64,
        "tokenizer.json": 14,
    }
    assert all(oct(p.stat().st_mode & 0o777) == "0o644" for p in final.iterdir())
    assert [p.name for p in final.parent.iterdir()] == ["iter-000001"]  # no temp left over


def test_a_file_altered_after_publishing_is_refused_naming_it(tmp_path: Path) -> None:
    final = tmp_path / "iter-1"
    publish(final)
    weights = final / "model.safetensors"
    weights.write_bytes(b"\x01" + weights.read_bytes()[1:])  # same size, one flipped byte
    with pytest.raises(CheckpointError, match=r"model\.safetensors: SHA-256 \S+ differs from its manifest") as err:
        verify_checkpoint(final)
    assert err.value.path == weights


def test_truncated_missing_and_extra_files_are_each_named(tmp_path: Path) -> None:
    final = tmp_path / "iter-1"
    publish(final)
    (final / "tokenizer.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: is 2 bytes, its manifest says"):
        verify_checkpoint(final)
    (final / "tokenizer.json").unlink()
    with pytest.raises(
        CheckpointError, match=r"tokenizer\.json: file listed in the manifest is missing"
    ):
        verify_checkpoint(final)
    publish(tmp_path / "iter-2")
    (tmp_path / "iter-2" / "stray.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"stray\.bin: extra file"):
        verify_checkpoint(tmp_path / "iter-2")


def test_manifest_naming_a_path_outside_the_checkpoint_is_malformed(tmp_path: Path) -> None:
    final = tmp_path / "iter-1"
    publish(final)
    data = json.loads((final / MANIFEST_NAME).read_text())
    data["files"]["../escape"] = {"sha256": "0" * 64, "size": 1}
    (final / MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"'\.\./escape' is not a plain relative path"):
        verify_checkpoint(final)


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (
            lambda data: data["files"].update({"../x": {"sha256": "0" * 64, "size": 1}}),
            r"file name '\.\./x' is not a plain relative path",
        ),
        (
            lambda data: data["files"]["config.json"].update(size="24"),
            r"field 'size' must be an integer, got '24'",
        ),
    ],
    ids=["climbing-name", "wrong-type"],
)
def test_a_malformed_manifest_is_refused_naming_its_path(
    tmp_path: Path, change: Any, problem: str
) -> None:
    final = tmp_path / "iter-1"
    publish(final)
    path = final / MANIFEST_NAME
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=problem) as err:
        read_manifest(final)
    assert err.value.path == path
    assert str(err.value).startswith(f"{path}: ")
    assert isinstance(err.value.__cause__, MalformedRecordError)


@pytest.mark.parametrize(
    ("files", "problem"),
    [
        ({}, "files is empty"),
        ({"/etc/passwd": {"sha256": "0" * 64, "size": 1}}, "is not a plain relative path"),
        ({"a\\b": {"sha256": "0" * 64, "size": 1}}, "is not a plain relative path"),
        ({"a/../../b": {"sha256": "0" * 64, "size": 1}}, "is not a plain relative path"),
        ({MANIFEST_NAME: {"sha256": "0" * 64, "size": 1}}, "is not a plain relative path"),
        ({"": {"sha256": "0" * 64, "size": 1}}, "is not a plain relative path"),
        ({"w.bin": {"sha256": "0" * 63, "size": 1}}, "is not 64 lowercase hex digits"),
        ({"w.bin": {"sha256": "A" * 64, "size": 1}}, "is not 64 lowercase hex digits"),
        ({"w.bin": {"sha256": "0" * 64, "size": -1}}, r"size -1 is not an integer >= 0"),
        ({"w.bin": {"sha256": "0" * 64, "size": True}}, "field 'size' must be an integer"),
        ({"w.bin": {"sha256": "0" * 64}}, "field 'size' is missing"),
        ({"w.bin": ["0" * 64, 1]}, "field 'files' must be an object"),
    ],
)
def test_every_manifest_rule_is_enforced_on_parse(files: Any, problem: str) -> None:
    body = {"schema": "coordinator/checkpoint-manifest", "version": 1, "iteration": 0,
            "probes": None}
    where = Path("/run/checkpoints/iter-000000/manifest.json")
    with pytest.raises(MalformedRecordError, match=problem) as err:
        Manifest.from_bytes(json.dumps({**body, "files": files}).encode(), where)
    assert err.value.path == where
    for wrong in ({**body, "iteration": -1}, {**body, "version": 2}, {**body, "schema": "x"}):
        with pytest.raises(MalformedRecordError):
            Manifest.from_bytes(json.dumps({**wrong, "files": {"w.bin": {
                "sha256": "0" * 64, "size": 1}}}).encode(), where)


def test_the_manifest_keeps_its_on_disk_shape_and_a_stable_digest(tmp_path: Path) -> None:
    final = tmp_path / "iter-4"
    publish(final, iteration=4)
    raw = (final / MANIFEST_NAME).read_bytes()
    data = json.loads(raw)
    assert list(data) == ["files", "iteration", "probes", "schema", "version"]  # sorted keys
    assert data["probes"] is None  # only training writes probes
    assert (data["schema"], data["version"], data["iteration"]) == (
        "coordinator/checkpoint-manifest", 1, 4)
    assert sorted(data["files"]) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert all(set(entry) == {"sha256", "size"} for entry in data["files"].values())
    assert raw == (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()
    manifest = read_manifest(final)
    assert manifest.to_bytes() == raw
    assert manifest.digest == hashlib.sha256(raw).hexdigest()[:16]
    # Equal manifests, equal digests, whatever order the files were listed in.
    reordered = Manifest(iteration=4, files=dict(reversed(list(manifest.files.items()))))
    assert reordered == manifest and reordered.digest == manifest.digest
    changed = dict(manifest.files, **{"config.json": FileEntry(sha256="0" * 64, size=24)})
    assert Manifest(iteration=4, files=changed).digest != manifest.digest
    assert Manifest(iteration=5, files=manifest.files).digest != manifest.digest


def test_a_torn_manifest_is_read_again_and_a_missing_one_is_a_checkpoint_error(
    tmp_path: Path,
) -> None:
    assert CheckpointError is rollout.errors.CheckpointError  # one class for the whole project
    final = tmp_path / "iter-1"
    publish(final)
    path = final / MANIFEST_NAME
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 2])  # what a reader with a stale cached size sees

    def repair() -> None:
        (final / "fixed").write_bytes(whole)
        os.replace(final / "fixed", path)

    timer = threading.Timer(0.3, repair)
    timer.start()
    try:
        assert read_manifest(final) == verify_checkpoint(final)
    finally:
        timer.join()
    missing = tmp_path / "never-published"
    missing.mkdir()
    with pytest.raises(CheckpointError, match=r"manifest\.json is missing") as err:
        read_manifest(missing)
    assert err.value.path == missing / MANIFEST_NAME


def test_the_final_name_never_shows_a_partial_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    node = tmp_path / "node-disk"
    node.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(node))  # the trainer's TMPDIR
    shared = tmp_path / "shared"
    shared.mkdir()
    final = shared / "iter-000003"
    pause, resume = threading.Event(), threading.Event()
    model = FakeModel(pause=pause, resume=resume)
    worker = threading.Thread(
        target=publish_checkpoint, args=(model, FakeTokenizer(), final), kwargs={"iteration": 3}
    )
    worker.start()
    try:
        assert pause.wait(10)
        # Half written: the files go to a private directory on the node's disk (then
        # copied, hashed, into a hidden sibling on the share); the final name is
        # absent and a reader of the final name sees nothing.
        assert model.written_to is not None and model.written_to.parent == node
        assert oct(model.written_to.stat().st_mode & 0o777) == "0o700"
        assert not final.exists()
        assert [p for p in shared.iterdir() if not p.name.startswith(".")] == []
        with pytest.raises(CheckpointError, match="does not exist"):
            verify_checkpoint(final)
    finally:
        resume.set()
        worker.join(10)
    assert verify_checkpoint(final).iteration == 3
    assert [p.name for p in shared.iterdir()] == [final.name]
    assert list(node.iterdir()) == []  # the staging directory went


def test_the_publisher_hashes_as_it_copies_to_the_share_and_never_reads_it_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each file is written once on the node's disk, then copied to the share and
    hashed in the same pass: nothing on the share is read back (file_digest, the
    read-back, would raise)."""
    import trainer.checkpoint

    def read_back(path: Path) -> None:
        raise AssertionError(f"{path} was read back")

    monkeypatch.setattr(trainer.checkpoint, "file_digest", read_back)
    weights = os.urandom(9 << 20)  # more than two of the copy's blocks
    final = tmp_path / "iter-1"
    publish(final, weights=weights)
    manifest = verify_checkpoint(final)
    assert manifest.files["model.safetensors"] == FileEntry(
        sha256=hashlib.sha256(weights).hexdigest(), size=len(weights))


def test_without_room_on_the_nodes_disk_the_checkpoint_is_written_to_the_share_directly(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    class FullLocalDisk(FakeModel):
        def save_pretrained(self, directory: Path,
                            state_dict: dict[str, Any] | None = None) -> None:
            if Path(directory).name.startswith("publish-"):
                raise OSError(28, "No space left on device")
            super().save_pretrained(directory, state_dict)

    final = tmp_path / "shared" / "iter-1"
    publish_checkpoint(FullLocalDisk(), FakeTokenizer(), final, iteration=1)
    assert verify_checkpoint(final).files.keys() == {"config.json", "model.safetensors",
                                                     "tokenizer.json"}
    assert "no room to stage the checkpoint" in caplog.text


def test_a_failed_write_leaves_neither_final_nor_temporary_dir(tmp_path: Path) -> None:
    with pytest.raises(OSError, match="No space left"):
        publish_checkpoint(FakeModel(fail=True), FakeTokenizer(), tmp_path / "iter-1", iteration=1)
    assert list(tmp_path.iterdir()) == []


def test_republishing_identical_content_is_a_no_op_and_different_content_is_refused(
    tmp_path: Path,
) -> None:
    final = tmp_path / "iter-1"
    publish(final, weights=b"a" * 8)
    before = (final / MANIFEST_NAME).stat().st_ino
    publish(final, weights=b"a" * 8)
    assert (final / MANIFEST_NAME).stat().st_ino == before
    with pytest.raises(CheckpointError, match="already holds a different checkpoint"):
        publish(final, weights=b"b" * 8)
    assert (final / "model.safetensors").read_bytes() == b"a" * 8
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter-1"]


def test_local_cache_copy_is_verified_and_reused(tmp_path: Path) -> None:
    src = tmp_path / "shared" / "iter-000002"
    publish(src, iteration=2)
    cache = tmp_path / "cache"
    copy = copy_to_local_cache(src, cache)
    assert copy.parent == cache and copy != src
    assert verify_checkpoint(copy) == verify_checkpoint(src)
    inode = (copy / "model.safetensors").stat().st_ino
    assert copy_to_local_cache(src, cache) == copy
    assert (copy / "model.safetensors").stat().st_ino == inode  # reused, not copied again


def test_a_node_reads_each_file_from_the_share_once_and_reuses_its_copy_unhashed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy is the check (names against the manifest, then each file hashed as it
    is copied: no separate verification read); a sealed cached copy is trusted by its
    manifest and sizes, not hashed again."""
    import coordinator.storage.verified
    import trainer.checkpoint
    import trainer.local_copy

    src = tmp_path / "shared" / "iter-000002"
    publish(src, iteration=2, weights=os.urandom(9 << 20))
    opened: list[str] = []
    real_open = coordinator.storage.verified.fsio.open_regular

    def counting_open(path: Path, *args: Any, **kwargs: Any) -> int:
        opened.append(Path(path).name)
        return real_open(path, *args, **kwargs)

    def no_hash(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("hashed again")

    monkeypatch.setattr(coordinator.storage.verified.fsio, "open_regular", counting_open)
    monkeypatch.setattr(trainer.local_copy, "read_verified", no_hash)
    copy = copy_to_local_cache(src, tmp_path / "cache")
    assert sorted(n for n in opened if n != MANIFEST_NAME) == [
        "config.json", "model.safetensors", "tokenizer.json"]  # each file read once
    monkeypatch.setattr(trainer.local_copy, "copy_verified", no_hash)
    monkeypatch.setattr(trainer.checkpoint, "file_digest", no_hash)
    assert copy_to_local_cache(src, tmp_path / "cache") == copy


def test_a_bit_flipped_in_the_shared_copy_is_caught_as_it_is_copied(tmp_path: Path) -> None:
    src = tmp_path / "iter-1"
    publish(src, weights=bytes(range(256)) * 1024)
    data = bytearray((src / "model.safetensors").read_bytes())
    data[1000] ^= 1  # same size: only the hash sees it
    os.chmod(src / "model.safetensors", 0o644)
    (src / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*SHA-256 .* differs|"
                                              r"model\.safetensors.*altered"):
        copy_to_local_cache(src, tmp_path / "cache")
    assert not any(p.name.startswith("iter-1") for p in (tmp_path / "cache").iterdir())


def test_a_cache_copy_cut_short_is_copied_again(tmp_path: Path) -> None:
    src = tmp_path / "iter-1"
    publish(src)
    copy = copy_to_local_cache(src, tmp_path / "cache")
    (copy / MANIFEST_NAME).unlink()  # a copy whose seal never came
    assert copy_to_local_cache(src, tmp_path / "cache") == copy
    assert verify_checkpoint(copy) == verify_checkpoint(src)


def test_a_damaged_cache_copy_is_replaced(tmp_path: Path) -> None:
    src = tmp_path / "iter-1"
    publish(src)
    copy = copy_to_local_cache(src, tmp_path / "cache")
    (copy / "model.safetensors").write_bytes(b"garbage")
    again = copy_to_local_cache(src, tmp_path / "cache")
    assert again == copy
    verify_checkpoint(again)


def test_a_corrupt_source_is_not_cached(tmp_path: Path) -> None:
    src = tmp_path / "iter-1"
    publish(src)
    (src / "config.json").write_text('{"model_type": "gpt2"}\n')
    with pytest.raises(CheckpointError, match=r"config\.json"):
        copy_to_local_cache(src, tmp_path / "cache")
    cache = tmp_path / "cache"
    assert not cache.exists() or not any(p.name.startswith("iter-1") for p in cache.iterdir())


def test_a_real_model_round_trips_through_publish_and_verify(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from trainer.tiny_model import create_tiny_model

    src = create_tiny_model(tmp_path / "tiny", seed=0)
    model = AutoModelForCausalLM.from_pretrained(src, local_files_only=True)
    final = tmp_path / "iter-000007"
    manifest = publish_checkpoint(model, None, final, iteration=7, carry_files_from=src)
    assert read_manifest(final) == manifest == verify_checkpoint(final)
    # Non-weight files are carried over byte for byte; the weights are the model's.
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (final / name).read_bytes() == (src / name).read_bytes()
    reloaded = AutoModelForCausalLM.from_pretrained(final, local_files_only=True)
    for (name, a), (_, b) in zip(
        model.state_dict().items(), reloaded.state_dict().items(), strict=True
    ):
        assert bool((a == b).all()), name
