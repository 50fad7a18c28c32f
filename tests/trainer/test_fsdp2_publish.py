"""An FSDP2 trainer's checkpoint, gathered onto rank 0 over the process group
(trainer/sharded_save.py): published as a single process publishes it, so an
iteration after a full one goes to the share as its delta, and what a node makes
of that delta is the master weights, cast to the checkpoint's dtype, bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.trainer.test_train_state import job_for, torchrun_pair, write_batches
from trainer import train_state
from trainer.architectures import create_model, preset
from trainer.checkpoint import read_manifest
from trainer.local_copy import copy_to_local_cache
from trainer.manifest import list_files
from trainer.sharded_save import gather_fits


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True], ids=["own-lm-head", "tied-embeddings"])
def test_fsdp2_publishes_its_gathered_tensors_as_a_delta_of_its_last_checkpoint(
        tmp_path: Path, tied: bool) -> None:
    """Qwen2-shaped, bf16 on disk, fp32 parameters; tied: lm_head is the embedding
    matrix (Qwen2.5-0.5B's way), one parameter under two names, written once."""
    model_dir = create_model(tmp_path / "model", preset("qwen2", "tiny",
                                                       tie_word_embeddings=tied))
    write_batches(tmp_path, model_dir)
    config = dict(strategy="fsdp2", epochs=2, micro_batch_size=2, lr=1e-6, warmup_steps=0)
    for it, source in ((1, model_dir), (2, tmp_path / "ckpt-1")):
        job = job_for(tmp_path, it, source, save_state=it == 2,
                      delta_parent=tmp_path / "ckpt-1" if it == 2 else None, **config)
        job.save(tmp_path / f"job-{it}.json")
        # Both jobs' rank 0 keeps its last checkpoint in this test's own TMPDIR
        # (tests/trainer/conftest.py), as a run's publisher does in its .tmp/.
        logs = torchrun_pair(tmp_path / f"job-{it}.json", tmp_path, f"it{it}")
        assert "publishing by gather" in logs[0], logs[0][-3000:]

    # Iteration 1 is full; iteration 2 went to the share as its delta from it.
    full, delta = read_manifest(tmp_path / "ckpt-1"), read_manifest(tmp_path / "ckpt-2")
    assert full.delta is None and "model.safetensors" in list_files(tmp_path / "ckpt-1")
    assert delta.delta is not None and delta.delta.parent == "ckpt-1", delta
    files = list_files(tmp_path / "ckpt-2")
    assert "delta/model.safetensors" in files and "model.safetensors" not in files, files
    sent = (tmp_path / "ckpt-2/delta/model.safetensors").stat().st_size
    whole = (tmp_path / "ckpt-1/model.safetensors").stat().st_size
    print(f"\nthe delta: {sent} bytes, {sent / whole:.3f} of the model's {whole}")
    assert sent < whole / 5  # lr 1e-6: few bf16 elements move

    # A node's copy of the delta is the trainer's fp32 master weights (each rank's
    # rows, in rank order) cast to bf16, every element.
    copy = copy_to_local_cache(tmp_path / "ckpt-2", tmp_path / "cache")
    published = load_file(copy / "model.safetensors")
    state = train_state.state_dir(tmp_path / "state", 2)
    shards = [train_state.load_shard(state, i).weights for i in train_state.complete_state(state)]
    assert len(shards) == 2
    # The same tensors as the model save_pretrained wrote (a tied matrix once).
    assert sorted(published) == sorted(load_file(model_dir / "model.safetensors"))
    for name, tensor in published.items():
        assert tensor.dtype == torch.bfloat16
        master = torch.cat([s[name] for s in shards])
        assert torch.equal(tensor, master.to(torch.bfloat16)), name
    before = load_file(tmp_path / "ckpt-1/model.safetensors")
    assert any(not torch.equal(before[k], published[k]) for k in before)
    metrics = json.loads((tmp_path / "metrics-2.json").read_text())
    assert metrics["strategy"] == "fsdp2"


def test_rank_0_gathers_only_with_room_to_spare() -> None:
    gib = 1 << 30
    assert gather_fits(10 * gib, 14 * gib)  # 10 GB and a quarter of it spare
    assert not gather_fits(10 * gib, 12 * gib)
    assert gather_fits(gib // 2, 2 * gib)  # at least 1 GiB spare
    assert not gather_fits(gib // 2, gib)


def test_rank_0_stages_the_shards_where_the_gathered_model_would_not_fit(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The route is rank 0's, from the model's bytes in the checkpoint's dtype (a tied
    matrix once) and its free memory; a process group of one rank here."""
    import logging

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from trainer.config import Strategy
    from trainer.distributed import DistContext
    from trainer.sharded_save import Route, choose_route, published_bytes

    model_dir = create_model(tmp_path / "model", preset("qwen2", "tiny", tie_word_embeddings=True))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    need = published_bytes(model, "bfloat16")
    assert need == (model_dir / "model.safetensors").stat().st_size - 8 - int.from_bytes(
        (model_dir / "model.safetensors").read_bytes()[:8], "little")  # the file's tensors
    ctx = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"),
                      strategy=Strategy.FSDP2)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with caplog.at_level(logging.INFO, logger="trainer"):
            assert choose_route(model, ctx, "bfloat16", free=lambda: 64 << 30) is Route.GATHER
            assert choose_route(model, ctx, "bfloat16", free=lambda: need) is Route.STAGE
    finally:
        dist.destroy_process_group()
    assert "publishing by stage" in caplog.text and "too little to gather it" in caplog.text
