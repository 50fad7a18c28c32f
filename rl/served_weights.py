"""Phase 12's check that the engine serves the checkpoint it was given.

The trainer wrote into the checkpoint's manifest the log-probabilities its
weights give PROBE_COUNT fixed sequences (trainer/probes.py).  Here the node
asks its engine for the same sequences (a completion with echo and prompt
log-probabilities, once per data-parallel replica) and compares:

    mean |served - expected| <= tolerance      the engine serves these weights
    otherwise                                  WeightsNotServed: the phase fails,
                                               naming node, checkpoint, difference

The tolerance is engine.probe_tolerance, or the one of the coarser of the
trainer's and the engine's dtypes.  A checkpoint without probes (the initial
model, a user's directory) is not checked; that is logged.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator.errors import ActionError
from coordinator.storage import trees
from rollout.engines.control import EngineControl
from rollout.engines.engine import EngineConfig, EngineKind
from trainer.checkpoint import MANIFEST_NAME, read_manifest
from trainer.probes import ProbeCheck, ProbeSet, compare, moved, tolerance_for

log = logging.getLogger(__name__)


class WeightsNotServed(ActionError):
    """The engine's log-probabilities of the probes are not the checkpoint's."""

    def __init__(self, *, rank: int, host: str, checkpoint: Path, check: ProbeCheck,
                 replica: int) -> None:
        self.rank, self.host, self.checkpoint, self.check = rank, host, checkpoint, check
        probe, token = check.worst
        super().__init__(
            f"rank {rank} on host {host}: the inference engine does not serve checkpoint "
            f"{checkpoint.name}: its log-probabilities of the probe sequences differ from the "
            f"trainer's by {check.mean_abs_diff:.4g} on average (tolerance "
            f"{check.tolerance:.3g}), by {check.max_abs_diff:.4g} at most (probe {probe}, "
            f"token {token}, data-parallel replica {replica}); the weight update did not take "
            "effect: set engine.weight_update='restart' to cold-start the engine instead, and "
            "report the engine version")


@dataclass(frozen=True)
class Verdict:
    """What the check found, for the phase-12 payload and the logs."""

    probed: bool
    mean_abs_diff: float | None = None
    tolerance: float | None = None
    moved: float | None = None  # mean |new - previous| expected log-probabilities

    def payload(self) -> dict[str, Any]:
        if not self.probed:
            return {"probe": "skipped"}
        return {"probe_mean_abs_diff": self.mean_abs_diff, "probe_tolerance": self.tolerance,
                "probe_moved": self.moved}


def checkpoint_probes(model_dir: Path) -> ProbeSet | None:
    """The probes of a published checkpoint's manifest; None without manifest or probes."""
    if not trees.exists(model_dir / MANIFEST_NAME):
        return None
    return read_manifest(model_dir).probes


def _checkpoint_dtype(model_dir: Path) -> str | None:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    value = config.get("dtype") or config.get("torch_dtype")
    return value if isinstance(value, str) else None


def verify_served_weights(control: EngineControl, cfg: EngineConfig, model_dir: Path, *,
                          rank: int, host: str, previous: ProbeSet | None) -> Verdict:
    """Compare the engine's answers with the checkpoint's probes; WeightsNotServed if off."""
    probes = checkpoint_probes(model_dir) if cfg.verify_weights else None
    if probes is None:
        log.info("rank %d: %s has no probes (not trained by this run, or verify_weights off): "
                 "served weights not checked", rank, model_dir.name)
        return Verdict(probed=False)
    tolerance = cfg.probe_tolerance or tolerance_for(
        probes.dtype, cfg.served_dtype(_checkpoint_dtype(model_dir)))
    sequences = [s.token_ids for s in probes.sequences]
    replicas = cfg.data_parallel_size if cfg.kind is EngineKind.VLLM else 1
    worst: ProbeCheck | None = None
    for replica in range(replicas):
        served = control.prompt_logprobs(sequences, dp_rank=replica if replicas > 1 else None)
        check = compare(probes, served, tolerance)
        if not check.passed:
            raise WeightsNotServed(rank=rank, host=host, checkpoint=model_dir, check=check,
                                   replica=replica)
        worst = check if worst is None or check.mean_abs_diff > worst.mean_abs_diff else worst
    assert worst is not None
    shift = moved(previous, probes) if previous is not None else None
    if shift is not None and shift <= tolerance:
        log.warning("rank %d: %s moved the probes by only %.3g (tolerance %.3g): the check "
                    "cannot tell it from the previous weights this iteration", rank,
                    model_dir.name, shift, tolerance)
    log.info("rank %d: engine serves %s (probe difference %.3g, tolerance %.3g, moved %s)",
             rank, model_dir.name, worst.mean_abs_diff, tolerance,
             "n/a" if shift is None else f"{shift:.3g}")
    return Verdict(probed=True, mean_abs_diff=worst.mean_abs_diff, tolerance=tolerance,
                   moved=shift)
