"""A short supervised warm-up so the tiny model starts RL with some skill.

RL from a random model gets no reward signal: every sampled answer is wrong,
every group has equal rewards, every advantage is zero.  A few dozen steps
of teacher forcing on the digit-reversal task ("4021>" -> "1204<eos>") lift
the *sampled* (temperature 1.0) exact-match accuracy to roughly 10-25%, where
GRPO has plenty of mixed groups to learn from and room to double the reward.

The warm-up draws its tasks from a seed other than the demo's, so the demo
measures RL on prompts the warm-up never showed verbatim.  Everything is
seeded: the same model, seed and steps give the same weights.
"""

from __future__ import annotations

import ctypes
import os
import random
import secrets
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import torch

from rollout.tasks import BuiltinReverseTasks, Task
from trainer import grpo
from trainer.architectures import ArchSpec, create_model
from trainer.checkpoint import (
    MANIFEST_NAME,
    fsync_tree,
    read_manifest,
    saved_dtype,
    seal_directory,
    tmp_sibling,
    write_model_files,
)
from trainer.config import WARMSTART_STEPS

# Far from the demo's seeds (small integers), so warm-up and demo prompts are
# independent draws.
WARM_TASK_SEED_OFFSET: Final = 7_777
WARM_TRAIN_SIZE: Final = 4096
EVAL_SIZE: Final = 256
BATCH_SIZE: Final = 64
LR: Final = 5e-4
DEFAULT_STEPS: Final = WARMSTART_STEPS  # tuned on the default TinyModelSpec: trainer/config.py
_RENAME_EXCHANGE: Final = 2  # from <linux/fs.h>
_AT_FDCWD: Final = -100


def encode_task(tokenizer: Any, task: Task) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids + eos): exactly what a perfect policy would sample.

    A chat task's prompt is its messages through the chat template with the
    generation prompt, as the engine renders a chat request; the answer ends with
    the tokenizer's eos, which for a chat model is its end-of-turn token."""
    messages = task.messages()
    if messages is None:
        prompt = tokenizer(task.prompt).input_ids
    else:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                               tokenize=True)
        if hasattr(prompt, "keys"):  # transformers 5 returns a BatchEncoding
            prompt = prompt["input_ids"]
    answer = tokenizer(task.ground_truth, add_special_tokens=False).input_ids
    return list(prompt), [*answer, tokenizer.eos_token_id]


def sample_responses(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    seed: int,
    temperature: float = 1.0,
) -> list[tuple[list[int], list[float]]]:
    """Sampled responses (ids up to and including eos) and their log-probs.

    Plain ancestral sampling (no top-k/top-p), like the rollout engine.
    Prompts are generated in groups of equal length, so no padding is needed.
    """
    eos = tokenizer.eos_token_id
    out: list[tuple[list[int], list[float]]] = [([], [])] * len(prompts)
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    was_training = model.training
    model.eval()
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for length in sorted(by_len):
            idx = by_len[length]
            ids = torch.tensor([list(prompts[i]) for i in idx], dtype=torch.long)
            gen = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                temperature=temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=max_new_tokens,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=eos,
                output_scores=True,
                return_dict_in_generate=True,
            )
            new = gen.sequences[:, length:]
            logp = (
                torch.stack([torch.log_softmax(s.float(), dim=-1) for s in gen.scores], dim=1)
                .gather(-1, new.unsqueeze(-1))
                .squeeze(-1)
            )
            for row, i in enumerate(idx):
                tokens = new[row].tolist()
                end = tokens.index(eos) + 1 if eos in tokens else len(tokens)
                out[i] = (tokens[:end], logp[row, :end].tolist())
    model.train(was_training)
    return out


def exact_match(tokenizer: Any, response: Sequence[int], ground_truth: str) -> float:
    """1.0 when the response is the answer followed by eos, else 0.0."""
    if not response or response[-1] != tokenizer.eos_token_id:
        return 0.0
    text = tokenizer.decode(list(response[:-1]), skip_special_tokens=False)
    return 1.0 if text == ground_truth else 0.0


def sampled_accuracy(model: Any, tokenizer: Any, tasks: Sequence[Task], *, seed: int) -> float:
    encoded = [encode_task(tokenizer, t) for t in tasks]
    longest = max(len(a) for _, a in encoded)
    responses = sample_responses(
        model, tokenizer, [p for p, _ in encoded], max_new_tokens=longest + 2, seed=seed
    )
    rewards = [
        exact_match(tokenizer, r, t.ground_truth)
        for (r, _), t in zip(responses, tasks, strict=True)
    ]
    return sum(rewards) / len(rewards)


def supervised_steps(
    model: Any, tokenizer: Any, tasks: Sequence[Task], *, steps: int, seed: int
) -> float:
    """Teacher forcing on the answers; loss on answer tokens only.  Returns the last loss."""
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.99), weight_decay=0.0)
    model.train()
    loss_value = float("nan")
    for _ in range(steps):
        pairs = [encode_task(tokenizer, t) for t in rng.sample(list(tasks), BATCH_SIZE)]
        packed = grpo.collate(
            [p for p, _ in pairs], [a for _, a in pairs], pad_id=tokenizer.pad_token_id
        )
        logits = model(input_ids=packed.input_ids, attention_mask=packed.attention_mask).logits
        logp = grpo.token_logprobs(logits, packed.input_ids)
        loss = -(logp * packed.response_mask).sum() / packed.response_mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss_value = float(loss.detach())
    return loss_value


def _swap_dirs(new: Path, old: Path) -> None:
    """Atomically exchange two directories (renameat2 RENAME_EXCHANGE), else two renames."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if (
        renameat2 is not None
        and renameat2(_AT_FDCWD, os.fsencode(new), _AT_FDCWD, os.fsencode(old), _RENAME_EXCHANGE)
        == 0
    ):
        return
    # Filesystems without RENAME_EXCHANGE (some FUSE/NFS): a short window
    # where `old` is absent, but never one where it is half-written.
    aside = new.with_name(new.name + ".old")
    os.rename(old, aside)
    os.rename(new, old)
    os.rename(aside, new)


def warm_start(model_dir: Path, *, steps: int = DEFAULT_STEPS, seed: int = 0,
               chat: bool = False) -> dict[str, Any]:
    """Supervised warm-up of the model in model_dir, saved back in place atomically,
    in the dtype it was saved in (trained in float32).

    `chat`: the tasks as chat messages through the model's chat template (what the
    loop sends a model with one, rl/loop.py), else as text.  Returns {"accuracy":
    sampled exact-match on the warm-up eval split, "loss", "steps", "seconds"}.  A
    model_dir with a manifest gets a fresh manifest of the same iteration, so it
    stays a verifiable checkpoint.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if steps < 0:
        raise ValueError(f"steps={steps} is negative: give 0 or more supervised steps")
    started = time.monotonic()
    model_dir = Path(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, local_files_only=True, use_safetensors=True
        )
        source = BuiltinReverseTasks(
            seed=WARM_TASK_SEED_OFFSET + seed, train_size=WARM_TRAIN_SIZE, eval_size=EVAL_SIZE,
            chat=chat,
        )
        loss = supervised_steps(model, tokenizer, source.tasks("train"), steps=steps, seed=seed)
        accuracy = sampled_accuracy(model, tokenizer, source.tasks("eval"), seed=seed)

    iteration = read_manifest(model_dir).iteration if (model_dir / MANIFEST_NAME).exists() else None
    tmp = tmp_sibling(model_dir)
    try:
        write_model_files(model, None, tmp, carry_files_from=model_dir,
                          dtype=saved_dtype(model_dir))
        if iteration is not None:
            staged = tmp.with_name(tmp.name + ".sealed")
            seal_directory(tmp, staged, iteration=iteration)
            tmp = staged
        else:
            fsync_tree(tmp)
        _swap_dirs(tmp, model_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # after the swap: the old contents
    return {
        "accuracy": accuracy,
        "loss": loss,
        "steps": steps,
        "seconds": time.monotonic() - started,
    }


def build_initial_model(out_dir: Path, *, seed: int, warmstart_steps: int,
                        spec: ArchSpec | None = None) -> dict[str, Any]:
    """Build a model, warm-start it, and publish it with a manifest: the tiny demo
    model (prompted as text), or with `spec` a model of a real architecture
    (trainer/architectures.py), warm-started through its chat template."""
    from trainer.tiny_model import create_tiny_model

    tmp = out_dir.with_name(f".{out_dir.name}.{secrets.token_hex(4)}.tmp")
    try:
        if spec is None:
            create_tiny_model(tmp, seed=seed)
        else:
            create_model(tmp, spec, seed=seed)
        report: dict[str, Any] = {}
        if warmstart_steps > 0:
            report = warm_start(tmp, steps=warmstart_steps, seed=seed, chat=spec is not None)
        seal_directory(tmp, out_dir, iteration=0)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # a no-op once sealed (renamed)
    return report
