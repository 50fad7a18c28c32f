"""A trainer reads a published checkpoint through a copy on the node's disk (a delta
made whole there), and keeps one such copy: a trainer started every iteration
(torchrun.resident = false, a relaunched group) would otherwise leave one whole
model per iteration in the run's node-local .tmp/ (140 GB an iteration at 70 B in
bf16)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from trainer.checkpoint import publish_checkpoint
from trainer.config import Strategy
from trainer.distributed import DistContext
from trainer.local_copy import held_copy
from trainer.policy import POLICIES, REFERENCE, load_model
from trainer.tiny_model import create_tiny_model

SINGLE = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"),
                     strategy=Strategy.DDP)


def rl_step(model: Any, seed: int) -> None:
    """2 % of every parameter's elements moved, as a step at an RL learning rate."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            pick = torch.rand(p.shape, generator=g) < 0.02
            p[pick] += 1e-3


def copies(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if p.is_dir())


def test_a_trainer_on_each_iterations_delta_keeps_one_copy_on_the_nodes_disk(
        tmp_path: Path) -> None:
    model, tokenizer = load_model(create_tiny_model(tmp_path / "model", seed=0), SINGLE)
    share, last = tmp_path / "share", tmp_path / "last-published"
    cache = Path(tempfile.gettempdir()) / POLICIES  # tests/trainer/conftest.py: this test's
    publish_checkpoint(model, tokenizer, share / "iter-000000", iteration=0,
                       last_published=last)
    for it in (1, 2):
        rl_step(model, seed=it)
        manifest = publish_checkpoint(model, tokenizer, share / f"iter-{it:06d}", iteration=it,
                                      last_published=last,
                                      delta_parent=share / f"iter-{it - 1:06d}")
        assert manifest.delta is not None
        loaded, _ = load_model(share / f"iter-{it:06d}", SINGLE)
        for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values(),
                                strict=True):
            assert torch.equal(a, b), (it, name)
        # Made whole, then each from a clone of the last: one model left on the disk.
        assert copies(cache) == [f"iter-{it:06d}-{manifest.digest}"]

    # A copy another process reads stays (the next one is a clone of it), and goes
    # at the load after it is let go.
    with held_copy(share / "iter-000002", cache) as held:
        rl_step(model, seed=3)
        publish_checkpoint(model, tokenizer, share / "iter-000003", iteration=3,
                           last_published=last, delta_parent=share / "iter-000002")
        load_model(share / "iter-000003", SINGLE)
        assert held.name in copies(cache) and len(copies(cache)) == 2
    rl_step(model, seed=4)
    m4 = publish_checkpoint(model, tokenizer, share / "iter-000004", iteration=4,
                            last_published=last, delta_parent=share / "iter-000003")
    load_model(share / "iter-000004", SINGLE)
    assert copies(cache) == [f"iter-000004-{m4.digest}"]


def test_a_full_checkpoint_is_read_from_the_share_once_per_node_and_without_room_in_place(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Every local rank loads the policy: the first copies it (hashed as it is read),
    the others find the sealed copy, where each rank read the share twice (its
    check, then its load).  The reference model has a cache of its own, so loading
    it does not evict the policy's copy, the parent of the next delta."""
    import errno

    import trainer.local_copy

    model, tokenizer = load_model(create_tiny_model(tmp_path / "model", seed=0), SINGLE)
    share = tmp_path / "share"
    manifest = publish_checkpoint(model, tokenizer, share / "iter-000000", iteration=0)
    cache = Path(tempfile.gettempdir())
    name = f"iter-000000-{manifest.digest}"
    first, _ = load_model(share / "iter-000000", SINGLE)
    made = (cache / POLICIES / name / "model.safetensors").stat().st_ino
    again, _ = load_model(share / "iter-000000", SINGLE)  # another rank of the node
    assert (cache / POLICIES / name / "model.safetensors").stat().st_ino == made
    for a, b, c in zip(model.state_dict().values(), first.state_dict().values(),
                       again.state_dict().values(), strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    load_model(share / "iter-000000", SINGLE, cache=REFERENCE)
    assert copies(cache / POLICIES) == copies(cache / REFERENCE) == [name]

    # No room on the node's disk: a full checkpoint is checked and read where it is.
    def no_room(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(trainer.local_copy, "_copy", no_room)
    rl_step(model, seed=1)
    publish_checkpoint(model, tokenizer, share / "iter-000001", iteration=1)
    with caplog.at_level("WARNING"):
        loaded, _ = load_model(share / "iter-000001", SINGLE)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 loaded.state_dict().values(), strict=True))
    assert "no room in" in caplog.text and "one more model" in caplog.text
    assert copies(cache / POLICIES) == [name]
