"""Adam's moments and step count carry from one training iteration to the next."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rollout.batch_format import TrainBatch
from rollout.train_batch import save_train_batch
from trainer.config import Strategy, TrainConfig, TrainJob
from trainer.distributed import DistContext
from trainer.optim_state import (
    load_optimizer_state,
    optimizer_state_path,
    restore_optimizer,
    save_optimizer,
)
from trainer.tiny_model import create_tiny_model

REPO = Path(__file__).resolve().parents[2]
SINGLE = DistContext(
    rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), strategy=Strategy.DDP
)


def job_for(
    tmp: Path, iteration: int, model_dir: Path, ref: Path | None = None, **config: object
) -> TrainJob:
    return TrainJob(
        iteration=iteration,
        model_dir=model_dir,
        ref_model_dir=ref,
        batch_path=tmp / f"batch-{iteration}.pt",
        out_dir=tmp / f"ckpt-{iteration}",
        optim_dir=tmp / "optim",
        metrics_path=tmp / f"metrics-{iteration}.json",
        config=TrainConfig(**config),  # type: ignore[arg-type]
    )


def adam_after_steps(steps: int, lr: float = 0.01) -> tuple[torch.nn.Module, torch.optim.AdamW]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 4)).square().sum().backward()
        opt.step()
    return model, opt


def test_restored_moments_and_step_equal_what_was_saved(tmp_path: Path) -> None:
    _, saved_opt = adam_after_steps(3)
    save_optimizer(saved_opt, job_for(tmp_path, 1, tmp_path / "m"), SINGLE, step=3)

    fresh_model, _ = adam_after_steps(0)
    fresh = torch.optim.AdamW(fresh_model.parameters(), lr=0.5)
    start = restore_optimizer(fresh, job_for(tmp_path, 2, tmp_path / "m", lr=0.002), SINGLE)
    assert start == 3
    saved, restored = saved_opt.state_dict()["state"], fresh.state_dict()["state"]
    assert saved.keys() == restored.keys()
    for i in saved:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(saved[i][key], restored[i][key]), (i, key)
    # Hyper-parameters come from this iteration's config, not the saved file.
    assert fresh.param_groups[0]["lr"] == 0.002


def test_no_saved_state_starts_fresh_and_a_corrupt_file_is_ignored(tmp_path: Path) -> None:
    model, _ = adam_after_steps(0)
    opt = torch.optim.AdamW(model.parameters())
    job = job_for(tmp_path, 1, tmp_path / "m")
    assert restore_optimizer(opt, job, SINGLE) == 0
    optimizer_state_path(job.optim_dir, 0).parent.mkdir(parents=True)
    optimizer_state_path(job.optim_dir, 0).write_bytes(b"not a torch file")
    assert restore_optimizer(opt, job, SINGLE) == 0
    assert opt.state_dict()["state"] == {}


def test_a_retried_iteration_restores_the_state_from_before_its_first_attempt(
    tmp_path: Path,
) -> None:
    _, opt1 = adam_after_steps(2)
    _, opt2 = adam_after_steps(5)
    save_optimizer(opt1, job_for(tmp_path, 1, tmp_path / "m"), SINGLE, step=2)
    save_optimizer(opt2, job_for(tmp_path, 2, tmp_path / "m"), SINGLE, step=5)
    # Iteration 2 is run again (its checkpoint never appeared): it must start
    # from iteration 1's state, now kept as the .prev file.
    state = load_optimizer_state(tmp_path / "optim", rank=0, before_iteration=2)
    assert state is not None and (state.iteration, state.step) == (1, 2)
    state = load_optimizer_state(tmp_path / "optim", rank=0, before_iteration=3)
    assert state is not None and (state.iteration, state.step) == (2, 5)


def write_batches(tmp: Path, model_dir: Path, iterations: int = 2) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    prompts, responses, rewards, tasks, groups = [], [], [], [], []
    for g, digits in enumerate(["4021", "37", "815"]):
        for k, answer in enumerate([digits[::-1], digits, digits[::-1] + "0"]):
            prompts.append(tok(f"{digits}>").input_ids)
            responses.append([*tok(answer, add_special_tokens=False).input_ids, tok.eos_token_id])
            rewards.append(1.0 if k == 0 else 0.0)
            tasks.append(f"reverse/train/{g:06d}")
            groups.append(g)
    for it in range(1, iterations + 1):
        save_train_batch(
            tmp / f"batch-{it}.pt",
            TrainBatch.from_lists(
                iteration=it,
                group_size=3,
                task_ids=tasks,
                group_index=torch.tensor(groups),
                prompt_ids=prompts,
                response_ids=responses,
                old_logprobs=[[-1.0] * len(r) for r in responses],
                rewards=torch.tensor(rewards),
            ),
        )


def train(job: TrainJob, tmp: Path) -> dict:
    path = tmp / f"job-{job.iteration}.json"
    job.save(path)
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.train", "--job", str(path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(job.metrics_path.read_text())


@pytest.mark.slow
def test_two_iterations_continue_the_step_count_and_a_retry_reproduces_the_checkpoint(
    tmp_path: Path,
) -> None:
    model_dir = create_tiny_model(tmp_path / "model", seed=0)
    write_batches(tmp_path, model_dir)
    config = dict(epochs=2, mini_batch_size=5, micro_batch_size=3, lr=1e-3, warmup_steps=0)
    first = train(job_for(tmp_path, 1, model_dir, **config), tmp_path)
    assert (first["optimizer_step_start"], first["optimizer_step_end"]) == (0, 4)

    second_job = job_for(tmp_path, 2, tmp_path / "ckpt-1", **config)
    second = train(second_job, tmp_path)
    assert (second["optimizer_step_start"], second["optimizer_step_end"]) == (4, 8)
    saved = torch.load(optimizer_state_path(tmp_path / "optim", 0), weights_only=True)
    assert saved["iteration"] == 2 and saved["step"] == 8
    assert {int(s["step"]) for s in saved["optimizer"]["state"].values()} == {8}

    # Running iteration 2 again restores iteration 1's state, so it computes
    # the same update, and republishing the identical checkpoint is accepted.
    again = train(second_job, tmp_path)
    assert again["optimizer_step_start"] == 4
    assert again["checkpoint_digest"] == second["checkpoint_digest"]
    assert again["params_sha256"] == second["params_sha256"]


def torchrun_pair(job: Path, tmp: Path, name: str) -> list[str]:
    """Run `job` on two single-process torchrun nodes; return both logs."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    procs, logs = [], []
    try:
        for rank in (0, 1):
            log = tmp / f"{name}-{rank}.log"
            logs.append(log)
            with log.open("wb") as out:
                procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "torch.distributed.run",
                            "--nnodes",
                            "2",
                            "--nproc-per-node",
                            "1",
                            "--node-rank",
                            str(rank),
                            "--master-addr",
                            "127.0.0.1",
                            "--master-port",
                            str(port),
                            "-m",
                            "trainer.train",
                            "--job",
                            str(job),
                        ],
                        cwd=REPO,
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        codes = [p.wait(timeout=150) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    texts = [log.read_text() for log in logs]
    assert codes == [0, 0], "\n".join(t[-3000:] for t in texts)
    return texts


@pytest.mark.slow
@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_fsdp2_shards_of_the_optimizer_state_carry_over_on_both_ranks(
        tmp_path: Path, param_dtype: str) -> None:
    """Also with train.param_dtype bfloat16: bf16 parameters (and checkpoint), the
    optimizer's copies and moments in fp32 (trainer/master_weights.py)."""
    model_dir = create_tiny_model(tmp_path / "model", seed=0)
    write_batches(tmp_path, model_dir)
    config = dict(
        strategy="fsdp2", epochs=2, micro_batch_size=2, lr=1e-3, warmup_steps=0, kl_coef=0.05,
        param_dtype=param_dtype,
    )
    jobs = []
    for it, source in ((1, model_dir), (2, tmp_path / "ckpt-1")):
        job = job_for(tmp_path, it, source, ref=model_dir, **config)
        job.save(tmp_path / f"job-{it}.json")
        jobs.append(tmp_path / f"job-{it}.json")
    torchrun_pair(jobs[0], tmp_path, "first")
    logs = torchrun_pair(jobs[1], tmp_path, "second")
    for text in logs:
        assert "restored optimizer state of iteration 1 (step 2)" in text
    digests = [re.findall(r"params sha256 ([0-9a-f]{64})", t) for t in logs]
    assert len(digests[0]) == 1 and digests[0] == digests[1]
    metrics = json.loads((tmp_path / "metrics-2.json").read_text())
    assert metrics["strategy"] == "fsdp2" and metrics["optimizer_step_end"] == 4
    assert metrics["kl"] > 0
    for rank in (0, 1):
        saved = torch.load(optimizer_state_path(tmp_path / "optim", rank), weights_only=True)
        assert saved["world_size"] == 2 and saved["step"] == 4
        moments = [v["exp_avg"] for v in saved["optimizer"]["state"].values()]
        assert moments and all(m.dtype == torch.float32 for m in moments)
    from trainer.sharded_load import read_header

    stored = {span.dtype for span in read_header(next((tmp_path / "ckpt-2").glob(
        "*.safetensors"))).values()}
    assert stored == {torch.bfloat16 if param_dtype == "bfloat16" else torch.float32}
