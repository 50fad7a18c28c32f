"""Two torchrun "nodes" on localhost (gloo) train one GRPO iteration together."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rollout.batch_format import TrainBatch
from rollout.train_batch import save_train_batch
from trainer.checkpoint import verify_checkpoint
from trainer.config import TrainConfig
from trainer.job import TrainJob
from trainer.tiny_model import create_tiny_model

REPO = Path(__file__).resolve().parents[2]
DEADLINE_S = 150.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    # A damaged file is reported after 1 s of re-reads, not the default 5 s.
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO),
               COORDINATOR_READ_RETRY_S="1")
    return env


def write_batch(
    path: Path, tokenizer_dir: Path, group_sizes: list[int], *, poison: int | None = None
) -> None:
    """Groups of right (reward 1) and wrong (reward 0) answers to reversal prompts."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    digits = ["4021", "379", "55", "8163", "207"]
    rows: dict[str, list] = {k: [] for k in ("task", "group", "prompt", "response", "reward")}
    for g, size in enumerate(group_sizes):
        d = digits[g % len(digits)]
        for k in range(size):
            answer = d[::-1] if k % 2 == 0 else d
            rows["task"].append(f"reverse/train/{g:06d}")
            rows["group"].append(g)
            rows["prompt"].append(tok(f"{d}>").input_ids)
            rows["response"].append(
                [*tok(answer, add_special_tokens=False).input_ids, tok.eos_token_id]
            )
            rows["reward"].append(1.0 if answer == d[::-1] else 0.0)
    if poison is not None:
        rows["response"][1][0] = poison
    batch = TrainBatch.from_lists(
        iteration=1,
        group_size=max(group_sizes, default=2),
        task_ids=rows["task"],
        group_index=torch.tensor(rows["group"], dtype=torch.int64),
        prompt_ids=rows["prompt"],
        response_ids=rows["response"],
        old_logprobs=[[-2.0] * len(r) for r in rows["response"]],
        rewards=torch.tensor(rows["reward"], dtype=torch.float32),
    )
    save_train_batch(path, batch)


def make_job(tmp: Path, model_dir: Path, name: str, **config: object) -> Path:
    job = TrainJob(
        iteration=1,
        model_dir=model_dir,
        ref_model_dir=model_dir,
        batch_path=tmp / "batch.pt",
        out_dir=tmp / name / "checkpoint",
        state_dir=tmp / name / "state",
        metrics_path=tmp / name / "metrics.json",
        config=TrainConfig(**config),  # type: ignore[arg-type]
        save_state=True,
    )
    path = tmp / f"{name}.json"
    job.save(path)
    return path


def run_processes(commands: list[list[str]], logs: list[Path]) -> list[int]:
    """Start all commands at once; kill every process group at the deadline; always reap."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for cmd, log_path in zip(commands, logs, strict=True):
            with log_path.open("wb") as out:
                procs.append(
                    subprocess.Popen(
                        cmd,
                        cwd=REPO,
                        env=child_env(),
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        end = time.monotonic() + DEADLINE_S
        for p in procs:
            p.wait(timeout=max(1.0, end - time.monotonic()))
        return [p.returncode for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def torchrun(node_rank: int, port: int, job: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--node-rank",
        str(node_rank),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        "-m",
        "trainer.train",
        "--job",
        str(job),
    ]


def digests(log: Path) -> list[str]:
    return re.findall(r"params sha256 ([0-9a-f]{64})", log.read_text())


@pytest.mark.slow
def test_two_nodes_end_with_identical_weights_and_match_a_single_process(tmp_path: Path) -> None:
    model_dir = create_tiny_model(tmp_path / "model", seed=0)
    # 13 samples: rank 0 owns 7, rank 1 owns 6, so with 2 samples per
    # micro-batch rank 1 runs one zero-weight pass to keep DDP in step.
    write_batch(tmp_path / "batch.pt", model_dir, [4, 4, 3, 2])
    config = dict(lr=1e-3, warmup_steps=0, epochs=4, micro_batch_size=2, seed=3)
    two = make_job(tmp_path, model_dir, "two", **config)
    one = make_job(tmp_path, model_dir, "one", **config)
    port = free_port()
    logs = [tmp_path / "node0.log", tmp_path / "node1.log", tmp_path / "single.log"]
    codes = run_processes(
        [
            torchrun(0, port, two),
            torchrun(1, port, two),
            [sys.executable, "-m", "trainer.train", "--job", str(one)],
        ],
        logs,
    )
    assert codes == [0, 0, 0], "\n".join(p.read_text()[-3000:] for p in logs)

    # Both ranks hold the same weights, and they moved from the start.
    (d0,), (d1,) = digests(logs[0]), digests(logs[1])
    assert d0 == d1
    verify_checkpoint(tmp_path / "two" / "checkpoint")
    before = load_file(model_dir / "model.safetensors")
    after = load_file(tmp_path / "two" / "checkpoint" / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    # DDP's replicas are equal: trainer rank 0 saves the one shard of the state.
    assert sorted(p.name for p in (tmp_path / "two" / "state" / "iter-000001").iterdir()) == [
        "shard-0.json",
        "shard-0.pt",
    ]

    # The PPO loss on the fixed batch falls over the four steps.
    metrics = json.loads((tmp_path / "two" / "metrics.json").read_text())
    losses = metrics["loss_per_step"]
    assert metrics["world_size"] == 2 and metrics["steps"] == 4
    assert losses[-1] < losses[0] - 0.05, losses
    assert metrics["optimizer_step_end"] == 4

    # Token-sum normalisation makes two ranks compute the one-process gradient.
    single = json.loads((tmp_path / "one" / "metrics.json").read_text())
    assert losses == pytest.approx(single["loss_per_step"], rel=1e-3, abs=1e-5)
    assert metrics["grad_norm_per_step"] == pytest.approx(single["grad_norm_per_step"], rel=1e-3)


def test_a_broken_job_exits_non_zero_with_a_clear_message(tmp_path: Path) -> None:
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"schema": "coordinator/train-job", "version": 2, "iteration": 1}))
    proc = run_trainer(job)
    assert proc.returncode == 2
    assert "train job is missing field 'model_dir'" in proc.stderr


def run_trainer(job: Path) -> subprocess.CompletedProcess[str]:
    """`python -m trainer.train --job JOB` alone (no torchrun), as a test runs it."""
    return subprocess.run([sys.executable, "-m", "trainer.train", "--job", str(job)], cwd=REPO,
                          env=child_env(), capture_output=True, text=True, timeout=60)


def test_a_batch_from_another_tokenizer_is_refused_naming_the_sample(tmp_path: Path) -> None:
    model_dir = create_tiny_model(tmp_path / "model", seed=0)
    write_batch(tmp_path / "batch.pt", model_dir, [2], poison=50_000)
    job = make_job(tmp_path, model_dir, "bad")
    proc = run_trainer(job)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (
        "sample 1 (reverse/train/000000) has response token id 50000 outside the model's vocabulary"
        in proc.stderr
    )
    assert not (tmp_path / "bad" / "checkpoint").exists()


def test_an_altered_model_checkpoint_exits_2_naming_the_file(tmp_path: Path) -> None:
    from trainer.warmstart import build_initial_model

    model_dir = tmp_path / "model"
    build_initial_model(model_dir, seed=0, warmstart_steps=0)  # a published checkpoint
    write_batch(tmp_path / "batch.pt", model_dir, [2])
    with (model_dir / "config.json").open("ab") as f:
        f.write(b"\n")  # still valid JSON, no longer what the manifest lists
    job = make_job(tmp_path, model_dir, "altered")
    proc = run_trainer(job)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "trainer: error: " in proc.stderr
    # Named by the copy that hashes it as it reads it (trainer/policy.py readable).
    assert f"{model_dir / 'config.json'}: " in proc.stderr and "altered" in proc.stderr
    assert not (tmp_path / "altered" / "checkpoint").exists()


def test_the_trainer_dies_with_its_parent(tmp_path: Path) -> None:
    import psutil

    # Rank 0 of a world of 2 blocks in init_process_group waiting for rank 1:
    # a stand-in for a rank whose torchrun agent is killed mid-collective.
    job = make_job(tmp_path, tmp_path / "model", "orphan")
    env = child_env()
    env.update(
        RANK="0",
        WORLD_SIZE="2",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )
    parent_code = (
        "import subprocess, sys; "
        f"p = subprocess.Popen([sys.executable, '-m', 'trainer.train', '--job', {str(job)!r}]); "
        "print(p.pid, flush=True); p.wait()"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert parent.stdout is not None
        child = psutil.Process(int(parent.stdout.readline()))
        deadline = time.monotonic() + 60
        # Wait until the trainer is past start-up (it has imported torch and
        # opened the rendezvous port) before killing its parent.
        while not child.net_connections(kind="tcp") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert child.is_running()
        parent.kill()
        parent.wait()
        gone = time.monotonic() + 10
        while time.monotonic() < gone:
            if not child.is_running() or child.status() == psutil.STATUS_ZOMBIE:
                break
            time.sleep(0.1)
        else:
            pytest.fail("the trainer outlived its parent by 10 s")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()


def test_a_job_round_trips_through_json_and_bad_fields_are_named(tmp_path: Path) -> None:
    from trainer.config import ConfigError

    job = make_job(tmp_path, tmp_path / "model", "rt", lr=3e-4, betas=(0.9, 0.95), kl_coef=0.1)
    loaded = TrainJob.load(job)
    assert loaded.config.lr == 3e-4 and loaded.config.betas == (0.9, 0.95)
    assert loaded.to_json() == job.read_text()

    data = json.loads(job.read_text())
    data["future_field"] = "ignored"  # newer writers may add fields
    assert TrainJob.from_json(json.dumps(data)) == loaded
    data["config"]["micro_batch_size"] = 2.5
    with pytest.raises(
        ConfigError, match=r"train\.micro_batch_size=2\.5 must be an integer"
    ):
        TrainJob.from_json(json.dumps(data))
    data["config"]["micro_batch_size"] = 2
    data["config"]["strategy"] = "zero3"
    with pytest.raises(ConfigError, match="strategy='zero3' is not one of: auto, ddp, fsdp2"):
        TrainJob.from_json(json.dumps(data))
    data["version"] = 9
    with pytest.raises(ConfigError, match="has version 9; this trainer reads version 2"):
        TrainJob.from_json(json.dumps(data))
    with pytest.raises(ConfigError, match=r"kl_coef=0\.1 needs a reference model"):
        TrainJob(
            iteration=1,
            model_dir=tmp_path,
            ref_model_dir=None,
            batch_path=tmp_path,
            out_dir=tmp_path / "o",
            state_dir=tmp_path,
            metrics_path=tmp_path,
            config=TrainConfig(kl_coef=0.1),
        )


def test_a_stale_batch_from_another_iteration_is_refused(tmp_path: Path) -> None:
    from trainer.config import Strategy
    from trainer.errors import TrainError
    from trainer.train import DistContext, run

    model_dir = create_tiny_model(tmp_path / "model", seed=0)
    write_batch(tmp_path / "batch.pt", model_dir, [2])  # written for iteration 1
    job = TrainJob.load(make_job(tmp_path, model_dir, "stale"))
    job = TrainJob.from_json(job.to_json().replace('"iteration": 1', '"iteration": 2'))
    ctx = DistContext(
        rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), strategy=Strategy.DDP
    )
    with pytest.raises(TrainError, match="holds the batch of iteration 1, but this is iteration 2"):
        run(job, ctx)
    assert not job.out_dir.exists()


def test_an_empty_batch_is_refused_and_no_model_is_published(tmp_path: Path) -> None:
    from trainer.config import Strategy
    from trainer.errors import TrainError
    from trainer.train import DistContext, run

    model_dir = create_tiny_model(tmp_path / "model", seed=0)
    write_batch(tmp_path / "batch.pt", model_dir, [])
    job = TrainJob.load(make_job(tmp_path, model_dir, "empty"))
    ctx = DistContext(
        rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), strategy=Strategy.DDP
    )
    with pytest.raises(TrainError, match="holds no samples: nothing to train on"):
        run(job, ctx)
    assert not job.out_dir.exists()
