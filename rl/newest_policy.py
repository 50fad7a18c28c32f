"""Phase 0's policy: the newest published checkpoint, never an older one in silence.

The master looks at the checkpoints before iteration N, newest first:

    checkpoints/iter-<k>/manifest.json     iteration k's training    what phase 0 does
    ----------------------------------     ----------------------    ----------------------
    read and parsed                        -                         serve k (version k+1)
    absent                                 never ran (no metrics)    look at k-1
    absent                                 ran (metrics/train.json)  PolicyUnavailable: it
                                                                     was published, now gone
    unreadable past the retry budget       -                         PolicyUnavailable
    none found                             -                         the initial model

A transient error (EIO, ESTALE, ETIMEDOUT: fsio.is_transient) is read again
for `budget_s`, a share of phase 0's deadline; a manifest that does not parse
is read again for coordination.read_retry_s, as every record.  Serving an
older policy instead would train the batch as on-policy while the engines
serve other weights (their probes match those, so phase 12's check cannot
tell): the phase fails, naming the checkpoint and the cause.

`newest_published` is the decision over what `look` observed; `look` does the
reading (tests give both real files with faults injected at the exact call).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final, TypeVar

import tenacity

from coordinator.errors import ActionError, MalformedRecordError
from coordinator.storage import fsio
from coordinator.storage.store import read_document
from rl import layout

log = logging.getLogger(__name__)
T = TypeVar("T")

# Of phase 0's deadline (phase_timeouts_s.sync), how long the master may keep
# reading a checkpoint that fails transiently: the workers wait for its release
# for the whole deadline from their own arrival, so half leaves them room.
READ_SHARE: Final = 0.5


class Look(str, enum.Enum):
    """What the master found of one checkpoint.

    PUBLISHED   its manifest reads and parses
    ABSENT      no manifest, and its iteration never trained: nothing was published
    LOST        no manifest, but its iteration trained: published once, now gone
    UNREADABLE  its manifest is there but cannot be read (past the retries) or parsed
    """

    PUBLISHED = "published"
    ABSENT = "absent"
    LOST = "lost"
    UNREADABLE = "unreadable"


@dataclass(frozen=True)
class Observation:
    look: Look
    detail: str = ""  # the error, for UNREADABLE and LOST


class PolicyUnavailable(ActionError):
    """The newest published policy cannot be served; an older one is not taken instead."""

    def __init__(self, *, iteration: int, checkpoint: Path, observed: Observation) -> None:
        self.iteration, self.checkpoint, self.observed = iteration, checkpoint, observed
        super().__init__(
            f"phase 0 of iteration {iteration}: the newest checkpoint {checkpoint} is "
            f"{observed.look.value} ({observed.detail}); an older policy is not served in its "
            "place, which would train on another policy's samples as on-policy: make the "
            "checkpoint readable (or restore it) and rerun the step, or run `coordinator "
            "recover` from the iteration that publishes it")


def newest_published(iteration: int, look: Callable[[int], Observation],
                     checkpoint: Callable[[int], Path]) -> int | None:
    """The iteration whose checkpoint phase 0 serves (None: the initial model), from what
    `look(k)` observed of each checkpoint k < `iteration`, newest first."""
    for k in range(iteration - 1, -1, -1):
        observed = look(k)
        if observed.look is Look.PUBLISHED:
            return k
        if observed.look is not Look.ABSENT:
            raise PolicyUnavailable(iteration=iteration, checkpoint=checkpoint(k),
                                    observed=observed)
    return None


def _read_patiently(path: Path, parse: Callable[[bytes, Path], T], *, budget_s: float,
                    sleep: Callable[[float], None]) -> T | None:
    """`path` read and parsed (None: absent), a transient error read again for
    `budget_s`; a torn or unparsable read is the record reader's (read_retry_s)."""
    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception(fsio.is_transient),
        stop=tenacity.stop_after_delay(budget_s),
        wait=tenacity.wait_exponential(multiplier=0.05, max=5.0),
        sleep=sleep, reraise=True,
        before_sleep=lambda state: log.warning(
            "reading %s failed (%s): reading it again, for up to %.0f s", path,
            state.outcome.exception() if state.outcome else "?", budget_s))
    return retrying(read_document, path, parse)


def look(run_dir: Path, k: int, *, budget_s: float,
         sleep: Callable[[float], None] = time.sleep) -> Observation:
    """What there is of iteration k's checkpoint (see Look)."""
    from trainer.checkpoint import MANIFEST_NAME, Manifest

    manifest = layout.checkpoint(run_dir, k) / MANIFEST_NAME
    try:
        if _read_patiently(manifest, Manifest.from_bytes, budget_s=budget_s,
                           sleep=sleep) is not None:
            return Observation(Look.PUBLISHED)
        trained = layout.metrics(run_dir, k, "train")
        if _read_patiently(trained, lambda _raw, _where: True, budget_s=budget_s,
                           sleep=sleep) is None:
            return Observation(Look.ABSENT)
        return Observation(Look.LOST, f"{manifest} is missing, but iteration {k} trained "
                                      f"and published it ({trained} exists)")
    except (MalformedRecordError, OSError) as exc:
        return Observation(Look.UNREADABLE, f"{type(exc).__name__}: {exc}")
