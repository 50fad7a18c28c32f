"""Delta checkpoints: published as what changed, made whole on each node, byte for byte."""

from __future__ import annotations

import dataclasses
import errno
import functools
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from coordinator.storage.local_seal import SEAL_NAME
from rollout.errors import CheckpointError
from trainer import delta
from trainer.checkpoint import publish_checkpoint, read_manifest, verify_checkpoint
from trainer.local_copy import copy_to_local_cache
from trainer.manifest import MANIFEST_NAME, FileEntry, Manifest, ResultEntry

# Damaged files are reported after the read deadline: 1 s here (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("quick_read_retry")
ROOT = Path(__file__).resolve().parents[2]


class Weights:
    """Implements the save_pretrained interface publish_checkpoint uses: bf16 tensors
    written by safetensors, as transformers writes them."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors)

    def save_pretrained(self, directory: Path, state_dict: dict[str, Any] | None = None) -> None:
        (Path(directory) / "config.json").write_text('{"model_type": "qwen2"}\n')
        if state_dict != {}:  # as transformers: save_pretrained of no tensors writes none
            save_file(self.tensors, str(Path(directory) / "model.safetensors"),
                      metadata={"format": "pt"})


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(512, 64, generator=g).to(torch.bfloat16),
            "layer.weight": torch.randn(64, 64, generator=g).to(torch.bfloat16),
            "layer.bias": torch.randn(64, generator=g).to(torch.bfloat16)}


def step(tensors: dict[str, torch.Tensor], fraction: float, seed: int) -> dict[str, torch.Tensor]:
    """`fraction` of every tensor's elements changed (an RL step at a small rate)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in tensors.items():
        flat = t.flatten().clone()
        pick = torch.rand(flat.numel(), generator=g) < fraction
        flat[pick] = (flat[pick].float() * 1.5 + 0.01).to(torch.bfloat16)
        out[name] = flat.reshape(t.shape)
    return out


def publish(share: Path, iteration: int, tensors: dict[str, torch.Tensor], last: Path,
            parent: int | None = None) -> Any:
    return publish_checkpoint(
        Weights(tensors), None, share / f"iter-{iteration:06d}", iteration=iteration,
        last_published=last,
        delta_parent=None if parent is None else share / f"iter-{parent:06d}")


def full_bytes(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> bytes:
    out = tmp_path / "reference"
    out.mkdir(exist_ok=True)
    Weights(tensors).save_pretrained(out)
    return (out / "model.safetensors").read_bytes()


def test_a_delta_moves_a_fraction_of_the_weights_and_each_node_makes_the_trainers_file(
        tmp_path: Path) -> None:
    share, last = tmp_path / "share", tmp_path / "trainer-disk" / "last-published"
    w0 = weights()
    w1 = step(w0, 0.02, seed=1)
    w2 = step(w1, 0.02, seed=2)
    full = publish(share, 0, w0, last)
    assert full.delta is None
    m1 = publish(share, 1, w1, last, parent=0)
    m2 = publish(share, 2, w2, last, parent=1)
    assert m1.delta is not None and m2.delta is not None
    assert (m1.delta.parent, m1.delta.base, m1.delta.length) == ("iter-000000", "iter-000000", 1)
    assert (m2.delta.parent, m2.delta.base, m2.delta.length) == ("iter-000001", "iter-000000", 2)
    assert m2.delta.parent_digest == m1.digest
    assert "model.safetensors" not in m2.files and "delta/model.safetensors" in m2.files
    ratio = m2.files["delta/model.safetensors"].size / full.files["model.safetensors"].size
    assert ratio < 0.10, ratio  # 2 % changed: 6 bytes each against 2 per element
    verify_checkpoint(share / "iter-000002")  # the share's files match the manifest
    # A node with nothing cached makes the chain: base, then each link.
    copy = copy_to_local_cache(share / "iter-000002", tmp_path / "node-a")
    assert (copy / "model.safetensors").read_bytes() == full_bytes(tmp_path, w2)
    assert (copy / MANIFEST_NAME).read_bytes() == m2.to_bytes()
    assert sorted(p.name for p in copy.iterdir()) == [SEAL_NAME, "config.json", MANIFEST_NAME,
                                                      "model.safetensors"]
    # A node holding the parent applies one link; a second call reuses the sealed copy.
    node_b = tmp_path / "node-b"
    parent = copy_to_local_cache(share / "iter-000001", node_b)
    again = copy_to_local_cache(share / "iter-000002", node_b)
    assert (again / "model.safetensors").read_bytes() == full_bytes(tmp_path, w2)
    # The link went into a clone of the parent's file: the parent's copy is as it was.
    assert (parent / "model.safetensors").read_bytes() == full_bytes(tmp_path, w1)
    assert copy_to_local_cache(share / "iter-000001", node_b) == parent
    inode = (again / "model.safetensors").stat().st_ino
    assert copy_to_local_cache(share / "iter-000002", node_b) == again
    assert (again / "model.safetensors").stat().st_ino == inode


def one_link(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor], Any]:
    """A full checkpoint and one delta of it on `tmp_path`'s share: the share, the
    delta's weights and its manifest."""
    share, last = tmp_path / "share", tmp_path / "last"
    w0 = weights()
    w1 = step(w0, 0.02, 1)
    publish(share, 0, w0, last)
    m1 = publish(share, 1, w1, last, parent=0)
    assert m1.delta is not None
    return share, w1, m1


def test_a_result_is_listed_by_its_size_and_header_and_a_manifest_listing_its_whole_file_reads(
        tmp_path: Path) -> None:
    """A delta's result carries its size and its header's SHA-256, with every tensor's
    checksum: no whole-file hash (one stream on one core at every publication).  A
    manifest written before lists the whole file's SHA-256: it still reads, to the
    same bytes (its digest, a child's parent_digest, is unchanged), and makes the same
    copy."""
    share, w1, m1 = one_link(tmp_path)
    whole = full_bytes(tmp_path, w1)
    head, _ = delta.header(whole, tmp_path)
    assert m1.delta.results == {"model.safetensors": ResultEntry(
        header_sha256=hashlib.sha256(head).hexdigest(), size=len(whole))}
    body = json.loads(m1.to_bytes())
    assert body["delta"]["results"] == {"model.safetensors": {
        "header_sha256": hashlib.sha256(head).hexdigest(), "size": len(whole)}}
    # As a manifest written before the header's hash listed it.
    body["delta"]["results"] = {"model.safetensors": {
        "sha256": hashlib.sha256(whole).hexdigest(), "size": len(whole)}}
    before = (json.dumps(body, indent=2, sort_keys=True) + "\n").encode()
    old = Manifest.from_bytes(before, tmp_path)
    assert old.delta is not None and old.to_bytes() == before
    assert old.delta.results["model.safetensors"] == FileEntry(
        sha256=hashlib.sha256(whole).hexdigest(), size=len(whole))
    (share / "iter-000001" / MANIFEST_NAME).write_bytes(before)
    copy = copy_to_local_cache(share / "iter-000001", tmp_path / "node")
    assert (copy / "model.safetensors").read_bytes() == whole


def test_a_parent_with_the_same_tensors_under_another_header_is_caught_by_the_header_checksum(
        tmp_path: Path) -> None:
    """The tensors' checksums cannot see a header that differs (other metadata, the
    same tensors): the result's header SHA-256 does, at a node and at export."""
    _, w1, m1 = one_link(tmp_path)
    entry = m1.delta.results["model.safetensors"]
    assert isinstance(entry, ResultEntry)
    other = tmp_path / "other.safetensors"
    save_file(w1, str(other), metadata={"format": "pt", "note": "another writer"})
    none = tmp_path / "none.safetensors"
    delta.write(delta.Encoded(tensors={}, digests={}, size=0, header_sha256="", changed=0,
                              elements=0), none, result="model.safetensors")
    parent = bytearray(other.read_bytes())
    delta.apply(parent, none.read_bytes(), result="model.safetensors", where=none,
                digests=m1.delta.tensors)  # the tensors alone: every one matches
    with pytest.raises(CheckpointError, match=r"the header of model\.safetensors has SHA-256 "
                                              r".*its manifest says"):
        delta.apply(parent, none.read_bytes(), result="model.safetensors", where=none,
                    digests=m1.delta.tensors, header_sha256=entry.header_sha256)
    good = tmp_path / "good.safetensors"
    good.write_bytes(full_bytes(tmp_path, w1))
    check = functools.partial(delta.verify_result, header_sha256=entry.header_sha256,
                              digests=m1.delta.tensors, result="model.safetensors")
    check(good, size=entry.size)
    with pytest.raises(CheckpointError, match=r"the header of model\.safetensors has SHA-256"):
        check(other, size=other.stat().st_size)
    with pytest.raises(CheckpointError, match=r"bytes, the manifest's model\.safetensors has"):
        check(other, size=entry.size)
    damaged = bytearray(good.read_bytes())
    damaged[-1] ^= 1  # the last tensor's last byte
    good.write_bytes(damaged)
    with pytest.raises(CheckpointError, match=r"tensor \S+ of model\.safetensors has blake3 .*: "
                                              "not the file the delta makes"):
        check(good, size=entry.size)


def test_without_the_parents_files_kept_the_trainer_publishes_full(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="trainer.publisher")
    share, last = tmp_path / "share", tmp_path / "last"
    w0 = weights()
    publish(share, 0, w0, last)
    # A restarted trainer (its kept files gone) publishes iteration 1 whole.
    import shutil

    shutil.rmtree(last)
    m1 = publish(share, 1, step(w0, 0.02, 1), last, parent=0)
    assert m1.delta is None and "model.safetensors" in m1.files
    assert "published full, not as a delta of iter-000000: this process has published " \
        "nothing it kept" in caplog.text
    # The files kept are another checkpoint's (iteration 2's): iteration 3 of parent 1
    # (as after a recover that went back) is published whole.
    m2 = publish(share, 2, step(w0, 0.02, 2), last, parent=1)
    m3 = publish(share, 3, step(w0, 0.02, 3), last, parent=1)
    assert m2.delta is not None and m3.delta is None
    assert "the files kept are iter-000002's" in caplog.text


def test_an_altered_delta_is_refused_naming_the_file_and_nothing_is_cached(
        tmp_path: Path) -> None:
    share, last = tmp_path / "share", tmp_path / "last"
    w0 = weights()
    publish(share, 0, w0, last)
    publish(share, 1, step(w0, 0.02, 1), last, parent=0)
    parent = copy_to_local_cache(share / "iter-000000", tmp_path / "node")
    inode = (parent / "model.safetensors").stat().st_ino
    path = share / "iter-000001" / "delta" / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40  # a bit of a changed value
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"delta/model\.safetensors.*(SHA-256|altered)"):
        copy_to_local_cache(share / "iter-000001", tmp_path / "node")
    assert [p.name for p in (tmp_path / "node").iterdir() if p.name.startswith("iter-000001")] \
        == []
    # The parent's copy, which the failed link was applied to a clone of, is untouched.
    assert copy_to_local_cache(share / "iter-000000", tmp_path / "node") == parent
    assert (parent / "model.safetensors").stat().st_ino == inode
    assert (parent / "model.safetensors").read_bytes() == full_bytes(tmp_path, w0)


def refusing(code: int, calls: list[str]) -> Any:
    """A system call that fails with errno `code`, counting its calls."""
    def refused(*args: Any, **kwargs: Any) -> Any:
        calls.append(os.strerror(code))
        raise OSError(code, os.strerror(code))
    return refused


@pytest.mark.parametrize("refused", ["copy_file_range", "mmap"])
def test_where_the_kernel_refuses_a_fast_path_the_link_makes_the_same_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refused: str) -> None:
    """copy_file_range refused (another filesystem, an old kernel: the parent is copied
    through the process), or a writable shared map (some FUSE mounts: the link is put
    in in memory and the clone written whole): the trainer's file, byte for byte."""
    from trainer import local_copy

    share, last = tmp_path / "share", tmp_path / "last"
    w0 = weights()
    w1 = step(w0, 0.02, 1)
    publish(share, 0, w0, last)
    publish(share, 1, w1, last, parent=0)
    copy_to_local_cache(share / "iter-000000", tmp_path / "node")
    calls: list[str] = []
    if refused == "copy_file_range":
        monkeypatch.setattr(os, "copy_file_range", refusing(errno.EXDEV, calls))
    else:
        monkeypatch.setattr(local_copy.mmap, "mmap", refusing(errno.ENODEV, calls))
    copy = copy_to_local_cache(share / "iter-000001", tmp_path / "node")
    assert calls
    assert (copy / "model.safetensors").read_bytes() == full_bytes(tmp_path, w1)


@pytest.mark.parametrize("algorithm", ["blake3", "sha256"])
def test_a_delta_consistent_with_a_forged_manifest_is_caught_by_the_tensor_checksums(
        tmp_path: Path, algorithm: str) -> None:
    """Even with its manifest entry matching (a hostile or buggy publisher), the
    result's per-tensor checksum (BLAKE3, or SHA-256 in a manifest that names it)
    names the tensor the delta made wrong."""
    share, last = tmp_path / "share", tmp_path / "last"
    w0 = weights()
    publish(share, 0, w0, last)
    m1 = publish(share, 1, step(w0, 0.02, 1), last, parent=0)
    parent = bytearray((last / "model.safetensors").read_bytes())  # iteration 1's file
    assert m1.delta is not None and m1.delta.tensor_hash == delta.TENSOR_HASH == "blake3"
    digests = delta.tensor_digests(parent, delta.header(parent, last)[1], algorithm)
    assert (digests == m1.delta.tensors) == (algorithm == "blake3")
    # The true delta (none: this is the result already) passes; a forged one is named.
    delta.write(delta.Encoded(tensors={}, digests={}, size=0, header_sha256="", changed=0,
                              elements=0), tmp_path / "none.safetensors",
                result="model.safetensors")
    delta.apply(parent, (tmp_path / "none.safetensors").read_bytes(),
                result="model.safetensors", where=tmp_path, digests=digests,
                algorithm=algorithm)
    forged = delta.Encoded(tensors={"layer.bias::whole": torch.zeros(64, dtype=torch.int16)},
                           digests={}, size=0, header_sha256="", changed=0, elements=0)
    delta.write(forged, tmp_path / "forged.safetensors", result="model.safetensors")
    with pytest.raises(CheckpointError, match=r"tensor layer\.bias of model\.safetensors has "
                                              rf"{algorithm} .* after the delta"):
        delta.apply(parent, (tmp_path / "forged.safetensors").read_bytes(),
                    result="model.safetensors", where=tmp_path / "forged.safetensors",
                    digests=digests, algorithm=algorithm)


def test_a_broken_chain_is_named(tmp_path: Path) -> None:
    share, last = tmp_path / "share", tmp_path / "last"
    w0 = weights()
    publish(share, 0, w0, last)
    publish(share, 1, step(w0, 0.02, 1), last, parent=0)
    import shutil

    shutil.rmtree(share / "iter-000000")
    with pytest.raises(CheckpointError, match=r"iter-000001 is a delta of iter-000000, which "
                                              r"cannot be used .*base iter-000000 must stay"):
        copy_to_local_cache(share / "iter-000001", tmp_path / "node")
    publish(share, 0, step(w0, 0.5, 9), tmp_path / "elsewhere")  # published again, other
    with pytest.raises(CheckpointError, match=r"now has manifest .* the chain is broken"):
        copy_to_local_cache(share / "iter-000001", tmp_path / "node")


def test_most_elements_changed_go_whole_and_a_new_header_goes_as_a_file(tmp_path: Path) -> None:
    share, last = tmp_path / "share", tmp_path / "last"
    w0 = weights()
    publish(share, 0, w0, last)
    publish(share, 1, step(w0, 0.9, 1), last, parent=0)
    parts = delta.load_parts((share / "iter-000001" / "delta" / "model.safetensors").read_bytes())
    assert {k.rpartition("::")[2] for k in parts} == {"whole"}
    grown = {**w0, "extra.weight": torch.ones(4, dtype=torch.bfloat16)}
    m2 = publish(share, 2, grown, last, parent=1)
    assert m2.delta is None and "model.safetensors" in m2.files
    copy = copy_to_local_cache(share / "iter-000002", tmp_path / "node")
    assert (copy / "model.safetensors").read_bytes() == full_bytes(tmp_path, grown)


def kill_at(script: str, gate: Path, what: str) -> None:
    """`script` run in a new process, SIGKILLed once it writes `gate`."""
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 60  # a loaded 2-core machine: imports take seconds
        while not gate.exists():
            assert proc.poll() is None, f"{what}: exited before the gate"
            assert time.monotonic() < deadline, f"{what}: never reached the gate"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(30)


@pytest.mark.parametrize("advance", [False, True])
def test_a_node_killed_while_applying_a_delta_makes_it_again_at_the_next_use(
        tmp_path: Path, advance: bool) -> None:
    """SIGKILL in the middle of applying: the cache's name never shows a partial copy,
    and the next copy (another process) removes the leftover and makes it whole (in
    place, `advance`: from the base again, the parent's copy having been taken)."""
    share, last = tmp_path / "share", tmp_path / "last"
    big = {"w": torch.randn(4096, 1024).to(torch.bfloat16)}
    publish(share, 0, big, last)
    publish(share, 1, step(big, 0.02, 1), last, parent=0)
    node = tmp_path / "node"
    parent = copy_to_local_cache(share / "iter-000000", node)
    gate = tmp_path / "applying"
    script = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        sys.path.insert(0, {str(ROOT)!r})
        import trainer.delta
        real = trainer.delta.apply
        def slow(*args, **kwargs):
            real(*args, **kwargs)
            Path({str(gate)!r}).write_text("applied")
            time.sleep(60)  # killed here: the result made, not yet written or sealed
        trainer.delta.apply = slow
        from trainer.local_copy import copy_to_local_cache
        copy_to_local_cache(Path({str(share / 'iter-000001')!r}), Path({str(node)!r}),
                            advance={advance})
    """)
    kill_at(script, gate, "the copier applying the delta")
    leftovers = [p.name for p in node.iterdir() if p.name.startswith(".iter-000001")]
    assert leftovers and not [p for p in node.iterdir() if p.name.startswith("iter-000001")]
    assert [p for p in node.iterdir() if p.name.startswith("iter-000000")] == \
        ([] if advance else [parent])
    # The next copy of any checkpoint removes it: one copier at a time, so a
    # temporary it finds is a killed copier's.
    publish(share, 2, weights(seed=5), last)
    copy_to_local_cache(share / "iter-000002", node)
    assert not [p for p in node.iterdir() if ".tmp-" in p.name]
    copy = copy_to_local_cache(share / "iter-000001", node, advance=advance)
    assert (copy / "model.safetensors").read_bytes() == full_bytes(tmp_path, step(big, 0.02, 1))
    assert not [p for p in node.iterdir() if p.name.startswith(".iter-000001") and p.is_dir()]


def test_a_publisher_killed_mid_publication_leaves_its_staging_to_the_next_one(
        tmp_path: Path) -> None:
    """The staged checkpoint (a whole model at real sizes) of a publisher SIGKILLed
    before its upload is removed by the next publication on the node (its pid gone)."""
    import tempfile

    share, last = tmp_path / "share", tmp_path / "last"
    publish(share, 0, weights(), last)
    gate = tmp_path / "uploading"
    kill_at(textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        sys.path.insert(0, {str(ROOT)!r})
        import trainer.publisher
        def killed_here(*args, **kwargs):  # staged on this node's disk, not uploaded
            Path({str(gate)!r}).write_text("uploading")
            time.sleep(60)
        trainer.publisher.upload = killed_here
        from tests.trainer.test_delta import publish, step, weights
        publish(Path({str(share)!r}), 1, step(weights(), 0.02, 1), Path({str(last)!r}),
                parent=0)
    """), gate, "the publisher of iteration 1")
    node_tmp = Path(tempfile.gettempdir())  # the killed process's too (tests/trainer/conftest.py)
    staged = [p.name for p in node_tmp.iterdir() if p.name.startswith(("publish-", "delta-"))]
    assert staged, "the killed publisher staged nothing"
    assert publish(share, 1, step(weights(), 0.02, 1), last, parent=0).delta is None  # no parent
    assert not [p for p in node_tmp.iterdir() if p.name.startswith(("publish-", "delta-"))]


def test_a_file_with_bytes_outside_its_tensors_is_no_file_a_delta_applies_to(
        tmp_path: Path) -> None:
    """The node checks the result by its tensors' digests alone: that decides the whole
    file only when the tensors tile every byte after the header, as safetensors
    writes them.  A gap between two tensors, or bytes after the last, are refused."""
    import json
    import struct

    path = tmp_path / "model.safetensors"
    save_file(weights(), str(path))
    data = path.read_bytes()
    _, spans = delta.header(data, path)  # safetensors' own file: accepted
    assert sum(s.end - s.begin for s in spans.values()) == len(data) - 8 - struct.unpack(
        "<Q", data[:8])[0]
    with pytest.raises(CheckpointError, match="the file at"):
        delta.header(data + b"\0\0", path)
    (length,) = struct.unpack("<Q", data[:8])
    table = json.loads(data[8:8 + length])
    last = max((k for k in table if k != "__metadata__"),
               key=lambda k: table[k]["data_offsets"][0])
    begin, end = table[last]["data_offsets"]
    table[last]["data_offsets"] = [begin + 2, end + 2]  # two bytes no tensor covers
    head = json.dumps(table).encode()
    body = data[8 + length:]
    gapped = struct.pack("<Q", len(head)) + head + body[:begin] + b"\0\0" + body[begin:]
    with pytest.raises(CheckpointError, match=f"tensor '{last}' starts at byte"):
        delta.header(gapped, path)


@pytest.mark.parametrize(("tensor_hash", "reads_as"),
                         [(None, "sha256"), ("sha256", "sha256"), ("blake3", "blake3"),
                          ("md5", "tensor_hash 'md5' is not one of"),
                          (7, "tensor_hash")])
def test_a_manifest_names_its_tensor_hash_and_one_that_names_none_is_sha256(
        tmp_path: Path, tensor_hash: Any, reads_as: str) -> None:
    """Manifests written before the hash was named hold SHA-256; any other is refused."""
    import json

    share, last = tmp_path / "share", tmp_path / "last"
    w0 = weights()
    publish(share, 0, w0, last)
    publish(share, 1, step(w0, 0.02, 1), last, parent=0)
    path = share / "iter-000001" / MANIFEST_NAME
    body = json.loads(path.read_text())
    if tensor_hash is None:
        del body["delta"]["tensor_hash"]
    else:
        body["delta"]["tensor_hash"] = tensor_hash
    path.write_text(json.dumps(body))
    if reads_as in ("sha256", "blake3"):
        manifest = read_manifest(share / "iter-000001")
        assert manifest.delta is not None and manifest.delta.tensor_hash == reads_as
    else:
        with pytest.raises(CheckpointError, match=reads_as):
            read_manifest(share / "iter-000001")


def test_every_dtype_and_bit_pattern_travels_exactly(tmp_path: Path) -> None:
    """Elements are compared and put back as integers of their width: float32 and
    float16 beside bf16, integer and bool buffers, NaN payloads and -0.0 alike."""
    share, last = tmp_path / "share", tmp_path / "last"
    g = torch.Generator().manual_seed(5)
    w0 = {"bf16": torch.randn(4096, generator=g).to(torch.bfloat16),
          "f32": torch.randn(4096, generator=g),
          "f16": torch.randn(4096, generator=g).to(torch.float16),
          "i64": torch.arange(4096, dtype=torch.int64),
          "u8": torch.arange(4096, dtype=torch.int64).remainder(251).to(torch.uint8),
          "mask": torch.rand(4096, generator=g) < 0.5}
    w1 = {name: t.clone() for name, t in w0.items()}
    w1["bf16"][7] = -0.0  # was a nonzero: another bit pattern
    w1["f32"][[1, 2, 3]] = torch.tensor([float("nan"), -0.0, float("inf")])
    w1["f32"].view(torch.int32)[4] = 0x7FC00123  # a NaN with a payload
    w1["f16"][100:110] += 1
    w1["i64"][4095] = -(2**62)
    w1["u8"][0] = 255
    w1["mask"][:64] = ~w1["mask"][:64]
    publish(share, 0, w0, last)
    manifest = publish(share, 1, w1, last, parent=0)
    assert manifest.delta is not None
    copy = copy_to_local_cache(share / "iter-000001", tmp_path / "node")
    assert (copy / "model.safetensors").read_bytes() == full_bytes(tmp_path, w1)


def test_advancing_in_place_makes_the_trainers_file_from_the_parents_own_and_frees_it(
        tmp_path: Path) -> None:
    """advance (the engine's cache, which keeps one model): the parent's copy itself
    becomes the result, its file written where the elements changed, not cloned."""
    share, last = tmp_path / "share", tmp_path / "last"
    w0 = weights()
    w1 = step(w0, 0.02, seed=1)
    w2 = step(w1, 0.02, seed=2)
    publish(share, 0, w0, last)
    publish(share, 1, w1, last, parent=0)
    publish(share, 2, w2, last, parent=1)
    node = tmp_path / "node"
    parent = copy_to_local_cache(share / "iter-000000", node)
    inode = (parent / "model.safetensors").stat().st_ino
    copy = copy_to_local_cache(share / "iter-000002", node, advance=True)
    assert (copy / "model.safetensors").read_bytes() == full_bytes(tmp_path, w2)
    assert (copy / "model.safetensors").stat().st_ino == inode  # the same file, advanced twice
    assert (copy / MANIFEST_NAME).read_bytes() == read_manifest(share / "iter-000002").to_bytes()
    assert sorted(p.name for p in node.iterdir() if not p.name.startswith(".")) == [copy.name]
    assert not [p for p in node.iterdir() if p.name.endswith(".readers") and
                not p.name.startswith(f".{copy.name}")]
    # The parent asked for again (a recover going back) is made again from its base.
    again = copy_to_local_cache(share / "iter-000001", node, advance=False)
    assert (again / "model.safetensors").read_bytes() == full_bytes(tmp_path, w1)


def test_a_copy_held_by_a_reader_is_cloned_not_advanced_nor_removed(tmp_path: Path) -> None:
    from trainer.local_copy import held_copy, remove_copy

    share, last = tmp_path / "share", tmp_path / "last"
    w0 = weights()
    w1 = step(w0, 0.02, seed=1)
    publish(share, 0, w0, last)
    publish(share, 1, w1, last, parent=0)
    node = tmp_path / "node"
    with held_copy(share / "iter-000000", node) as parent:
        # Another process (a second engine of this node) moves on meanwhile.
        script = textwrap.dedent(f"""
            import sys
            from pathlib import Path
            sys.path.insert(0, {str(ROOT)!r})
            from trainer.local_copy import copy_to_local_cache, remove_copy
            copy = copy_to_local_cache(Path({str(share / 'iter-000001')!r}),
                                       Path({str(node)!r}), advance=True)
            print(remove_copy(Path({str(parent)!r})), copy)
        """)
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             timeout=120, check=True).stdout.split()
        assert out[0] == "False"  # held: not removed
        assert (parent / "model.safetensors").read_bytes() == full_bytes(tmp_path, w0)
        assert Path(out[1]).name.startswith("iter-000001")
        assert (Path(out[1]) / "model.safetensors").read_bytes() == full_bytes(tmp_path, w1)
    assert remove_copy(parent) and not parent.exists()


def base_and_link(tmp_path: Path) -> tuple[Path, Path, Path, dict[str, torch.Tensor], Any]:
    """iter-0 published full and iter-1 as its delta (2 % changed); a node holding iter-0's
    copy.  (share, the trainer's kept files, the node's cache, iter-0's tensors, iter-1's
    manifest.)"""
    share, last = tmp_path / "share", tmp_path / "last"
    w0 = weights()
    publish(share, 0, w0, last)
    m1 = publish(share, 1, step(w0, 0.02, 1), last, parent=0)
    node = tmp_path / "node"
    copy_to_local_cache(share / "iter-000000", node)
    return share, last, node, w0, m1


def test_an_altered_delta_applied_in_place_is_refused_and_the_parent_made_again(
        tmp_path: Path) -> None:
    share, _last, node, w0, m1 = base_and_link(tmp_path)
    # Consistent with its own SHA-256 in a forged manifest: only the tensors' digests catch it.
    path = share / "iter-000001" / "delta" / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    forged = m1.files | {"delta/model.safetensors": FileEntry(
        sha256=hashlib.sha256(bytes(data)).hexdigest(), size=len(data))}
    manifest_path = share / "iter-000001" / MANIFEST_NAME
    manifest_path.chmod(0o644)
    manifest_path.write_bytes(dataclasses.replace(m1, files=forged).to_bytes())
    with pytest.raises(CheckpointError, match=r"tensor .* after the delta.*altered"):
        copy_to_local_cache(share / "iter-000001", node, advance=True)
    assert not [p for p in node.iterdir() if p.is_dir()]  # the parent was given up, nothing made
    remade = copy_to_local_cache(share / "iter-000000", node)
    assert (remade / "model.safetensors").read_bytes() == full_bytes(tmp_path, w0)


@pytest.mark.parametrize("advance", [False, True])
def test_a_file_unchanged_since_the_parent_is_taken_from_its_copy_not_read_again(
        tmp_path: Path, advance: bool) -> None:
    """config.json has the parent's size and SHA-256: the node takes it from the parent's
    copy (verified when made): the share's, garbled here, is never read."""
    share, last, node, w0, m1 = base_and_link(tmp_path)
    on_share = share / "iter-000001" / "config.json"
    good = on_share.read_bytes()
    on_share.chmod(0o644)
    on_share.write_bytes(b"x" * len(good))  # read from the share, it would fail its SHA-256
    copy = copy_to_local_cache(share / "iter-000001", node, advance=advance)
    assert (copy / "config.json").read_bytes() == good
    assert (copy / MANIFEST_NAME).read_bytes() == m1.to_bytes()
    # A file that changed since the parent is read from the share (and, garbled, refused).
    class Renamed(Weights):
        def save_pretrained(self, directory: Path, state_dict: dict[str, Any] | None = None,
                            ) -> None:
            super().save_pretrained(directory, state_dict)
            (Path(directory) / "config.json").write_text('{"model_type": "qwen2", "x": 1}\n')

    m2 = publish_checkpoint(Renamed(step(w0, 0.02, 2)), None, share / "iter-000002",
                            iteration=2, last_published=last, delta_parent=share / "iter-000001")
    assert m2.delta is not None and m2.files["config.json"] != m1.files["config.json"]
    on_share = share / "iter-000002" / "config.json"
    on_share.chmod(0o644)
    on_share.write_bytes(b"x" * on_share.stat().st_size)
    with pytest.raises(CheckpointError, match=r"config\.json"):
        copy_to_local_cache(share / "iter-000002", node, advance=advance)
