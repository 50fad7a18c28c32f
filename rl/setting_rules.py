"""The rules that the settings, the model and the tasks must keep together: pure
functions of the facts (rl/preflight.py gathers them before any engine starts),
one per rule, each returning what is wrong and how to fix it, or None.

    Facts(settings, run, ModelFacts from config.json, TaskFacts from the tasks)
        -> RULES, each: a message naming the setting, its limit and the fix
        -> check: every broken rule at once, as one UsageError (exit 2)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from coordinator.config.run_config import RunSection
from coordinator.errors import UsageError
from coordinator.records.phases import Phase
from rl.config import RlSections
from rollout.engines.engine import EngineKind

# What every message of a refused setting ends with: run.json already holds the
# settings, so a restart with a changed one is refused as a different setup.
RESTART_ADVICE: Final = ("then start every node again (the master with --new-run if a "
                         "setting changed: this run directory keeps the settings it started "
                         "with)")


@dataclass(frozen=True, kw_only=True)
class ModelFacts:
    path: Path
    context: int | None  # positions the model accepts; None: config.json does not say
    attention_heads: int | None = None  # None: config.json does not say


@dataclass(frozen=True, kw_only=True)
class TaskFacts:
    source: str  # as messages name it: data.path='...', or data.train_files=[...]
    train: int  # tasks in the train split
    eval: int
    # The longest prompt in tokens and its task; None when prompts are the agent's
    # own (rollout.agent) or could not be tokenized here.
    longest_prompt: int | None = None
    longest_task: str = ""
    # Whether eval prompts go to the engine as chat messages (/v1/chat/completions).
    eval_as_chat: bool = False


@dataclass(frozen=True, kw_only=True)
class Facts:
    s: RlSections
    run: RunSection
    model: ModelFacts
    tasks: TaskFacts

    @property
    def context(self) -> int | None:
        """What the engine will accept: the model's context, or engine.max_model_len
        below it."""
        limits = [n for n in (self.model.context, self.s.engine.max_model_len) if n]
        return min(limits) if limits else None

    @property
    def rolls_out_train(self) -> bool:
        return self.s.schedule.trains

    @property
    def trains(self) -> bool:
        """Whether the run trains on what it rolls out (--rl-phase rollout does not)."""
        return self.rolls_out_train and Phase.TRAIN in self.s.schedule.rl_phase.phases

    @property
    def evaluates(self) -> bool:
        """Whether any iteration of the run rolls out the eval split."""
        schedule = self.s.schedule
        return any(schedule.evaluates(i) for i in
                   range(min(self.run.iterations, max(schedule.eval_interval, 1) + 1)))

    @property
    def train_tasks_per_iteration(self) -> int:
        wanted = self.s.rollout.tasks_per_iteration
        return min(wanted, self.tasks.train) if wanted else self.tasks.train


Rule = Callable[[Facts], str | None]


def _max_model_len(f: Facts) -> str | None:
    wanted, context = f.s.engine.max_model_len, f.model.context
    if wanted is not None and context is not None and wanted > context:
        return (f"engine.max_model_len={wanted} exceeds the {context} positions of the model "
                f"{f.model.path} (config.json): give at most {context}, or leave it unset")
    return None


def _max_tokens(f: Facts) -> str | None:
    context, max_tokens = f.context, f.s.rollout.max_tokens
    if context is None or f.s.rollout.agent:
        return None  # an agent asks for its own lengths, turn by turn
    prompt = f.tasks.longest_prompt
    if prompt is None:
        if max_tokens < context:
            return None
        return (f"rollout.max_tokens={max_tokens} leaves no room for a prompt in the "
                f"{context}-token context of {f.model.path}: give at most {context - 1}")
    if prompt + max_tokens <= context:
        return None
    room = context - prompt
    fix = f"lower rollout.max_tokens to at most {room}" if room >= 1 else \
        "shorten the prompts or use a model with a longer context"
    return (f"rollout.max_tokens={max_tokens} plus the longest prompt ({prompt} tokens, task "
            f"{f.tasks.longest_task}) needs {prompt + max_tokens} positions, but the engine "
            f"accepts {context} (the context of {f.model.path}"
            + (f", engine.max_model_len={f.s.engine.max_model_len}"
               if f.s.engine.max_model_len else "")
            + f"): every request would be refused; {fix}")


def _split_tasks(f: Facts, split: str, setting: str, available: int, empty: str) -> str | None:
    """A split the run needs: not empty, and at least as many tasks as `setting` asks."""
    if available == 0:
        return empty
    wanted = getattr(f.s.rollout, setting)
    if wanted > available:
        return (f"rollout.{setting}={wanted} exceeds the {available} tasks of the {split} "
                f"split of {f.tasks.source}: give at most {available}, or 0 for the whole "
                "split")
    return None


def _train_tasks(f: Facts) -> str | None:
    if not f.rolls_out_train:
        return None
    return _split_tasks(f, "train", "tasks_per_iteration", f.tasks.train, empty=(
        f"the train split of {f.tasks.source} has no tasks: give a task file or "
        "directory with a train split"))


def _eval_tasks(f: Facts) -> str | None:
    if not f.evaluates:
        return None
    return _split_tasks(f, "eval", "eval_tasks", f.tasks.eval, empty=(
        f"the run evaluates (schedule.eval_interval={f.s.schedule.eval_interval}, "
        f"schedule.rollout_split={f.s.schedule.rollout_split.value}) but {f.tasks.source} has "
        "no eval split: give data.val_files (or a task directory with test.<ext> or "
        "eval.<ext>), or leave the eval schedule to its defaults (no eval data: eval off), "
        "or set schedule.eval_interval=0 and schedule.eval_before_train=false"))


def _mini_batch(f: Facts) -> str | None:
    if not f.trains or not f.tasks.train:
        return None
    tasks, group = f.train_tasks_per_iteration, f.s.rollout.group_size
    samples, mini = tasks * group, f.s.train.mini_batch_size
    if mini <= samples:
        return None
    return (f"train.mini_batch_size={mini} exceeds the {samples} samples an iteration rolls "
            f"out ({tasks} tasks x rollout.group_size={group}): not one optimizer step would "
            f"see a full mini-batch; give at most {samples}, 0 for one step on the whole "
            "batch, or raise rollout.tasks_per_iteration")


def _min_batch(f: Facts) -> str | None:
    rollout = f.s.rollout
    if not f.trains or rollout.min_batch_fraction <= 1.0 - rollout.max_failed_fraction:
        return None
    return (f"rollout.min_batch_fraction={rollout.min_batch_fraction} is above what "
            f"rollout.max_failed_fraction={rollout.max_failed_fraction} lets through "
            f"({1.0 - rollout.max_failed_fraction:g} of the samples): an iteration within the "
            "failure budget could still be refused; lower one of them")


def _tensor_parallel(f: Facts) -> str | None:
    engine, heads = f.s.engine, f.model.attention_heads
    if engine.kind is not EngineKind.VLLM or heads is None \
            or heads % engine.tensor_parallel_size == 0:
        return None  # the hf engine runs on one device whatever tensor_parallel_size says
    divisors = ", ".join(str(d) for d in range(1, heads + 1) if heads % d == 0)
    return (f"engine.tensor_parallel_size={engine.tensor_parallel_size} does not divide the "
            f"{heads} attention heads of the model {f.model.path} (config.json): vLLM refuses "
            f"to start; give one of {divisors}, with engine.data_parallel_size so that the "
            "two multiplied are the GPUs a node rolls out on")


def _greedy_chat_eval(f: Facts) -> str | None:
    rollout = f.s.rollout
    if not (f.evaluates and f.tasks.eval_as_chat and f.s.engine.kind is EngineKind.HF
            and rollout.eval_group_size > 1 and rollout.eval_temperature == 0):
        return None  # vLLM's case is refused with the settings alone (rl/config.py)
    return (f"rollout.eval_group_size={rollout.eval_group_size} with "
            "rollout.eval_temperature=0, and the eval prompts of "
            f"{f.tasks.source} go to the model {f.model.path} as chat messages: the "
            "engine's chat endpoint, as vLLM's, refuses n > 1 without sampling (greedy "
            "decoding gives every sample of a prompt the same answer), so every eval "
            "sample would fail; set rollout.eval_group_size=1, or rollout.eval_temperature "
            "above 0")


RULES: Final[Sequence[Rule]] = (_max_model_len, _max_tokens, _train_tasks, _eval_tasks,
                                _mini_batch, _min_batch, _tensor_parallel, _greedy_chat_eval)


def problems(facts: Facts) -> list[str]:
    return [m for rule in RULES if (m := rule(facts)) is not None]


def check(facts: Facts) -> None:
    """Raise one UsageError listing every broken rule."""
    refuse("the settings cannot work with this model and these tasks", problems(facts))


def refuse(head: str, found: Sequence[str]) -> None:
    """One UsageError for every problem `found` (none: nothing), ending with what to
    do after the change."""
    if len(found) == 1:
        raise UsageError(f"{head}: {found[0]}; {RESTART_ADVICE}")
    if found:
        raise UsageError(f"{head} ({len(found)} problems):\n  - " + "\n  - ".join(found)
                         + f"\n{RESTART_ADVICE[0].upper()}{RESTART_ADVICE[1:]}")
