"""The resumable training state: weights, Adam's moments and the step, saved every few
iterations, resumed by a new trainer, with the iterations since replayed."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rollout.batch_format import TrainBatch
from rollout.errors import CheckpointError
from rollout.train_batch import save_train_batch
from trainer import train_state
from trainer.architectures import create_model, preset
from trainer.config import Strategy, TrainConfig
from trainer.distributed import DistContext
from trainer.job import TrainJob
from trainer.policy import param_digest
from trainer.session import Session, open_session
from trainer.tiny_model import create_tiny_model
from trainer.train import prepare, train_iteration

REPO = Path(__file__).resolve().parents[2]
SINGLE = DistContext(
    rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), strategy=Strategy.DDP
)


def job_for(
    tmp: Path, iteration: int, model_dir: Path, ref: Path | None = None, **fields: object
) -> TrainJob:
    config = {k: v for k, v in fields.items() if k in TrainConfig.__dataclass_fields__}
    rest = {k: v for k, v in fields.items() if k not in config}
    return TrainJob(
        iteration=iteration,
        model_dir=model_dir,
        ref_model_dir=ref,
        batch_path=tmp / f"batch-{iteration}.pt",
        out_dir=tmp / f"ckpt-{iteration}",
        state_dir=tmp / "state",
        metrics_path=tmp / f"metrics-{iteration}.json",
        config=TrainConfig(**config),  # type: ignore[arg-type]
        **rest,  # type: ignore[arg-type]
    )


def trained_session(tmp: Path, model_dir: Path, steps: int) -> Session:
    """A session on the tiny model whose Adam took `steps` steps on a fixed loss."""
    session = open_session(job_for(tmp, 1, model_dir, lr=0.01), SINGLE)
    torch.manual_seed(0)
    for _ in range(steps):
        session.optimizer.zero_grad()
        ids = torch.randint(0, 16, (2, 5))
        session.model(input_ids=ids).logits.square().mean().backward()
        session.optimizer.step()
    session.step = steps
    return session


def test_a_saved_state_restores_weights_moments_and_step(tmp_path: Path) -> None:
    model_dir = create_tiny_model(tmp_path / "model", seed=0)
    saved = trained_session(tmp_path, model_dir, steps=3)
    saved.save_state(tmp_path / "state", 4)
    (index,) = train_state.complete_state(train_state.state_dir(tmp_path / "state", 4))
    assert (index.iteration, index.step, index.shards) == (4, 3, 1)

    job = job_for(tmp_path, 5, model_dir, lr=0.002,
                  resume_state=train_state.state_dir(tmp_path / "state", 4))
    fresh = open_session(job, SINGLE)
    assert (fresh.step, fresh.through, fresh.resumed["from_state"]) == (3, 4, 4)
    for (name, a), (_, b) in zip(saved.model.named_parameters(), fresh.model.named_parameters(),
                                 strict=True):
        assert torch.equal(a, b), name
    before, after = saved.optimizer.state_dict()["state"], fresh.optimizer.state_dict()["state"]
    assert before.keys() == after.keys() and before
    for i in before:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(before[i][key], after[i][key]), (i, key)
    # Hyper-parameters come from this run's config, not the saved file.
    assert fresh.optimizer.param_groups[0]["lr"] == 0.002


@pytest.mark.usefixtures("quick_read_retry")
def test_an_incomplete_or_altered_state_is_skipped_for_an_older_one_or_none(
        tmp_path: Path) -> None:
    model_dir = create_tiny_model(tmp_path / "model", seed=0)
    root = tmp_path / "state"
    session = trained_session(tmp_path, model_dir, steps=1)
    session.save_state(root, 2)
    session.save_state(root, 5)
    assert train_state.newest_complete(root, before=9)[0] == 5  # type: ignore[index]
    # A retried iteration 5 resumes from before its first attempt.
    assert train_state.newest_complete(root, before=5)[0] == 2  # type: ignore[index]
    # An index without its sibling shards (a save cut short) is not a state.
    newest = train_state.state_dir(root, 5)
    index = json.loads((newest / "shard-0.json").read_text())
    (newest / "shard-0.json").write_text(json.dumps({**index, "shards": 2, "world_size": 2}))
    with pytest.raises(CheckpointError, match="shard 1 of 2 is missing"):
        train_state.complete_state(newest)
    assert train_state.newest_complete(root, before=9)[0] == 2  # type: ignore[index]
    # A shard whose bytes changed after its index was written is refused by name ...
    older = train_state.state_dir(root, 2)
    data = bytearray((older / "shard-0.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (older / "shard-0.pt").write_bytes(bytes(data))
    (index,) = train_state.complete_state(older)
    with pytest.raises(CheckpointError, match=r"shard-0\.pt: unusable training state"):
        train_state.load_shard(older, index)
    # ... and a session asked to resume from it starts from the job's model, fresh Adam.
    fresh = open_session(job_for(tmp_path, 3, model_dir, resume_state=older), SINGLE)
    assert fresh.resumed.get("fresh_optimizer") and fresh.step == 0 and fresh.through == 2
    assert fresh.optimizer.state_dict()["state"] == {}
    # Older states go once a newer complete one exists.
    assert train_state.prune(root, keep=5) == [2]
    assert train_state.saved_iterations(root) == [5]


def test_a_state_whose_weights_name_another_model_starts_fresh_with_the_reason_logged(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # A state with a tensor this model does not have, as an FSDP2 trainer saved a
    # tied model's lm_head apart from its embedding before the tie was kept on the
    # meta build. Its optimizer state fits: only the weights' names tell.
    model_dir = create_tiny_model(tmp_path / "model", seed=0)
    session = trained_session(tmp_path, model_dir, steps=1)
    weights = session.master_weights()
    weights["extra.weight"] = torch.zeros(3, 4)
    directory = train_state.state_dir(tmp_path / "state", 2)
    train_state.save_shard(directory, iteration=2, shard=0, shards=1, world_size=1,
                           strategy="ddp", step=1, weights=weights,
                           optimizer=session.optimizer.state_dict())
    with caplog.at_level("WARNING"):
        fresh = open_session(job_for(tmp_path, 3, model_dir, resume_state=directory), SINGLE)
    assert fresh.resumed.get("fresh_optimizer") and fresh.step == 0 and fresh.through == 2
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "unexpected ['extra.weight']" in logged and "fresh Adam moments" in logged


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
def test_a_new_trainer_resumes_from_the_saved_state_and_replays_to_the_same_weights(
    tmp_path: Path,
) -> None:
    # A bf16 model (trainer/architectures.py): its checkpoints are bf16, so only the
    # saved state's fp32 master weights let a new trainer end where the old one did.
    model_dir = create_model(tmp_path / "model", preset("qwen2", "tiny", num_hidden_layers=1))
    write_batches(tmp_path, model_dir, iterations=3)
    config = dict(epochs=2, mini_batch_size=5, micro_batch_size=3, lr=1e-3, warmup_steps=0)
    jobs = {it: job_for(tmp_path, it, tmp_path / f"ckpt-{it - 1}" if it > 1 else model_dir,
                        save_state=it == 1, **config) for it in (1, 2, 3)}
    for it, job in jobs.items():
        job.save(tmp_path / f"job-{it}.json")
    # A resident trainer: one session for the three iterations, the state saved after 1.
    # One thread, as the trainer processes run (OMP_NUM_THREADS=1): the same sums.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        session = prepare(jobs[1], SINGLE)
        resident = [train_iteration(session, jobs[it]) for it in (1, 2, 3)]
    finally:
        torch.set_num_threads(threads)
    assert [(m["optimizer_step_start"], m["optimizer_step_end"]) for m in resident] == [
        (0, 4), (4, 8), (8, 12)]
    assert [m["state_saved"] for m in resident] == [True, False, False]
    assert resident[0]["resumed"]["from_state"] is None and resident[1]["resumed"] is None

    # The trainer is lost after iteration 2: a new one, in a process of its own, resumes
    # from the state of iteration 1, trains iteration 2 again from its kept batch, then 3.
    again = dataclasses.replace(
        jobs[3], out_dir=tmp_path / "ckpt-3-again", metrics_path=tmp_path / "metrics-3-again.json",
        resume_state=train_state.state_dir(tmp_path / "state", 1),
        replay=(tmp_path / "job-2.json",))
    redone = train(again, tmp_path)
    assert redone["resumed"]["from_state"] == 1
    assert redone["resumed"]["replayed"] == [{"iteration": 2, "matches": True}]
    assert redone["optimizer_step_start"] == 8
    assert redone["params_sha256"] == resident[2]["params_sha256"]
    assert redone["checkpoint_digest"] == resident[2]["checkpoint_digest"]
    # What the checkpoint holds is not the masters: resuming from it would differ.
    from transformers import AutoModelForCausalLM

    assert json.loads((tmp_path / "ckpt-3" / "config.json").read_text())["dtype"] == "bfloat16"
    published = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt-3", dtype=torch.float32)
    assert param_digest(published) != resident[2]["params_sha256"]

    # With no state saved yet, a new trainer starts from the initial model and replays all.
    scratch = dataclasses.replace(
        again, out_dir=tmp_path / "ckpt-3-scratch", resume_state=None,
        resume_model_dir=model_dir, metrics_path=tmp_path / "metrics-3-scratch.json",
        replay=(tmp_path / "job-1.json", tmp_path / "job-2.json"))
    from_scratch = train(scratch, tmp_path)
    assert [r["matches"] for r in from_scratch["resumed"]["replayed"]] == [True, True]
    assert from_scratch["params_sha256"] == resident[2]["params_sha256"]

    # Iteration 1's metrics lost: its replay is compared with nothing, which is no
    # difference (null), where it used to read as one (false).
    jobs[1].metrics_path.unlink()
    unread = train(dataclasses.replace(scratch, out_dir=tmp_path / "ckpt-3-unread",
                                       metrics_path=tmp_path / "metrics-3-unread.json"), tmp_path)
    assert unread["resumed"]["replayed"] == [{"iteration": 1, "matches": None},
                                             {"iteration": 2, "matches": True}]


def torchrun_pair(job: Path, tmp: Path, name: str) -> list[str]:
    """Run `job` on two single-process torchrun nodes; return both logs."""
    from tests.trainer.test_train_torchrun import free_port, run_processes, torchrun

    port = free_port()
    logs = [tmp / f"{name}-{rank}.log" for rank in (0, 1)]
    codes = run_processes([torchrun(rank, port, job) for rank in (0, 1)], logs)
    texts = [log.read_text() for log in logs]
    assert codes == [0, 0], "\n".join(t[-3000:] for t in texts)
    return texts


@pytest.mark.slow
@pytest.mark.parametrize(("param_dtype", "model"), [("float32", "qwen2"), ("bfloat16", "char")])
def test_fsdp2_shards_of_the_training_state_carry_over_on_both_ranks(
        tmp_path: Path, param_dtype: str, model: str) -> None:
    """fp32 parameters of a bf16 model (Qwen2-shaped), and with train.param_dtype
    bfloat16 bf16 parameters of the fp32 character model, the optimizer's copies and
    moments in fp32 (trainer/master_weights.py): each rank casts its shards to the
    model's own dtype for the checkpoint."""
    model_dir = create_tiny_model(tmp_path / "model", seed=0) if model == "char" else \
        create_model(tmp_path / "model", preset("qwen2", "tiny"))
    write_batches(tmp_path, model_dir)
    config = dict(
        strategy="fsdp2", epochs=2, micro_batch_size=2, lr=1e-3, warmup_steps=0, kl_coef=0.05,
        param_dtype=param_dtype,
    )
    jobs = []
    state = train_state.state_dir(tmp_path / "state", 1)
    for it, source in ((1, model_dir), (2, tmp_path / "ckpt-1")):
        job = job_for(tmp_path, it, source, ref=model_dir, save_state=True,
                      resume_state=state if it == 2 else None, **config)
        job.save(tmp_path / f"job-{it}.json")
        jobs.append(tmp_path / f"job-{it}.json")
    torchrun_pair(jobs[0], tmp_path, "first")
    # Each rank saved its own slices: two shards, each indexed.
    assert [i.shard for i in train_state.complete_state(state)] == [0, 1]
    logs = torchrun_pair(jobs[1], tmp_path, "second")
    for text in logs:
        assert "resumed from the training state of iteration 1 (step 2)" in text
    digests = [re.findall(r"params sha256 ([0-9a-f]{64})", t) for t in logs]
    assert len(digests[0]) == 1 and digests[0] == digests[1]
    metrics = json.loads((tmp_path / "metrics-2.json").read_text())
    assert metrics["strategy"] == "fsdp2" and metrics["optimizer_step_end"] == 4
    assert metrics["kl"] > 0
    newer = train_state.state_dir(tmp_path / "state", 2)
    for index in train_state.complete_state(newer):
        saved = train_state.load_shard(newer, index)
        assert index.world_size == 2 and index.step == 4
        moments = [v["exp_avg"] for v in saved.optimizer["state"].values()]
        assert moments and all(m.dtype == torch.float32 for m in moments)
        # The master weights are fp32, also beside bf16 parameters.
        assert {w.dtype for w in saved.weights.values()} == {torch.float32}
    from trainer.sharded_load import read_header

    stored = {span.dtype for span in read_header(next((tmp_path / "ckpt-2").glob(
        "*.safetensors"))).values()}
    assert stored == {torch.bfloat16 if model == "qwen2" else torch.float32}
