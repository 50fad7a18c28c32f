"""What one node's RL loop keeps between phases.

`Loop` is handed to every phase function (rl/actions.py maps phases to
them): the node's resolved sections, its rank, the run directory, its
inference engine, its resident trainer, the task index, and the training
port held from phase 9 to phase 10.  Nothing here does a phase's work.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

from coordinator.config.run_config import RunConfig
from coordinator.errors import ActionError, UnsafeFileError, UsageError
from coordinator.machine.actions import StepContext
from coordinator.machine.netaddr import Listener
from coordinator.records.layout import release as release_key
from coordinator.storage import fsio
from coordinator.storage.beneath import relative_inside
from coordinator.storage.store import read_document
from rl import layout
from rl.config import RlSections, parse_sections
from rl.contracts import INITIAL_POLICY
from rl.data_source import task_source
from rl.engine_host import EngineHost
from rl.placement import Placement, Role, placement_of
from rl.run_layouts import LayoutRule, rule_of
from rl.trainer_host import TrainerHost
from rollout.errors import TaskDataError
from rollout.sharding import ShardPlan
from rollout.tasks import BuiltinReverseTasks, Task, TaskSource
from trainer.config import Offload
from trainer.tiny_model import CHAT_TEMPLATE as CHARACTER_TEMPLATE

log = logging.getLogger(__name__)


def check_gpu_placement(s: RlSections, placement: Placement,
                        ranks: tuple[int, ...] | None = None) -> None:
    """The GPU ranges of the placement against the settings, for every node (the
    master, before run.json is written) or `ranks`: UsageError naming both."""
    for rank in ranks if ranks is not None else range(placement.num_nodes):
        rollout = placement.gpus(rank, Role.ROLLOUT)
        if rollout is not None:
            listed = ",".join(map(str, rollout))
            if s.engine.cuda_visible_devices is not None:
                raise UsageError(
                    f"engine.cuda_visible_devices={s.engine.cuda_visible_devices!r} and "
                    f"run.rollout_nodes (node {rank}: GPUs {listed}) both choose the engine's "
                    "GPUs: give them in run.rollout_nodes only")
            try:
                dataclasses.replace(s.engine, cuda_visible_devices=listed)
            except ValueError as exc:
                raise UsageError(f"run.rollout_nodes gives node {rank}'s engine GPUs {listed}: "
                                 f"{exc}") from None
        train = placement.gpus(rank, Role.TRAIN)
        if train is not None and len(train) != s.torchrun.nproc_per_node:
            raise UsageError(
                f"run.train_nodes gives node {rank} {len(train)} GPU(s) to train on, but "
                f"torchrun.nproc_per_node={s.torchrun.nproc_per_node} starts that many trainer "
                f"ranks per node: give every training node {s.torchrun.nproc_per_node} GPU(s), "
                f"or set torchrun.nproc_per_node={len(train)}")


def placed_on_gpus(s: RlSections, placement: Placement, rank: int,
                   ) -> tuple[RlSections, str | None]:
    """The sections with the engine on the GPUs the placement gives this node's
    rollout (and train.offload "auto" resolved to "off" where training has GPUs
    of its own), and CUDA_VISIBLE_DEVICES for its trainer (None: the daemon's
    own), the indices taken from the daemon's own CUDA_VISIBLE_DEVICES when set."""
    check_gpu_placement(s, placement, (rank,))
    if not rule_of(placement).shares_gpus and s.train.offload is Offload.AUTO:
        # Training has GPUs of its own: its state stays on them between jobs.
        s = dataclasses.replace(s, train=dataclasses.replace(s.train, offload=Offload.OFF))
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    rollout = placement.visible_devices(rank, Role.ROLLOUT, inherited)
    if rollout is not None:
        s = dataclasses.replace(s, engine=dataclasses.replace(s.engine,
                                                              cuda_visible_devices=rollout))
    return s, placement.visible_devices(rank, Role.TRAIN, inherited)


def builtin_as_chat(model_dir: Path) -> bool:
    """Whether the built-in task goes to the model as chat messages: when the model has
    a chat template (in tokenizer_config.json or chat_template.jinja) other than the
    character model's (trainer/tiny_model.py: a base model, warm-started on text
    prompts, whose template serves agents' conversations).  The model is the user's
    (a symlink is followed) or model-init in the run directory; a file that cannot
    be read or parsed counts as no template (the settings check reads it next)."""
    def read(name: str) -> bytes | None:
        try:
            return fsio.read_bytes(Path(os.path.realpath(model_dir / name)))
        except (OSError, UnsafeFileError):
            return None

    template: Any = None
    raw = read("tokenizer_config.json")
    try:
        config = json.loads(raw) if raw is not None else None
    except ValueError:
        config = None
    if isinstance(config, dict):
        template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not template and (jinja := read("chat_template.jinja")) is not None:
        template = jinja.decode("utf-8", "replace")
    return isinstance(template, str) and bool(template.strip()) \
        and template != CHARACTER_TEMPLATE


class Loop:
    def __init__(self, config: RunConfig, *, rank: int, num_nodes: int, run_dir: Path) -> None:
        self.config = config
        self.s: RlSections = parse_sections(config.sections)
        self.rank = rank
        self.num_nodes = num_nodes
        self.run_dir = run_dir
        # Which nodes roll out and which train, and how far rollout runs ahead
        # (rl/placement.py); checked by the master at its start.
        self.placement = placement_of(config, num_nodes)
        # What each phase does in this layout (rl/run_layouts.py): asked, not branched on.
        self.layout: LayoutRule = rule_of(self.placement)
        self.s, train_devices = placed_on_gpus(self.s, self.placement, rank)
        self.engines = EngineHost(self.s, rank=rank, run_dir=run_dir)
        coordination = config.coordination
        self.trainers = TrainerHost(self.s, rank=rank, run_dir=run_dir,
                                    beat_s=coordination.heartbeat_interval_s,
                                    lease_s=coordination.lease_s,
                                    cuda_visible_devices=train_devices,
                                    shares_gpus=self.layout.shares_gpus)
        self.listener: Listener | None = None  # master, phases 9-10: the training port
        self._tasks: TaskSource | None = None
        self._by_id: dict[str, dict[str, Task]] = {}
        self.wandb: Any = None  # master: the Weights & Biases run, once opened (rl/reporting.py)
        self.checked = False  # master: settings checked against model and tasks (preflight)
        # This node's reward as phase 0 checked it (rl/preflight.py check_reward_here).
        self.reward_checked: dict[str, str] | None = None

    @property
    def trains(self) -> bool:
        """False with --rollout-split eval-only: no train rollout, no training."""
        return self.s.schedule.trains

    @property
    def rolls_out(self) -> bool:
        """Whether this node rolls out (every node, unless the placement disaggregates)."""
        return self.placement.rolls_out(self.rank)

    @property
    def trains_here(self) -> bool:
        """Whether this node hosts trainer ranks (every node, unless disaggregated)."""
        return self.trains and self.placement.trains(self.rank)

    def train_members(self, ctx: StepContext) -> tuple[int, ...]:
        """The group's members that train: all of them, unless disaggregated."""
        members = tuple(r for r in ctx.active_ranks if self.placement.trains(r))
        if not members:
            raise ActionError(
                f"no training node is left in the group (members {list(ctx.active_ranks)}, "
                f"run.train_nodes {list(self.placement.train)}): restart a training node")
        return members

    def tasks(self, split: layout.Split) -> dict[str, Task]:
        """The split's tasks by id, loaded once per daemon (data.path, or data.train_files
        and data.val_files: rl/data_source.py)."""
        if self._tasks is None:
            self._tasks = task_source(self.s.data)
            if isinstance(self._tasks, BuiltinReverseTasks) and builtin_as_chat(
                    self.initial_model()):
                self._tasks = dataclasses.replace(self._tasks, chat=True)
        if split.value not in self._by_id:
            try:
                found = self._tasks.tasks(split.value)
            except TaskDataError:
                # A file source read every row when it loaded: what fails here is a
                # split it does not have (a single task file has no eval split).  The
                # settings check refuses a run that asked for it (rl/preflight.py);
                # without the asking, eval is off (rl/data_source.py).
                found = ()
            self._by_id[split.value] = {t.task_id: t for t in found}
        return self._by_id[split.value]

    def initial_model(self) -> Path:
        return layout.initial_model(self.run_dir, self.s.model.path)

    def relative(self, path: Path) -> str:
        return path.relative_to(self.run_dir).as_posix()

    def model(self, ctx: StepContext, name: str, *, where_phase: int) -> Path:
        """A model a release names: the initial model, or a directory checked to lie
        inside the run directory (no '..', not absolute; symlinks refused when opened)."""
        if name == INITIAL_POLICY:
            return self.initial_model()
        where = self.run_dir / release_key(ctx.iteration, where_phase)
        return self.run_dir / relative_inside(name, what="the model it names", where=where)

    def find_shard_plan(self, iteration: int, split: layout.Split) -> ShardPlan | None:
        """The master's plan of a split in an iteration, if it was published."""
        return read_document(layout.shard_plan(self.run_dir, iteration, split),
                             lambda raw, where: ShardPlan.from_bytes(raw, where))

    def close_listener(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None

    def close(self) -> None:
        self.close_listener()
        self.trainers.close()  # first: an idle trainer saves what it has not yet
        self.engines.close()
        if self.wandb is not None:
            try:
                self.wandb.finish()
            except Exception:  # closing path: a reporting service must not stop the daemon
                log.exception("closing the Weights & Biases run failed")
            self.wandb = None
