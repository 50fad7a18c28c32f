"""Validation of command-line values, at the boundary, before anything is written.

Each function takes what the user typed and returns a checked value or raises
`UsageError` with the value, the rule and the fix; the commands in cli.py turn
that into exit code 2.  Nothing here touches the run directory except
`check_run_dir`, which only proves the directory can be written.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from coordinator.errors import ExitCode, UsageError
from coordinator.records.bounds import MAX_RANKS
from coordinator.storage import bucket_url, fsio
from rollout import rank_weights as weights
from rollout.rank_weights import Weights

RANK_ENV_VARS = ("RANK", "NODE_RANK", "SLURM_PROCID", "SKYPILOT_NODE_RANK")


def setup_logging(verbose: bool, rank: int | None = None) -> str:
    """Log to stderr; the format, for a daemon's log file too (coordinator/machine/daemon_log.py)."""
    level = logging.DEBUG if verbose else logging.INFO
    who = f"rank {rank} " if rank is not None else ""
    form = f"%(asctime)s %(levelname)s {who}%(name)s: %(message)s"
    logging.basicConfig(level=level, stream=sys.stderr, format=form)
    for noisy in ("watchdog", "urllib3", "filelock", "matplotlib", "PIL"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return form


def fail_usage(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(int(ExitCode.USAGE))


def parse_weights(text: str | None, *, num_nodes: int | None) -> Weights | None:
    """--rank-weights checked by the one rule (rollout/rank_weights.py), against
    --num-nodes when given."""
    if text is None:
        return None
    try:
        return weights.parse(text, num_nodes=num_nodes)
    except ValueError as exc:
        raise UsageError(f"--rank-weights {exc}" if str(exc).startswith("has ")
                         else f"--rank-weights {text!r}: {exc}") from None


def check_num_nodes(num_nodes: int | None) -> int | None:
    if num_nodes is None:
        return None
    if num_nodes < 1:
        raise UsageError(f"--num-nodes {num_nodes} is below 1: give the number of nodes, e.g. 3")
    if num_nodes > MAX_RANKS:
        raise UsageError(
            f"--num-nodes {num_nodes} is above {MAX_RANKS}, the most one run directory "
            "coordinates: give the number of nodes of this run, e.g. 3")
    return num_nodes


def resolve_rank(master: bool, worker: int | None) -> int:
    if master and worker is not None:
        raise UsageError(
            f"--master and --worker {worker} both given: a daemon is either the master (rank 0) "
            "or one worker; drop one of them"
        )
    if master:
        return 0
    if worker is not None:
        if worker < 1:
            raise UsageError(
                f"--worker {worker} is below 1: workers are ranks 1..N-1 (rank 0 is --master)"
            )
        if worker >= MAX_RANKS:
            raise UsageError(f"--worker {worker} is above {MAX_RANKS - 1}, the largest rank")
        return worker
    for var in RANK_ENV_VARS:
        value = os.environ.get(var)
        if value is not None:
            try:
                rank = int(value)
            except ValueError:
                raise UsageError(f"${var}={value!r} is not an integer rank") from None
            if not 0 <= rank < MAX_RANKS:
                raise UsageError(f"${var}={rank} is outside 0..{MAX_RANKS - 1}: ranks start at 0")
            return rank
    raise UsageError(
        "no rank given: pass --master on node 0 and --worker R on the others "
        f"(or set one of ${', $'.join(RANK_ENV_VARS)})"
    )


def run_dir_arg(text: str | None) -> Path:
    """The --run-dir as typed: required and never empty (an empty one would mean '.').

    A bucket URL (az://, s3://) is opened and checked here, and mounted at its
    node-local root (coordinator/storage/objstore.py), which the command then uses as the
    run directory's path: BucketError (exit 10) when it cannot be used.
    """
    if text is None:
        raise UsageError("--run-dir is required: the run directory on the shared filesystem "
                         "that every node mounts, e.g. --run-dir /shared/runs/exp1, or a "
                         "bucket, e.g. --run-dir az://runs/exp1")
    if bucket_url.is_bucket_url(text):
        from coordinator.storage import objstore  # obstore is loaded only for a bucket

        return objstore.attach(text)
    if not text.strip():
        raise UsageError(
            f"--run-dir {text!r} is empty: give the run directory on the shared filesystem, "
            "e.g. --run-dir /shared/runs/exp1 (use --run-dir . for the current directory)")
    if "\0" in text:
        raise UsageError("--run-dir contains a NUL byte: give a plain directory path")
    return Path(text).expanduser().absolute()


def existing_run_dir(text: str | None) -> Path:
    """--run-dir of a command that reads a run (status, recover): it must exist."""
    path = run_dir_arg(text)
    if not path.is_dir():
        raise UsageError(f"--run-dir {path} is not a directory: give the run directory")
    return path


def check_run_dir(path: Path) -> Path:
    """Make the run directory (mode 0755) and prove this user can write it."""
    if path.exists() and not path.is_dir():
        raise UsageError(
            f"--run-dir {path} is a file, not a directory: give a directory on the shared "
            "filesystem that every node mounts"
        )
    try:
        fsio.ensure_dir(path)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-", suffix=".tmp"):
            pass
    except OSError as exc:
        raise UsageError(
            f"--run-dir {path} is not writable ({exc.strerror}): give a directory this user can "
            "write on the shared filesystem"
        ) from None
    except Exception as exc:  # StorageError and the like: the same verdict, with its words
        raise UsageError(f"--run-dir {path} is not writable: {exc}") from None
    return path


def set_dotted(target: dict[str, Any], key: str, value: Any, *, given: str = "") -> None:
    parts = key.split(".")
    if not all(parts):
        raise UsageError(f"--set {given or key!r}: {key!r} has an empty section or key name; "
                         "write section.key=value, e.g. train.lr=1e-4")
    node = target
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            prefix = ".".join(parts[:depth + 1])
            raise UsageError(
                f"--set {given or key!r} puts a key under {prefix!r}, which another --set "
                f"already gave the value {child!r}: a section cannot be both; drop one of them")
        node = child
    if isinstance(node.get(parts[-1]), dict) and not isinstance(value, dict):
        raise UsageError(
            f"--set {given or key!r} gives section {key!r} a single value, but another --set "
            "already put keys under it: drop one of them")
    node[parts[-1]] = value


def parse_set(items: list[str],
              declared: Callable[[str], Any] | None = None) -> dict[str, Any]:
    """--set items as a config tree.  `declared(key)` gives a setting's declared type:
    its text is read as that type (coordinator/config/settings.py from_text: a string as it
    is, so --set model.path=123 is a path); a key without one is read as JSON, else
    as text (an unknown key is refused later, naming the closest setting)."""
    import json

    from coordinator.config.settings import from_text

    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--set {item!r} must look like section.key=value, e.g. train.lr=1e-4")
        hint = declared(key) if declared is not None else None
        if hint is not None:
            value = from_text(text, hint, key)
        else:
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                value = text
        set_dotted(out, key, value, given=item)
    return out
