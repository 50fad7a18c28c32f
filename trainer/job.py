"""One training iteration's job: which model, which batch, where the results go.

The coordinator writes it as JSON at phase 8 (rl/training.py); every trainer
rank reads it (`python -m trainer.train --job JOB.json`, or a resident
trainer woken by its daemon).  It is a versioned record parsed strictly: a
wrong type or a missing field is an error naming the field; unknown fields
are ignored so that newer writers can add fields without breaking older
readers.  Paths inside the run directory are written relative to it, so that
every node resolves them against its own mount.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from coordinator.storage.fsio import publish_bytes
from coordinator.storage.store import read_document
from trainer.config import ConfigError, TrainConfig, check

JOB_SCHEMA: Final = "coordinator/train-job"
JOB_VERSION: Final = 2


def _path_field(data: dict[str, Any], name: str, *, run_dir: Path | None,
                optional: bool = False) -> Path | None:
    """A job path: relative to the run directory (each node resolves it against its
    own mount), or absolute for a model outside the run directory."""
    if name not in data:
        raise ConfigError(f"train job is missing field {name!r}: the coordinator must set it")
    value = data[name]
    if value is None and optional:
        return None
    check(
        isinstance(value, str) and value != "" and "\0" not in value,
        f"train job field {name}={value!r} must be a non-empty path string",
    )
    path = Path(value)
    if path.is_absolute():
        return path
    check(".." not in path.parts,
           f"train job field {name}={value!r} climbs out of the run directory with '..'")
    check(run_dir is not None,
           f"train job field {name}={value!r} is relative to the run directory, but no run "
           "directory is known: start the trainer from the coordinator")
    return run_dir / path  # type: ignore[operator]


@dataclass(frozen=True, kw_only=True)
class TrainJob:
    """One iteration's inputs and outputs.

    `ref_model_dir` may be None only when `config.kl_coef` is 0.  `state_dir`
    holds the saved training states (trainer/train_state.py): with
    `save_state` this iteration's goes there once it is trained.

    A trainer that already holds iteration `iteration - 1` in memory (a
    resident one) trains this job at once.  A trainer started for it first
    loads `resume_model_dir` (default `model_dir`), then the saved state
    `resume_state` if any, then trains the iterations of the `replay` jobs
    again, publishing nothing, so that it holds exactly iteration
    `iteration - 1`.  The master fills these in (rl/training.py).
    """

    iteration: int
    model_dir: Path
    ref_model_dir: Path | None
    batch_path: Path
    out_dir: Path
    state_dir: Path
    metrics_path: Path
    config: TrainConfig = field(default_factory=TrainConfig)
    # The batch as the master published it: the trainer loads it only if it
    # still has exactly this size and SHA-256 (None: not checked, for tests
    # and standalone use).
    batch_bytes: int | None = None
    batch_sha256: str | None = None
    save_state: bool = False
    resume_state: Path | None = None
    resume_model_dir: Path | None = None
    replay: tuple[Path, ...] = ()
    # The batch may come from older policies (an asynchronous run): correct the
    # loss with truncated importance sampling (TrainConfig.tis_cap).
    off_policy: bool = False
    # The checkpoint to publish this one as a delta of (trainer/publisher.py: only when
    # this node kept its files); None: a full checkpoint.
    delta_parent: Path | None = None

    def __post_init__(self) -> None:
        check(
            isinstance(self.iteration, int)
            and not isinstance(self.iteration, bool)
            and self.iteration >= 0,
            f"iteration={self.iteration!r} must be an integer >= 0",
        )
        for name in ("model_dir", "batch_path", "out_dir", "state_dir", "metrics_path"):
            check(isinstance(getattr(self, name), Path), f"{name} must be a pathlib.Path")
        for name in ("ref_model_dir", "resume_state", "resume_model_dir", "delta_parent"):
            check(getattr(self, name) is None or isinstance(getattr(self, name), Path),
                   f"{name} must be a pathlib.Path or None")
        check(isinstance(self.replay, tuple) and all(isinstance(p, Path) for p in self.replay),
               f"replay={self.replay!r} must be a tuple of job paths")
        check(isinstance(self.save_state, bool), f"save_state={self.save_state!r} must be a bool")
        check(isinstance(self.off_policy, bool), f"off_policy={self.off_policy!r} must be a bool")
        check(
            self.ref_model_dir is not None or self.config.kl_coef == 0,
            f"kl_coef={self.config.kl_coef} needs a reference model: set ref_model_dir "
            "(usually the initial checkpoint) or set kl_coef=0",
        )
        check(
            self.out_dir.resolve() != self.model_dir.resolve(),
            f"out_dir {self.out_dir} is the input model_dir: give each iteration a new directory",
        )
        check(
            (self.batch_bytes is None) == (self.batch_sha256 is None)
            and (self.batch_bytes is None or (type(self.batch_bytes) is int
                                              and self.batch_bytes >= 0))
            and (self.batch_sha256 is None or (isinstance(self.batch_sha256, str)
                                               and len(self.batch_sha256) == 64)),
            f"batch_bytes={self.batch_bytes!r} and batch_sha256={self.batch_sha256!r} must be "
            "given together: a byte count and 64 hex digits",
        )

    @property
    def start_model_dir(self) -> Path:
        """The model a trainer started for this job loads first."""
        return self.resume_model_dir or self.model_dir

    def check_writes_inside(self, run_dir: Path) -> None:
        """Every path training writes must lie inside the run directory.

        The job file sits in the run directory, which others can write: a
        forged job must not make a trainer write anywhere else.
        """
        root = os.path.normpath(os.path.abspath(run_dir))
        for name in ("out_dir", "state_dir", "metrics_path"):
            path = os.path.abspath(getattr(self, name))
            check(
                ".." not in Path(getattr(self, name)).parts
                and os.path.commonpath([root, path]) == root and path != root,
                f"train job field {name}={str(getattr(self, name))!r} is not inside the run "
                f"directory {root}: the job file is forged or from another run",
            )

    def check_reads_from(self, run_dir: Path, model: Path) -> None:
        """Every model the job reads lies inside the run directory or is `model`, the
        initial model this node was configured with (model.path).  A forged job
        naming another directory would have the trainer load it and carry its files
        (tokenizer, config: every non-weight file) into a checkpoint the run shares."""
        root = os.path.normpath(os.path.abspath(run_dir))
        allowed = os.path.normpath(os.path.abspath(model))
        for name in ("model_dir", "ref_model_dir", "resume_model_dir"):
            value = getattr(self, name)
            if value is None:
                continue
            path = os.path.normpath(os.path.abspath(value))
            check(
                path == allowed or (".." not in Path(value).parts
                                    and os.path.commonpath([root, path]) == root),
                f"train job field {name}={str(value)!r} is neither inside the run directory "
                f"{root} nor this node's model.path {allowed}: the job file is forged or "
                "from another run",
            )

    def to_json(self, run_dir: Path | None = None) -> str:
        """The job file; paths inside `run_dir` are written relative to it, so that
        every node resolves them against its own mount of the run directory."""

        def written(value: Path | None) -> str | None:
            if value is not None and run_dir is not None and value.is_relative_to(run_dir):
                value = value.relative_to(run_dir)
            return None if value is None else value.as_posix()

        data: dict[str, Any] = {"schema": JOB_SCHEMA, "version": JOB_VERSION}
        data["iteration"] = self.iteration
        for name in _PATHS:
            data[name] = written(getattr(self, name))
        data["config"] = self.config.to_dict()
        data["batch_bytes"] = self.batch_bytes
        data["batch_sha256"] = self.batch_sha256
        data["save_state"] = self.save_state
        data["replay"] = [written(p) for p in self.replay]
        data["off_policy"] = self.off_policy
        return json.dumps(data, indent=2, sort_keys=False) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, *, source: str = "<job>",
                  run_dir: Path | None = None) -> TrainJob:
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"train job {source} is not valid JSON: {exc}") from exc
        check(isinstance(data, dict), f"train job {source} must be a JSON object")
        check(
            data.get("schema") == JOB_SCHEMA,
            f"train job {source} has schema {data.get('schema')!r}, expected {JOB_SCHEMA!r}",
        )
        check(
            data.get("version") == JOB_VERSION,
            f"train job {source} has version {data.get('version')!r}; this trainer reads "
            f"version {JOB_VERSION}: run matching coordinator and trainer versions",
        )
        data = {"delta_parent": None, **data}  # added since version 2: absent means full
        try:
            paths = {name: _path_field(data, name, run_dir=run_dir,
                                       optional=name in _OPTIONAL_PATHS) for name in _PATHS}
            replay = data.get("replay", [])
            check(isinstance(replay, list), f"replay={replay!r} must be a list of job paths")
            replayed = tuple(_path_field({"replay": p}, "replay", run_dir=run_dir)
                             for p in replay)
            return cls(
                iteration=data.get("iteration"),  # type: ignore[arg-type]  # checked in __post_init__
                **paths,  # type: ignore[arg-type]  # each checked in __post_init__
                config=TrainConfig.from_dict(data.get("config", {})),
                batch_bytes=data.get("batch_bytes"),
                batch_sha256=data.get("batch_sha256"),
                save_state=data.get("save_state", False),
                replay=replayed,  # type: ignore[arg-type]  # no None: replay paths are required
                off_policy=data.get("off_policy", False),
            )
        except ConfigError as exc:
            raise ConfigError(f"train job {source}: {exc}") from exc

    def save(self, path: Path, *, run_dir: Path | None = None) -> None:
        publish_bytes(path, self.to_json(run_dir).encode())

    @classmethod
    def load(cls, path: Path, *, run_dir: Path | None = None) -> TrainJob:
        """Read with the run directory's reader: a torn read is retried, never trusted.

        Relative paths resolve against `run_dir`, this node's mount of the run.
        """
        try:
            job = read_document(path, lambda raw, where: cls.from_json(
                raw, source=str(where), run_dir=run_dir))
        except OSError as exc:
            raise ConfigError(f"cannot read train job {path}: {exc}") from exc
        except ValueError as exc:  # a file planted where the job belongs, too big, ...
            raise ConfigError(f"train job {path}: {exc}") from exc
        if job is None:
            raise ConfigError(f"train job {path} does not exist: phase 8 writes it")
        return job


# The job's path fields, in the file's order; those that may be null.
_PATHS: Final = ("model_dir", "ref_model_dir", "batch_path", "out_dir", "state_dir",
                 "metrics_path", "resume_state", "resume_model_dir", "delta_parent")
_OPTIONAL_PATHS: Final = frozenset({"ref_model_dir", "resume_state", "resume_model_dir",
                                    "delta_parent"})
