"""verl's most used settings and ours, declared once: docs/CONFIG.md's table and "did you mean".

A verl user writes `actor_rollout_ref.rollout.n=8`, or `rollout.n = 8` under
our [rollout]: `suggestions` maps both (verl's full key, and our section with
verl's last name) to `rollout.group_size`, together with the other names a
setting declares (`aliases`: `train.learning_rate`).  rl/config.py's
"did you mean" reads it, and coordinator_cli/config_doc.py prints the table.

`ours` is a key, a flag of `coordinator run` ("--num-nodes"), or "" where we
have no equivalent (the note says what we do instead).  tests/rl/test_config_doc.py
checks every key and flag named here exists.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from coordinator.config.settings import iter_settings


@dataclass(frozen=True)
class VerlKey:
    verl: str
    ours: str
    note: str = ""


_AR: Final = "actor_rollout_ref"
VERL_KEYS: Final = (
    VerlKey("data.train_files", "data.train_files",
            "a path or a list; or data.path: one file, or a directory of train.* and test.*"),
    VerlKey("data.val_files", "data.val_files", "none given: no eval split (eval off with a WARNING unless the schedule asks for it: then refused at start)"),
    VerlKey("data.train_batch_size", "rollout.tasks_per_iteration",
            "prompts in both: verl's per step, ours per iteration (one rollout, then "
            "train.epochs passes over it)"),
    VerlKey("data.max_prompt_length", "",
            "prompts are not truncated; a prompt whose tokens plus "
            "rollout.max_tokens pass the model's context (or engine.max_model_len) is "
            "refused at start"),
    VerlKey("data.max_response_length", "rollout.max_tokens", "tokens in both"),
    VerlKey(f"{_AR}.model.path", "model.path", "a local Hugging Face directory"),
    VerlKey(f"{_AR}.model.enable_gradient_checkpointing", "train.activation_checkpointing"),
    VerlKey(f"{_AR}.actor.optim.lr", "train.lr"),
    VerlKey(f"{_AR}.actor.optim.lr_warmup_steps", "train.warmup_steps",
            "linear, over the run's optimizer steps"),
    VerlKey(f"{_AR}.actor.optim.weight_decay", "train.weight_decay"),
    VerlKey(f"{_AR}.actor.ppo_mini_batch_size", "train.mini_batch_size",
            "verl counts prompts, ours counts samples: verl's 256 with rollout.n=8 is "
            "train.mini_batch_size = 2048"),
    VerlKey(f"{_AR}.actor.ppo_micro_batch_size_per_gpu", "train.micro_batch_size",
            "samples per forward pass on one GPU (rank) in both"),
    VerlKey(f"{_AR}.actor.ppo_epochs", "train.epochs"),
    VerlKey(f"{_AR}.actor.clip_ratio", "train.clip_eps", "one symmetric clip"),
    VerlKey(f"{_AR}.actor.grad_clip", "train.max_grad_norm"),
    VerlKey(f"{_AR}.actor.use_kl_loss", "train.kl_coef", "a kl_coef above 0 turns it on"),
    VerlKey(f"{_AR}.actor.kl_loss_coef", "train.kl_coef"),
    VerlKey(f"{_AR}.actor.kl_loss_type", "", "always the k3 estimate "
            "(verl's low_var_kl)"),
    VerlKey(f"{_AR}.actor.entropy_coeff", "", "no entropy bonus"),
    VerlKey(f"{_AR}.actor.loss_agg_mode", "train.loss_agg",
            "token-mean and seq-mean-token-mean, as verl names them"),
    VerlKey(f"{_AR}.actor.strategy", "train.strategy", "fsdp2 or ddp; auto picks by device"),
    VerlKey(f"{_AR}.actor.fsdp_config.param_offload", "train.offload",
            "one switch for weights and optimizer between jobs"),
    VerlKey(f"{_AR}.actor.fsdp_config.optimizer_offload", "train.offload"),
    VerlKey(f"{_AR}.rollout.name", "engine.kind", "vllm, or hf (built in)"),
    VerlKey(f"{_AR}.rollout.n", "rollout.group_size"),
    VerlKey(f"{_AR}.rollout.temperature", "rollout.temperature"),
    VerlKey(f"{_AR}.rollout.top_p", "rollout.top_p"),
    VerlKey(f"{_AR}.rollout.response_length", "rollout.max_tokens"),
    VerlKey(f"{_AR}.rollout.max_model_len", "engine.max_model_len"),
    VerlKey(f"{_AR}.rollout.gpu_memory_utilization", "engine.gpu_memory_utilization"),
    VerlKey(f"{_AR}.rollout.tensor_model_parallel_size", "engine.tensor_parallel_size",
            "engine.data_parallel_size replicas of it per node"),
    VerlKey(f"{_AR}.rollout.val_kwargs.n", "rollout.eval_group_size"),
    VerlKey(f"{_AR}.rollout.val_kwargs.temperature", "rollout.eval_temperature"),
    VerlKey("algorithm.adv_estimator", "",
            "GRPO (rewards normalised within each group) only"),
    VerlKey("algorithm.norm_adv_by_std_in_grpo", "",
            "always on; train.adv_eps is added to the std"),
    VerlKey("algorithm.kl_ctrl.kl_coef", "",
            "no KL penalty in the reward; the KL loss is train.kl_coef"),
    VerlKey("custom_reward_function.path", "reward.path"),
    VerlKey("custom_reward_function.name", "reward.function",
            "called the same way: (data_source, solution_str, ground_truth, extra_info)"),
    VerlKey("reward_model.enable", "",
            "no reward model; a reward function may call one"),
    VerlKey("trainer.total_training_steps", "run.iterations",
            "one iteration is one verl step: a rollout and its update"),
    VerlKey("trainer.total_epochs", "run.iterations",
            "iterations, not passes over the data: each rolls out "
            "rollout.tasks_per_iteration prompts"),
    VerlKey("trainer.nnodes", "--num-nodes", "a flag of the master, not a setting"),
    VerlKey("trainer.n_gpus_per_node", "torchrun.nproc_per_node",
            "training processes per node; the engine's GPUs are "
            "engine.tensor_parallel_size x engine.data_parallel_size"),
    VerlKey("trainer.save_freq", "train.save_interval",
            "the resumable training state; the policy checkpoint is published every "
            "iteration"),
    VerlKey("trainer.test_freq", "schedule.eval_interval"),
    VerlKey("trainer.val_before_train", "schedule.eval_before_train"),
    VerlKey("trainer.max_actor_ckpt_to_keep", "checkpoint.keep",
            "checkpoint.keep_best keeps the best by an eval metric too"),
    VerlKey("trainer.project_name", "metrics.wandb_project"),
    VerlKey("trainer.logger", "metrics.tensorboard",
            "the console always; W&B when metrics.wandb_project is set"),
    VerlKey("trainer.default_local_dir", "--run-dir",
            "checkpoints go to <run dir>/checkpoints/"),
    VerlKey("trainer.resume_mode", "", "a run always resumes when started "
            "again with the same settings (--new-run starts anew)"),
)


def suggestions(sections: Mapping[str, type]) -> dict[str, str]:
    """Names users type -> our key: each verl key, our section with verl's last name
    (rollout.n), and each setting's declared aliases (train.learning_rate).  The first
    entry naming a key wins; a name that is one of our keys is never redirected."""
    ours = {key: declared for name, cls in sections.items()
            for key, declared, _, _ in iter_settings(cls, name)}
    out: dict[str, str] = {}
    for key, declared in ours.items():
        section = key.rpartition(".")[0]
        for alias in declared.aliases:
            out.setdefault(f"{section}.{alias}", key)
    for k in VERL_KEYS:
        if k.ours in ours:
            out.setdefault(k.verl, k.ours)
            out.setdefault(f"{k.ours.rpartition('.')[0]}.{k.verl.rpartition('.')[2]}", k.ours)
    return {typed: key for typed, key in out.items() if typed not in ours}
