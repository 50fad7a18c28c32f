"""Settings the model and the tasks bound, checked before any engine starts.

    phase 0, master, once per daemon, before the demo model is built:
        inputs      model.path: a directory with config.json, weights and a tokenizer;
                    data.path: a task source that exists and loads (every row read)
    then, once the initial model exists:
        rewards     data.reward, or each data source's default, must load here
        ModelFacts  <- <model>/config.json: its context (max_position_embeddings)
        TaskFacts   <- the task source: each split's size, and the longest prompt in
                       tokens as the engine will count it (the model's tokenizer,
                       special tokens and chat template included)
        check(...)  -> every broken rule at once, as a UsageError (exit 2 on every
                       node) naming the setting, its limit and the fix

    check_setup(config, num_nodes=N), anywhere, without a run: the same checks
    (and the placement's GPU ranges) that need no weights, no GPU and no run
    directory, every problem listed: a recipe tried on its model's config.json
    and tokenizer before the weights are downloaded

A wrong value here would otherwise surface as thousands of refused requests,
a recovery that cannot help, or a batch too small to train on.  The message
says what to change, and that a changed setting starts with --new-run: run.json
was written before phase 0 and keeps the settings the run started with.  The
user's model and data may be symlinks (their own files, e.g. a Hugging Face
cache snapshot); only the run directory is untrusted.  The rules are
pure functions of the facts (rl/setting_rules.py), so each is tested as a table;
this module gathers the facts and applies them.
"""

from __future__ import annotations

import errno
import json
import logging
import os
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from coordinator.config.run_config import RunConfig
from coordinator.errors import UsageError
from rl.config import RlSections, parse_sections
from rl.data_source import task_source
from rl.layout import Split
from rl.loop import Loop, check_gpu_placement
from rl.placement import placement_of
from rl.reward_check import check_reward_file, check_truths
from rl.setting_rules import (
    RESTART_ADVICE,
    Facts,
    ModelFacts,
    TaskFacts,
    check,
    problems,
    refuse,
)
from rollout.errors import TaskDataError, UnknownRewardError
from rollout.rewards import default_reward_for, get_reward
from rollout.tasks import BUILTIN_PREFIX, Task

log = logging.getLogger(__name__)

# Where Hugging Face configs keep the context length, by model family.
CONTEXT_KEYS: Final = ("max_position_embeddings", "n_positions", "max_sequence_length",
                       "seq_length")
# ... and its attention heads, which vLLM's tensor parallelism must divide.
HEAD_KEYS: Final = ("num_attention_heads", "n_head")
# A Hugging Face model directory's weights (save_pretrained: one file or shards
# with an index) and its tokenizer (a fast tokenizer, a sentencepiece model, or
# a BPE/WordPiece vocabulary).
WEIGHT_SUFFIXES: Final = (".safetensors", ".bin")
TOKENIZER_FILES: Final = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
# Errors of a network filesystem that a retry of the phase may cure: not a setting.
TRANSIENT_ERRNOS: Final = frozenset({errno.EIO, errno.ESTALE, errno.ETIMEDOUT, errno.EAGAIN,
                                     errno.EINTR})


# --- the user's model and data, before anything is built -------------------------


def model_dir_problem(path: Path, files: Collection[str] | None) -> str | None:
    """What keeps `path` from being a model to start from, given the names of the
    files in it (`files`, symlinks followed; None where it is no directory this user
    can read)."""
    where = f"model.path {path}"
    if files is None:
        return (f"{where} does not exist, is not a directory or cannot be read by this "
                "user: give --model a local Hugging Face model "
                "directory (config.json, weights, tokenizer), or leave it out for the tiny "
                "demo model")
    if "config.json" not in files:
        return (f"{where} has no config.json: give the directory a model was saved to "
                "(save_pretrained, or a downloaded snapshot)")
    if not any(n.endswith(WEIGHT_SUFFIXES) for n in files):
        return (f"{where} holds no weights (*.safetensors or pytorch_model*.bin): give the "
                "directory the weights were saved to, or download them into it")
    if not any(n in files for n in TOKENIZER_FILES):
        return (f"{where} holds no tokenizer ({', '.join(TOKENIZER_FILES)}): save the "
                "tokenizer beside the model (tokenizer.save_pretrained)")
    return None


def model_files(path: Path) -> list[str] | None:
    """The names of the files in directory `path`, symlinks followed (a Hugging Face
    cache snapshot is symlinks into its blobs); None where `path` is no directory
    this user can list.
    A transient error of the filesystem is raised as it is: a retry may cure it."""
    try:
        names = os.listdir(path)
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return None
    return [n for n in names if os.path.isfile(path / n)]


def data_problem(spec: str) -> str | None:
    """What keeps data.path from naming a task source, before it is read."""
    if spec.startswith(BUILTIN_PREFIX) or os.path.exists(spec):
        return None
    return (f"data.path {spec!r} does not exist: give --data-path builtin:reverse, a .parquet "
            "or .jsonl task file, or a directory holding train.<ext> (and test.<ext> or "
            "eval.<ext>)")


def check_inputs(loop: Loop) -> None:
    """Phase 0 on the master, before the demo model is built or any engine starts:
    the user's model directory and task source exist and load (UsageError: every
    node exits 2, naming each problem and the fix)."""
    s = loop.s
    found = []
    if s.model.path:
        path = Path(s.model.path)
        found.append(model_dir_problem(path, model_files(path)))
    found.append(problem := data_problem(s.data.path))
    if problem is None:
        try:
            loop.tasks(Split.TRAIN)
            loop.tasks(Split.EVAL)
        except TaskDataError as exc:
            cause = exc.__cause__
            if isinstance(cause, OSError) and cause.errno in TRANSIENT_ERRNOS:
                raise  # the filesystem, not the setting: the phase fails and is retried
            # data.train_files' errors name the setting; data.path's the file in it.
            found.append(str(exc) if s.data.train_files else f"data.path {s.data.path!r}: {exc}")
    refuse("the model or the data given cannot be used", [p for p in found if p])


def check_loop(loop: Loop) -> None:
    """Phase 0 on the master, before any engine starts: the facts of this run's
    model and tasks, checked (UsageError: every node exits 2)."""
    s = loop.s
    model = loop.initial_model()
    tasks = [*loop.tasks(Split.TRAIN).values(), *loop.tasks(Split.EVAL).values()]
    prompt = None
    if not s.rollout.agent:  # an agent builds its own prompts and scores its episodes
        if not s.reward.path:  # a reward file: checked on every node (rl/reward_check.py)
            check_rewards(s.data.reward, {t.data_source for t in tasks})
            check_truths(s, tasks)
        prompt = longest_prompt(model, tasks)
    facts = Facts(s=s, run=loop.config.run, model=model_facts(model), tasks=TaskFacts(
        source=s.data.source, train=len(loop.tasks(Split.TRAIN)), eval=len(loop.tasks(Split.EVAL)),
        longest_prompt=prompt[0] if prompt else None, longest_task=prompt[1] if prompt else "",
        eval_as_chat=not s.rollout.agent and any(
            t.messages() is not None for t in loop.tasks(Split.EVAL).values())))
    check(facts)
    log.info("settings checked against %s (context %s, longest prompt %s tokens) and %s "
             "(%d train, %d eval tasks)", model, facts.context or "unknown",
             facts.tasks.longest_prompt or "unknown", s.data.source, facts.tasks.train,
             facts.tasks.eval)


# --- gathering the facts ---------------------------------------------------------


def model_facts(path: Path) -> ModelFacts:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"model.path {path} has no readable config.json ({exc}): give a "
                         "local Hugging Face model directory") from None
    context, heads = _first_count(config, CONTEXT_KEYS), _first_count(config, HEAD_KEYS)
    if context is None:
        log.warning("%s/config.json names no context length (%s): rollout.max_tokens is not "
                    "checked against it", path, ", ".join(CONTEXT_KEYS))
    return ModelFacts(path=path, context=context, attention_heads=heads)


def _first_count(config: object, keys: Sequence[str]) -> int | None:
    """The first of `keys` that config.json gives as a positive integer."""
    for key in keys:
        value = config.get(key) if isinstance(config, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def check_rewards(reward: str, sources: Iterable[str]) -> None:
    """data.reward, or each data source's default reward, can be loaded here (the
    master's node; every node needs the same packages)."""
    try:
        for name in {reward} if reward else {default_reward_for(s) for s in sorted(sources)}:
            get_reward(name)
    except UnknownRewardError as exc:
        raise UsageError(f"data.reward={reward!r}: {exc}") from None


def longest_prompt(model: Path, tasks: Iterable[Task], *,
                   strict: bool = False) -> tuple[int, str] | None:
    """The longest prompt in tokens as the engine counts it: text with the
    tokenizer's special tokens (as /v1/completions does), chat messages through
    the model's chat template with the generation prompt.  A chat prompt the
    template cannot render is logged and None returned (the engine will say so
    at its first request), or with `strict` a UsageError naming the task."""
    from transformers import AutoTokenizer  # heavy: only on the master, once

    try:
        tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    except (OSError, ValueError) as exc:  # what transformers raises for files it cannot use
        raise UsageError(f"model.path {model}: its tokenizer cannot be loaded ({exc}): save "
                         f"the model's tokenizer beside it; {RESTART_ADVICE}") from None
    texts = [t for t in tasks if isinstance(t.prompt, str)]
    chats = [t for t in tasks if not isinstance(t.prompt, str)]
    lengths: list[tuple[int, str]] = []
    if texts:
        ids = tokenizer([str(t.prompt) for t in texts])["input_ids"]
        lengths += [(len(x), t.task_id) for x, t in zip(ids, texts, strict=True)]
    for t in chats:
        try:
            ids = tokenizer.apply_chat_template(t.messages(), add_generation_prompt=True,
                                                tokenize=True)
        except Exception as exc:  # no template: the engine will say so at its first request
            if strict:
                raise UsageError(f"model.path {model}: its chat template cannot render the "
                                 f"prompt of task {t.task_id} ({type(exc).__name__}: {exc}): "
                                 "every chat request would fail; save a chat template with the "
                                 "tokenizer (chat_template.jinja or tokenizer_config.json)"
                                 ) from None
            log.warning("cannot render task %s with the chat template of %s (%s): prompt "
                        "lengths are not checked", t.task_id, model, exc)
            return None
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding, whose len() is
            ids = ids["input_ids"]  # its number of fields (2), not of tokens
        lengths.append((len(ids), t.task_id))
    return max(lengths) if lengths else None


# --- a setup checked without a run -----------------------------------------------


@dataclass(frozen=True, kw_only=True)
class SetupCheck:
    problems: tuple[str, ...]  # empty: phase 0 of a run would find nothing to refuse
    facts: Facts | None  # None where the model directory or the tasks could not be read


def check_setup(config: RunConfig, *, num_nodes: int) -> SetupCheck:
    """What phase 0 checks, and the placement's GPU ranges, on `num_nodes` nodes,
    from this machine alone and without a run: no run directory, no engine, no
    GPU and no weights needed.  Every problem is listed rather than the first
    raised, so a recipe can be tried on its model's config.json and tokenizer
    before the weights are downloaded (the missing weights are then the one
    problem).  Reads: config.json (as transformers parses it), the tokenizer,
    every task, each prompt through the chat template (strictly: a template that
    fails is a problem here), the rewards the tasks' data sources need."""
    found: list[str | None] = []
    s = parse_sections(config.sections)
    try:
        check_gpu_placement(s, placement_of(config, num_nodes))
    except UsageError as exc:
        found.append(str(exc))
    model = _model_without_weights(s, found)
    tasks = _tasks_of(s, found)
    prompt = None
    if tasks is not None and not s.rollout.agent:
        try:
            if s.reward.path:  # in its worker process here, as on each node at phase 0
                check_reward_file(s)
            else:
                check_rewards(s.data.reward, {t.data_source for t in (*tasks[0], *tasks[1])})
                check_truths(s, (*tasks[0], *tasks[1]))
            if model is not None:
                prompt = longest_prompt(model.path, (*tasks[0], *tasks[1]), strict=True)
        except UsageError as exc:
            found.append(str(exc))
    facts = None
    if model is not None and tasks is not None:
        facts = Facts(s=s, run=config.run, model=model, tasks=TaskFacts(
            source=s.data.source, train=len(tasks[0]), eval=len(tasks[1]),
            longest_prompt=prompt[0] if prompt else None,
            longest_task=prompt[1] if prompt else ""))
        found += problems(facts)
    return SetupCheck(problems=tuple(p for p in found if p), facts=facts)


def _model_without_weights(s: RlSections, found: list[str | None]) -> ModelFacts | None:
    """model.path's facts, read from its config.json, which transformers must parse
    (its architecture known); its files' problems (weights first) go to `found`.
    None for the tiny model, which the master builds at start, and for a directory
    without a readable config.json."""
    if not s.model.path:
        return None
    path = Path(s.model.path)
    files = model_files(path)
    found.append(model_dir_problem(path, files))
    if files is None or "config.json" not in files:
        return None
    from transformers import AutoConfig  # heavy: only when a model is checked

    try:
        AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:  # what transformers raises for a bad config
        found.append(f"model.path {path}: transformers cannot parse its config.json ({exc}): "
                     "give a model directory of an architecture transformers and vLLM know")
        return None
    try:
        return model_facts(path)
    except UsageError as exc:
        found.append(str(exc))
        return None


def _tasks_of(s: RlSections, found: list[str | None]) -> tuple[list[Task], list[Task]] | None:
    """The train and eval tasks of data.path (or data.train_files and data.val_files),
    loaded as a run loads them (a split a source lacks is empty); its problem goes to
    `found` and gives None."""
    problem = None if s.data.train_files else data_problem(s.data.path)
    if problem is not None:
        found.append(problem)
        return None
    try:
        source = task_source(s.data)
    except TaskDataError as exc:
        found.append(str(exc) if s.data.train_files else f"data.path {s.data.path!r}: {exc}")
        return None
    splits: list[list[Task]] = []
    for split in (Split.TRAIN, Split.EVAL):
        try:
            splits.append(list(source.tasks(split.value)))
        except TaskDataError:
            splits.append([])  # a missing split is empty, as in a run (rl/loop.py Loop.tasks)
    return splits[0], splits[1]
