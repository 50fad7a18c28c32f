"""A delta taken from the trainer's tensors: its kept files advanced in place, no
weights file written whole; anything else goes through the file written whole."""

from __future__ import annotations

import json
import logging
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from trainer import delta
from trainer.checkpoint import publish_checkpoint, read_manifest
from trainer.local_copy import copy_to_local_cache
from trainer.publisher import RECORD

from .test_delta import ROOT, Weights, full_bytes, kill_at, step, weights

pytestmark = pytest.mark.usefixtures("quick_read_retry")


class Counted(Weights):
    """Weights whose state_dict may hold more than its file (`extra`), counting the
    weights files save_pretrained writes."""

    def __init__(self, tensors: dict[str, torch.Tensor],
                 extra: dict[str, torch.Tensor] | None = None) -> None:
        super().__init__(tensors)
        self.extra = extra or {}
        self.files_written = 0

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {**self.tensors, **self.extra}

    def save_pretrained(self, directory: Path, state_dict: dict[str, Any] | None = None) -> None:
        super().save_pretrained(directory, state_dict)
        self.files_written += (Path(directory) / "model.safetensors").exists()


def publish(share: Path, iteration: int, model: Weights, last: Path,
            parent: int | None = None) -> Any:
    return publish_checkpoint(
        model, None, share / f"iter-{iteration:06d}", iteration=iteration, last_published=last,
        delta_parent=None if parent is None else share / f"iter-{parent:06d}")


def base(tmp_path: Path) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """iter-0 published full, its files kept: (share, the kept files, iter-1's tensors)."""
    share, last = tmp_path / "share", tmp_path / "last"
    w0 = weights()
    publish(share, 0, Counted(w0), last)
    return share, last, step(w0, 0.02, seed=1)


def test_the_trainers_tensors_advance_the_kept_file_in_place_and_no_weights_file_is_written(
        tmp_path: Path) -> None:
    share, last = tmp_path / "share", tmp_path / "last"
    w0 = weights()
    w1 = step(w0, 0.02, seed=1)
    w2 = step(w1, 0.02, seed=2)
    publish(share, 0, Counted(w0), last)
    inode = (last / "model.safetensors").stat().st_ino
    # The tied tensor ("lm.weight", the embedding's own storage) is in no file: allowed.
    models = [Counted(w, extra={"lm.weight": w["embed.weight"]}) for w in (w1, w2)]
    m1 = publish(share, 1, models[0], last, parent=0)
    m2 = publish(share, 2, models[1], last, parent=1)
    assert m1.delta is not None and m2.delta is not None and m2.delta.length == 2
    assert [m.files_written for m in models] == [0, 0]  # no weights file written whole
    assert (last / "model.safetensors").stat().st_ino == inode  # advanced, not replaced
    assert (last / "model.safetensors").read_bytes() == full_bytes(tmp_path, w2)
    assert (m2.delta.results["model.safetensors"].size ==
            len(full_bytes(tmp_path, w2)))
    # Every node makes the trainer's file from the chain, checked by the manifest.
    copy = copy_to_local_cache(share / "iter-000002", tmp_path / "node")
    assert (copy / "model.safetensors").read_bytes() == full_bytes(tmp_path, w2)
    assert sorted(p.name for p in (share / "iter-000002").rglob("*") if p.is_file()) == \
        ["config.json", "manifest.json", "model.safetensors"]  # delta/model.safetensors


@pytest.mark.parametrize("why", ["extra", "dtype"])
def test_tensors_that_are_not_the_kept_files_go_through_the_file_written_whole(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, why: str) -> None:
    caplog.set_level(logging.INFO, logger="trainer.publisher")
    share, last, w1 = base(tmp_path)
    if why == "extra":  # a tensor of the model's own storage the kept file lacks
        model = Counted(w1, extra={"head.weight": torch.zeros(3, dtype=torch.bfloat16)})
        reason = "the model's 'head.weight' is in no kept file"
    else:  # the same names, another dtype in the model than in the file
        model = Counted(w1)
        model.state_dict = lambda: {**w1, "layer.bias": w1["layer.bias"].float()}  # type: ignore[method-assign]
        reason = "'layer.bias' is F32 (64,) in the model, BF16 (64,) in model.safetensors"
    m1 = publish(share, 1, model, last, parent=0)
    assert f"iter-000001: its delta is encoded from the checkpoint written whole, not from " \
           f"the trainer's tensors: {reason}" in caplog.text
    assert model.files_written == 1 and m1.delta is not None
    copy = copy_to_local_cache(share / "iter-000001", tmp_path / "node")
    assert (copy / "model.safetensors").read_bytes() == full_bytes(tmp_path, w1)


def test_a_publication_that_fails_while_advancing_leaves_no_parent_and_the_next_is_full(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The record naming the kept files goes before any of their bytes change: a
    process that fails (or is killed) mid-way leaves half-advanced files that nothing
    takes for a parent."""
    share, last, w1 = base(tmp_path)
    changes = delta.changes

    def failing(now: Any, was: Any, span: Any) -> Any:
        if span.name == "layer.weight":  # after "embed.weight" was written in place
            raise OSError(28, "No space left on device")
        return changes(now, was, span)

    monkeypatch.setattr(delta, "changes", failing)
    with pytest.raises(OSError, match="No space left"):
        publish(share, 1, Counted(w1), last, parent=0)
    assert not (last / RECORD).exists() and not (share / "iter-000001").exists()
    assert (last / "model.safetensors").read_bytes() != full_bytes(tmp_path, weights())  # half made
    monkeypatch.setattr(delta, "changes", changes)
    again = publish(share, 1, Counted(w1), last, parent=0)
    assert again.delta is None  # published full: no parent was kept
    assert (share / "iter-000001" / "model.safetensors").read_bytes() == \
        full_bytes(tmp_path, w1)
    m2 = publish(share, 2, Counted(step(w1, 0.02, seed=2)), last, parent=1)
    assert m2.delta is not None
    assert read_manifest(share / "iter-000002").delta == m2.delta


class Sharded(Counted):
    """Weights saved as two files and their index, as transformers shards a model."""

    FILES = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")

    def save_pretrained(self, directory: Path, state_dict: dict[str, Any] | None = None) -> None:
        directory = Path(directory)
        (directory / "config.json").write_text('{"model_type": "qwen2"}\n')
        if state_dict == {}:
            return
        names = sorted(self.tensors)
        shards = {self.FILES[0]: names[:1], self.FILES[1]: names[1:]}
        for file, members in shards.items():
            save_file({n: self.tensors[n] for n in members}, str(directory / file),
                      metadata={"format": "pt"})
            self.files_written += 1
        weight_map = {n: file for file, members in shards.items() for n in members}
        (directory / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_a_sharded_models_files_advance_together_and_keep_their_index(tmp_path: Path) -> None:
    share, last = tmp_path / "share", tmp_path / "last"
    w0 = weights()
    w1 = step(w0, 0.02, seed=1)
    publish(share, 0, Sharded(w0), last)
    model = Sharded(w1)
    m1 = publish(share, 1, model, last, parent=0)
    assert model.files_written == 0 and m1.delta is not None
    assert sorted(m1.delta.results) == list(Sharded.FILES)
    assert "model.safetensors.index.json" in m1.files
    reference = tmp_path / "reference"
    reference.mkdir()
    Sharded(w1).save_pretrained(reference)
    copy = copy_to_local_cache(share / "iter-000001", tmp_path / "node")
    for name in (*Sharded.FILES, "model.safetensors.index.json"):
        assert (copy / name).read_bytes() == (reference / name).read_bytes(), name


@pytest.mark.parametrize("tied", [False, True])
def test_a_transformers_model_publishes_its_deltas_from_its_tensors_byte_for_byte(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, tied: bool) -> None:
    """The real interface: a model built here (Qwen2's architecture, tied embeddings as
    Qwen2.5-0.5B's or not), trained in float32 and published in bfloat16.  Its deltas
    come from its tensors (no file written whole), and a node makes the files
    write_model_files writes, byte for byte."""
    from transformers import AutoModelForCausalLM

    from trainer.architectures import create_model, preset
    from trainer.checkpoint import write_model_files

    caplog.set_level(logging.INFO, logger="trainer.publisher")
    built = create_model(tmp_path / "model", preset("qwen2", "tiny", num_hidden_layers=1,
                                                    tie_word_embeddings=tied))
    model = AutoModelForCausalLM.from_pretrained(built, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    share, last = tmp_path / "share", tmp_path / "last"
    tokens = torch.randint(0, 1024, (1, 16), generator=torch.Generator().manual_seed(0))
    for iteration in range(3):
        if iteration:
            model(tokens, labels=tokens).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        manifest = publish_checkpoint(
            model, None, share / f"iter-{iteration}", iteration=iteration,
            carry_files_from=built, dtype="bfloat16", last_published=last,
            delta_parent=share / f"iter-{iteration - 1}" if iteration else None)
        assert (manifest.delta is None) == (iteration == 0)
        if iteration == 0:
            inode = (last / "model.safetensors").stat().st_ino
    assert "written whole" not in caplog.text
    assert (last / "model.safetensors").stat().st_ino == inode  # advanced, never rewritten
    reference = tmp_path / "reference"
    write_model_files(model, None, reference, carry_files_from=built, dtype="bfloat16")
    copy = copy_to_local_cache(share / "iter-2", tmp_path / "node")
    names = sorted(p.name for p in reference.iterdir())
    assert names == sorted(p.name for p in copy.iterdir() if not p.name.startswith(".")
                           and p.name != "manifest.json")
    for name in names:
        assert (copy / name).read_bytes() == (reference / name).read_bytes(), name


def test_a_publisher_killed_while_advancing_leaves_no_parent(tmp_path: Path) -> None:
    """SIGKILL after one tensor was written into the kept file: nothing names that file
    a parent any more, iteration 1 published again goes full, and the chain after it
    makes the trainer's files."""
    share, last, w1 = base(tmp_path)
    gate = tmp_path / "advancing"
    staging = tmp_path / "tmp"  # the killed publisher's staging stays in the test's dir
    staging.mkdir()
    script = textwrap.dedent(f"""
        import sys, tempfile, time
        from pathlib import Path
        sys.path.insert(0, {str(ROOT)!r})
        tempfile.tempdir = {str(staging)!r}
        import trainer.kept_delta
        from tests.trainer.test_delta import Weights, step, weights
        from trainer.checkpoint import publish_checkpoint
        real = trainer.kept_delta._patch
        def slow(*args, **kwargs):
            out = real(*args, **kwargs)
            Path({str(gate)!r}).write_text("one tensor written")
            time.sleep(60)  # killed here, the kept file part old, part new
            return out
        trainer.kept_delta._patch = slow
        share = Path({str(share)!r})
        publish_checkpoint(Weights(step(weights(), 0.02, seed=1)), None,
                           share / "iter-000001", iteration=1,
                           last_published=Path({str(last)!r}),
                           delta_parent=share / "iter-000000")
    """)
    kill_at(script, gate, "the publisher advancing its kept file")
    assert not (last / RECORD).exists() and not (share / "iter-000001").exists()
    again = publish(share, 1, Counted(w1), last, parent=0)
    assert again.delta is None
    w2 = step(w1, 0.02, seed=2)
    assert publish(share, 2, Counted(w2), last, parent=1).delta is not None
    copy = copy_to_local_cache(share / "iter-000002", tmp_path / "node")
    assert (copy / "model.safetensors").read_bytes() == full_bytes(tmp_path, w2)


@pytest.mark.parametrize("damage", ["truncated", "empty"])
def test_a_damaged_kept_file_makes_the_next_checkpoint_full_not_a_failure(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str) -> None:
    caplog.set_level(logging.INFO, logger="trainer.publisher")
    share, last, w1 = base(tmp_path)
    kept = last / "model.safetensors"
    kept.write_bytes(kept.read_bytes()[:100] if damage == "truncated" else b"")
    m1 = publish(share, 1, Counted(w1), last, parent=0)
    assert "the kept model.safetensors is unreadable" in caplog.text
    assert "iter-000001: model.safetensors goes whole (" in caplog.text
    assert m1.delta is None
    assert (share / "iter-000001" / "model.safetensors").read_bytes() == \
        full_bytes(tmp_path, w1)
    m2 = publish(share, 2, Counted(step(w1, 0.02, seed=2)), last, parent=1)
    assert m2.delta is not None  # the kept files are iteration 1's again


def test_a_view_of_a_kept_tensors_storage_is_not_taken_for_a_tied_tensor(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Tied means the same elements under another name; a tensor that merely lives in
    the same storage (a slice) holds other values, which no kept file has."""
    caplog.set_level(logging.INFO, logger="trainer.publisher")
    share, last, w1 = base(tmp_path)
    model = Counted(w1, extra={"half.weight": w1["embed.weight"][256:]})
    publish(share, 1, model, last, parent=0)
    assert "the model's 'half.weight' is in no kept file" in caplog.text
    assert model.files_written == 1


def test_a_save_that_writes_weights_when_asked_for_none_goes_through_the_file_written_whole(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A model whose save_pretrained writes its weights whatever state_dict says: the
    files besides the weights cannot be had apart, so nothing is advanced in place."""
    caplog.set_level(logging.INFO, logger="trainer.publisher")

    class Always(Counted):
        def save_pretrained(self, directory: Path,
                            state_dict: dict[str, Any] | None = None) -> None:
            super().save_pretrained(directory, None)

    share, last, w1 = base(tmp_path)
    inode = (last / "model.safetensors").stat().st_ino
    m1 = publish(share, 1, Always(w1), last, parent=0)
    assert "writing the files besides the weights wrote ['model.safetensors'] too" \
        in caplog.text
    assert m1.delta is not None
    assert (last / "model.safetensors").stat().st_ino != inode  # replaced, not advanced
    copy = copy_to_local_cache(share / "iter-000001", tmp_path / "node")
    assert (copy / "model.safetensors").read_bytes() == full_bytes(tmp_path, w1)
