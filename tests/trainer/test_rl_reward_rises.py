"""RL works at all: sampling + GRPO updates raise the reversal task's reward.

Single process, no server: each iteration samples groups of answers from the
current checkpoint with transformers' generate, scores them by exact match,
writes a real train-batch file and runs the trainer's real iteration
(`trainer.train.train_iteration`, on one session as the resident trainer keeps
it) on it, which publishes the next checkpoint.  The
hyper-parameters are the demo's defaults (see DEMO_* below).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from rollout.batch_format import TrainBatch
from rollout.tasks import BuiltinReverseTasks
from rollout.train_batch import save_train_batch
from trainer.config import Strategy, TrainConfig
from trainer.job import TrainJob
from trainer.session import Session
from trainer.tiny_model import create_tiny_model
from trainer.train import DistContext, prepare, train_iteration
from trainer.warmstart import encode_task, exact_match, sample_responses, warm_start

ITERATIONS = 8
PROMPTS_PER_ITERATION = 128
GROUP_SIZE = 8
MAX_NEW_TOKENS = 6
# The demo's defaults (TrainConfig's): lr 3e-4 warmed up over 48 steps, 3
# epochs of 8 mini-batches of 128 samples per iteration, no KL.
CONFIG = TrainConfig(micro_batch_size=128, mini_batch_size=128, lr=3e-4, warmup_steps=48,
                     epochs=3, seed=0)


def rollout(model_dir: Path, tasks: list, iteration: int, batch_path: Path) -> float:
    """Sample GROUP_SIZE answers per task, write the train batch, return the mean reward."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    prompts = [encode_task(tok, t)[0] for t in tasks for _ in range(GROUP_SIZE)]
    samples = sample_responses(model, tok, prompts, max_new_tokens=MAX_NEW_TOKENS, seed=iteration)
    rewards = [
        exact_match(tok, response, tasks[i // GROUP_SIZE].ground_truth)
        for i, (response, _) in enumerate(samples)
    ]
    save_train_batch(
        batch_path,
        TrainBatch.from_lists(
            iteration=iteration,
            group_size=GROUP_SIZE,
            task_ids=[tasks[i // GROUP_SIZE].task_id for i in range(len(prompts))],
            group_index=torch.arange(len(tasks)).repeat_interleave(GROUP_SIZE),
            prompt_ids=prompts,
            response_ids=[r for r, _ in samples],
            old_logprobs=[lp for _, lp in samples],
            rewards=torch.tensor(rewards, dtype=torch.float32),
        ),
    )
    return sum(rewards) / len(rewards)


@pytest.mark.slow
def test_grpo_at_least_one_and_a_half_times_the_reward_in_eight_iterations(tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is as fast and spares busy cores
    try:
        initial = create_tiny_model(tmp_path / "iter-000000", seed=0)
        warm = warm_start(initial, seed=0)
        pool = list(BuiltinReverseTasks(seed=0).tasks("train"))
        rng = random.Random(0)
        ctx = DistContext(
            rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), strategy=Strategy.DDP
        )
        model_dir, rewards = initial, []
        # One session for every iteration, as the resident trainer keeps it.
        session: Session | None = None
        for it in range(1, ITERATIONS + 1):
            batch_path = tmp_path / f"batch-{it}.pt"
            rewards.append(
                rollout(model_dir, rng.sample(pool, PROMPTS_PER_ITERATION), it, batch_path)
            )
            job = TrainJob(
                iteration=it,
                model_dir=model_dir,
                ref_model_dir=None,
                batch_path=batch_path,
                out_dir=tmp_path / f"iter-{it:06d}",
                state_dir=tmp_path / "state",
                metrics_path=tmp_path / f"metrics-{it}.json",
                config=CONFIG,
            )
            session = session or prepare(job, ctx)
            train_iteration(session, job)
            model_dir = job.out_dir
    finally:
        torch.set_num_threads(threads)
    first, last = sum(rewards[:2]) / 2, sum(rewards[-2:]) / 2
    print(
        f"warm-start accuracy {warm['accuracy']:.3f}; rewards per iteration "
        + " ".join(f"{r:.3f}" for r in rewards)
    )
    assert last >= 1.5 * first, rewards
