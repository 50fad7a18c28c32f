"""Sharded loading (trainer/sharded_load.py) on gloo ranks started by torchrun.

- Every parameter a rank materialises equals, bit for bit, the same rows of
  the model from_pretrained reads, and the sharded model's logits equal the
  whole model's.
- At 4 ranks, the growth of each rank's peak resident memory while loading is
  at most 0.4x the model's fp32 size (1/4 plus slack), and the frozen
  reference model (kl_coef > 0) adds at most as much again, measured by
  benchmarks/train_memory_bench.py's worker (VmHWM reset through clear_refs).
- Activation checkpointing gives the same loss and gradients.
- A malformed safetensors header is refused with the file named.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer.errors import TrainError
from trainer.sharded_load import read_header, shard_rows
from trainer.tiny_model import TinyModelSpec, create_tiny_model

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "train_memory_bench.py"

CHECK = r"""
import json, sys
from benchmarks.train_memory_bench import emit_row
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM
from trainer.config import TrainConfig
from trainer.distributed import exit_rank, init_distributed
from trainer.sharded_load import load_sharded_model, shard_rows

model_dir = Path(sys.argv[1])
ctx = init_distributed(TrainConfig.from_dict({"strategy": "fsdp2", "device": "cpu"}))
sharded = load_sharded_model(model_dir, ctx, trainable=True)
whole = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
reference = dict(whole.named_parameters())
mismatched = []
for name, param in sharded.named_parameters():
    local = param.to_local()
    start, end = shard_rows(param.shape[0], ctx.world_size, ctx.rank)
    if not torch.equal(local, reference[name].detach()[start:end]):
        mismatched.append(name)
ids = torch.arange(1, 33).reshape(2, 16) % 40 + 3
with torch.no_grad():
    same = torch.allclose(sharded(input_ids=ids).logits, whole(input_ids=ids).logits, atol=1e-5)
emit_row({"rank": ctx.rank, "mismatched": mismatched, "same_logits": same,
          "params": len(reference)})
exit_rank(0)  # trainer/distributed.py: why not a plain exit
"""


SAVE = r"""
import sys
from pathlib import Path
import torch.distributed as dist
from trainer.checkpoint import publish_checkpoint
from trainer.config import TrainConfig
from trainer.distributed import exit_rank, init_distributed, unwrap
from trainer.sharded_load import load_sharded_model
from trainer.sharded_save import stage_sharded_weights

model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
ctx = init_distributed(TrainConfig.from_dict({"strategy": "fsdp2", "device": "cpu"}))
model = load_sharded_model(model_dir, ctx, trainable=True)
staged = stage_sharded_weights(model, ctx, out)
if ctx.rank == 0:
    publish_checkpoint(unwrap(model), None, out, iteration=5, carry_files_from=model_dir,
                       weights_from=staged)
dist.barrier()
exit_rank(0)  # trainer/distributed.py: why not a plain exit
"""


GATHER = r"""
import sys
from pathlib import Path
import torch
from safetensors.torch import load_file
from benchmarks.train_memory_bench import emit_row
from trainer.config import TrainConfig
from trainer.distributed import exit_rank, init_distributed
from trainer.sharded_load import load_sharded_model
from trainer.sharded_save import gather_published

model_dir = Path(sys.argv[1])
ctx = init_distributed(TrainConfig.from_dict({"strategy": "fsdp2", "device": "cpu"}))
model = load_sharded_model(model_dir, ctx, trainable=True)
gathered = gather_published(model, ctx, "bfloat16")
row = {"rank": ctx.rank, "none": gathered is None}
if ctx.rank == 0:
    stored = load_file(model_dir / "model.safetensors")
    row["names"] = sorted(gathered) == sorted(stored)
    row["unequal"] = [n for n, t in stored.items()
                      if not torch.equal(gathered[n], t.to(torch.bfloat16))]
    row["cpu_bf16"] = all(t.device.type == "cpu" and t.dtype == torch.bfloat16
                          for t in gathered.values())
emit_row(row)
exit_rank(0)  # trainer/distributed.py: why not a plain exit
"""


def torchrun(ranks: int, script: str, *args: str) -> list[dict]:
    from benchmarks.train_memory_bench import torchrun_rows

    return torchrun_rows(ranks, Path(script), *args, timeout_s=600)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 4 layers of 512: 67 MB of fp32 weights, so a quarter of it stands out of the noise.
    out = tmp_path_factory.mktemp("model") / "m"
    create_tiny_model(out, seed=3, spec=TinyModelSpec(
        hidden_size=512, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8,
        max_position_embeddings=256))
    return out


@pytest.mark.slow
def test_each_rank_holds_exactly_its_rows_and_the_logits_match(model: Path,
                                                               tmp_path: Path) -> None:
    script = tmp_path / "check.py"
    script.write_text(CHECK)
    rows = torchrun(3, str(script), str(model))  # 3 ranks: uneven splits of every dim 0
    assert sorted(r["rank"] for r in rows) == [0, 1, 2]
    for r in rows:
        assert r["mismatched"] == [] and r["same_logits"], r


@pytest.mark.slow
def test_loading_on_4_ranks_grows_each_rank_by_about_a_quarter(model: Path) -> None:
    size = (model / "model.safetensors").stat().st_size
    rows = torchrun(4, str(BENCH), "--worker", "--model", str(model), "--mode", "sharded",
                    "--seq", "16", "--batch", "1", "--reference")
    growth = [r["load_peak"] / size for r in rows]
    reference = [r["ref_peak"] / size for r in rows]  # kl_coef > 0: the frozen reference
    print(f"\nload peak growth per rank at 4 ranks: {[f'{g:.3f}' for g in growth]} x model, "
          f"reference {[f'{g:.3f}' for g in reference]}")
    assert len(rows) == 4 and max(growth) <= 0.4, growth
    assert max(reference) <= 0.4, reference


def test_activation_checkpointing_gives_the_same_loss_and_gradients(model: Path) -> None:
    from transformers import AutoModelForCausalLM

    from trainer.policy import enable_checkpointing

    ids = torch.arange(0, 96).reshape(3, 32) % 40 + 3
    results = []
    for checkpointing in (False, True):
        m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        m.train()
        if checkpointing:
            enable_checkpointing(m)
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((float(loss), {n: p.grad.detach().clone()
                                      for n, p in m.named_parameters()}))
    (plain, grads), (ckpt, grads_ckpt) = results
    assert ckpt == pytest.approx(plain, rel=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_ckpt[name], grad, rtol=1e-4, atol=1e-6)


def test_a_malformed_safetensors_header_is_refused_naming_the_file(tmp_path: Path,
                                                                   model: Path) -> None:
    spans = read_header(model / "model.safetensors")
    assert spans and all(s.end > s.begin for s in spans.values())
    bad = tmp_path / "model.safetensors"
    header = json.dumps({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 8]}})
    bad.write_bytes(len(header).to_bytes(8, "little") + header.encode() + bytes(8))
    with pytest.raises(TrainError, match=r"model\.safetensors: tensor 'w' .* does not fit"):
        read_header(bad)
    bad.write_bytes((10**12).to_bytes(8, "little") + b"{}")
    with pytest.raises(TrainError, match="header length 1000000000000 is impossible"):
        read_header(bad)


@pytest.mark.parametrize(("rows", "world"), [(10, 4), (3, 4), (8, 2), (0, 3)])
def test_shard_rows_cut_dim_0_like_torch_chunk(rows: int, world: int) -> None:
    chunks = torch.arange(rows).chunk(world) if rows else ()
    for rank in range(world):
        start, end = shard_rows(rows, world, rank)
        expected = chunks[rank].tolist() if rank < len(chunks) else []
        assert list(range(start, end)) == expected


@pytest.mark.slow
def test_the_gpu_check_runs_its_path_on_gloo_and_refuses_without_a_gpu() -> None:
    """benchmarks/gpu_check.py: on CPU ranks the same load, step, save and reload (the
    checkpoint holds the trained weights bit for bit and its logits match the trainer's
    model); asked for CUDA here, it says why not."""
    script = ROOT / "benchmarks" / "gpu_check.py"
    small = ["--hidden", "128", "--layers", "2", "--heads", "4", "--seq", "32"]
    done = subprocess.run([sys.executable, str(script), "--device", "cpu", "--vllm", "",
                           *small], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "on 2 cpu rank(s)" in done.stdout, done.stdout
    assert "every trained parameter bit for bit: yes" in done.stdout, done.stdout
    assert "(OK, tolerance 1.00e-04)" in done.stdout, done.stdout
    # Its delta update into vLLM (benchmarks/vllm_delta_update.py) needs an executable:
    # without one it says so and passes (run by hand on vLLM's CPU build: BENCHMARKS 11).
    assert "vllm delta update: skipped, no vllm executable" in done.stdout, done.stdout
    # The resident trainer's two iterations: nothing moves on a CPU, the weights hold.
    assert done.stdout.count("nothing moves on CPU): GPU memory still reserved while the "
                             "engine has the GPU 0 MiB; weights back from CPU memory unchanged: "
                             "True") == 2, done.stdout
    if not torch.cuda.is_available():
        refused = subprocess.run([sys.executable, str(script), *small], capture_output=True,
                                 text=True, timeout=120)
        assert refused.returncode == 2 and "no CUDA device is visible here" in refused.stderr


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True], ids=["own-lm-head", "tied-embeddings"])
def test_a_checkpoint_saved_shard_by_shard_verifies_and_loads_in_the_hf_engine(
        model: Path, tmp_path: Path, tied: bool) -> None:
    """3 ranks save their shards, rank 0 consolidates and publishes: the manifest
    verifies, the staging directory is gone, and the hf engine's loader reads back
    exactly the weights that were loaded.  Tied: a Qwen2-shaped model whose lm_head
    is its embedding matrix, one parameter under two names, saved once (safetensors
    refuses two names of one storage)."""
    from safetensors.torch import load_file

    from rollout.hf.weights import load_safetensors
    from trainer.architectures import create_model, preset
    from trainer.checkpoint import verify_checkpoint
    from trainer.sharded_save import staging_dir

    if tied:
        model = create_model(tmp_path / "tied", preset("qwen2", "tiny",
                                                       tie_word_embeddings=True))
    script = tmp_path / "save.py"
    script.write_text(SAVE)
    out = tmp_path / "checkpoints" / "iter-000005"
    out.parent.mkdir()
    torchrun(3, str(script), str(model), str(out))
    assert verify_checkpoint(out).iteration == 5
    assert not staging_dir(out).exists()
    saved = load_safetensors(out, torch=torch)
    original = load_file(str(model / "model.safetensors"))
    assert saved.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(saved[name], tensor), name


@pytest.mark.slow
def test_gathered_on_3_ranks_every_tensor_is_the_models_whole_once_on_rank_0_alone(
        tmp_path: Path) -> None:
    """trainer/sharded_save.py's gather: uneven dim-0 splits (3 ranks), a tied matrix
    under its first name only; rank 0 holds every tensor whole in CPU memory, in the
    checkpoint's dtype, the others nothing."""
    from trainer.architectures import create_model, preset

    model = create_model(tmp_path / "tied", preset("qwen2", "tiny", tie_word_embeddings=True))
    script = tmp_path / "gather.py"
    script.write_text(GATHER)
    rows = {r["rank"]: r for r in torchrun(3, str(script), str(model))}
    assert sorted(rows) == [0, 1, 2] and rows[1]["none"] and rows[2]["none"]
    assert not rows[0]["none"] and rows[0]["names"] and rows[0]["cpu_bf16"], rows[0]
    assert rows[0]["unequal"] == [], rows[0]

