"""Where the RL loop keeps its files in the run directory (docs/PROTOCOL.md, layout).

Every path the loop reads or writes inside the run directory is built here,
from numbers checked by coordinator/records/layout.py, so no action code joins path
pieces by hand.

    iterations/<N>/shard-{train,eval}.json       phase 0, master
    iterations/<N>/{rollout,eval}/rank-<R>/      phases 1-3 and 6, rank R
    iterations/<N>/{rollout,eval}/rank-<R>.frozen.json   phase 0 decision, master:
                                                 what rank R saved before it was left out
    iterations/<N>/batch.pt                      phase 4, master
    iterations/<N>/metrics/{rollout,eval,train}.json
    iterations/<N>/train/job.json                phase 8, master
    checkpoints/iter-<N>/                        phase 10, trainer rank 0
    checkpoints/best.json                        phase 13, master (checkpoint.keep_best)
    train_state/iter-<N>/shard-<K>.{pt,json}     phase 10, trainer rank K, every
                                                 train.save_interval iterations
    tensorboard/                                 phase 13, master (event files)
    model-init/                                  phase 0 of iteration 0 (demo model)
    ranks/<R>/logs/<name>.log                    rank R's children
    ranks/<R>/engine.json                        rank R's engine (port, pid)
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Final

from coordinator.records import layout
from coordinator.records.bounds import check_rank

INITIAL_MODEL: Final = "model-init"
TRAIN_STATE_DIR: Final = "train_state"
TENSORBOARD_DIR: Final = "tensorboard"


class Split(str, Enum):
    """A task split; its rank outputs live in a directory of their own."""

    TRAIN = "train"
    EVAL = "eval"

    @property
    def directory(self) -> str:
        return "rollout" if self is Split.TRAIN else "eval"


def shard_plan(run_dir: Path, iteration: int, split: Split) -> Path:
    return run_dir / layout.iteration_dir(iteration) / f"shard-{split.value}.json"


def split_dir(run_dir: Path, iteration: int, split: Split) -> Path:
    return run_dir / layout.iteration_dir(iteration) / split.directory


def rank_dir(run_dir: Path, iteration: int, split: Split, rank: int) -> Path:
    return split_dir(run_dir, iteration, split) / f"rank-{check_rank(rank)}"


def frozen_manifest(run_dir: Path, iteration: int, split: Split, rank: int) -> Path:
    """The master's copy of what a rank that left had saved (ShardPlan.frozen)."""
    return split_dir(run_dir, iteration, split) / f"rank-{check_rank(rank)}.frozen.json"


def metrics(run_dir: Path, iteration: int, name: str) -> Path:
    if name not in ("rollout", "eval", "train"):
        raise ValueError(f"metrics {name!r} is not one of rollout, eval, train")
    return run_dir / layout.iteration_dir(iteration) / "metrics" / f"{name}.json"


def batch(run_dir: Path, iteration: int) -> Path:
    return run_dir / layout.iteration_dir(iteration) / "batch.pt"


def train_job(run_dir: Path, iteration: int) -> Path:
    return run_dir / layout.iteration_dir(iteration) / "train" / "job.json"


def checkpoint(run_dir: Path, iteration: int) -> Path:
    return run_dir / layout.checkpoint(iteration)


def checkpoints(run_dir: Path) -> Path:
    return run_dir / layout.CHECKPOINTS


def best_checkpoint(run_dir: Path) -> Path:
    """The record of the checkpoint kept as the best (rl/keep_best.py)."""
    return run_dir / layout.CHECKPOINTS / "best.json"


def tensorboard_dir(run_dir: Path) -> Path:
    return run_dir / TENSORBOARD_DIR


def train_state(run_dir: Path) -> Path:
    return run_dir / TRAIN_STATE_DIR


def initial_model(run_dir: Path, model_path: str = "") -> Path:
    """The run's initial model: model.path when given, else the model the run built."""
    return Path(model_path) if model_path else run_dir / INITIAL_MODEL


def child_log(run_dir: Path, rank: int, name: str) -> Path:
    return run_dir / layout.logs(rank) / f"{name}.log"


def logs(run_dir: Path, rank: int) -> Path:
    return run_dir / layout.logs(rank)


def engine_port_file(run_dir: Path, rank: int) -> Path:
    return run_dir / layout.rank_dir(rank) / "engine.json"
