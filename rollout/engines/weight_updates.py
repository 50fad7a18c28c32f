"""How new weights reach a running engine (`engine.weight_update`): one table.

    mode     phase 7 (a ready engine)   phase 12 (a ready engine on    server started with
                                        an older model)
    reload   ASLEEP: process kept,      UPDATED: paused, reloaded in   --enable-sleep-mode (where the
             weights released           place, resumed                 platform has it) and
                                                                       VLLM_SERVER_DEV_MODE=1
    restart  STOPPED                    RESTARTED: stopped, started    nothing more
                                        again

A sleeping engine is always RELOADED at phase 12 (only reload puts one to sleep);
a stopped one is STARTED.  `WEIGHT_UPDATES` maps each mode to its rule;
EngineConfig.update is the one place the setting is read, the verbs
(rollout/engines/serving.py) and the servers (server.py, hf.py, vllm.py) ask the
rule, PROTOCOL.md's table is generated from it (scripts/update_docs.py).  Nothing
outside rollout/engines reads the setting.  A new mode is one enum member and one
entry.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

DEV_MODE_ENV: Final = "VLLM_SERVER_DEV_MODE"  # as vLLM's envs.py reads it (an integer)


class WeightUpdate(str, enum.Enum):
    """The values of engine.weight_update."""

    RELOAD = "reload"
    RESTART = "restart"


class Parked(str, enum.Enum):
    """How phase 7 left the engine (its value is what phase 7's payload says)."""

    ASLEEP = "asleep"
    STOPPED = "stopped"
    IDLE = "idle"


class Served(str, enum.Enum):
    """How the engine came to serve a model (its value is phase 12's payload)."""

    KEPT = "kept"
    RELOADED = "reloaded"
    UPDATED = "updated in place"
    STARTED = "started"
    RESTARTED = "restarted"
    RESTARTED_AFTER_FAILED_RELOAD = "restarted after a failed reload"


@dataclass(frozen=True, kw_only=True)
class UpdateRule:
    park: Parked  # phase 7's verb for a ready engine
    serve: Served  # phase 12's verb for a ready engine serving another model
    # The server keeps its process between iterations: it is started with the
    # sleep and reload endpoints, and may sleep, wake and reload.
    keeps_process: bool
    # Added to the server's command where its platform has sleep mode (the hf
    # server's always; vLLM's CPU build has none: there sleeping pauses the engine).
    sleep_mode_flags: tuple[str, ...]
    server_env: Mapping[str, str]
    summary: str  # for the docs


WEIGHT_UPDATES: Final[Mapping[WeightUpdate, UpdateRule]] = {
    WeightUpdate.RELOAD: UpdateRule(
        park=Parked.ASLEEP, serve=Served.UPDATED, keeps_process=True,
        sleep_mode_flags=("--enable-sleep-mode",),
        server_env={DEV_MODE_ENV: "1"},  # registers /sleep, /wake_up, /collective_rpc
        summary="the engine's process is kept: asleep during training, the new weights "
                "loaded in place (a failed reload restarts it instead)"),
    WeightUpdate.RESTART: UpdateRule(
        park=Parked.STOPPED, serve=Served.RESTARTED, keeps_process=False,
        sleep_mode_flags=(), server_env={},
        summary="the engine is stopped for training and cold-started on the new weights "
                "(vLLM older than 0.16.0, or an engine on another host)"),
}
assert set(WEIGHT_UPDATES) == set(WeightUpdate), "WEIGHT_UPDATES must give every mode a rule"


def markdown_table() -> str:
    """PROTOCOL.md's weight-update table, from the table."""
    rows = ["| `engine.weight_update` | phase 7 (a ready engine) | phase 12 (a ready engine on "
            "an older model) | the server starts with | in words |", "|---|---|---|---|---|"]
    for mode, r in WEIGHT_UPDATES.items():
        flags = [f"`{f}` (where the platform has sleep mode)" for f in r.sleep_mode_flags]
        flags += [f"`{k}={v}`" for k, v in r.server_env.items()]
        rows.append(f"| `{mode.value}` | {r.park.value} | {r.serve.value} | "
                    f"{', '.join(flags) or 'nothing more'} | {r.summary} |")
    return "\n".join(rows)
