"""The engine's verbs around training: park it for the trainer, serve a checkpoint.

    park(engine)                  phase 7: the accelerator is freed for training
        ASLEEP     weight_update "reload": weights and KV cache released, the
                   process kept (a failed sleep falls back to STOPPED)
        STOPPED    weight_update "restart"
        IDLE       nothing was serving
    serve(engine, model, serving) phase 12, and the first start: `model` is served
        KEPT       already served by a ready engine
        RELOADED   loaded in place into the sleeping engine (a failed reload
                   falls back to RESTARTED_AFTER_FAILED_RELOAD)
        UPDATED    a ready engine on another model (it kept serving through
                   training: a disaggregated placement), updated between
                   requests: paused, reloaded in place, resumed (a failure
                   falls back to RESTARTED_AFTER_FAILED_RELOAD)
        STARTED    no engine was up
        RESTARTED  a ready engine on another model that cannot reload in place
                   (weight_update "restart"), stopped and started again

Which verb does what is a pure decision of (engine state, engine.weight_update's
rule as EngineConfig.update gives it: rollout/engines/weight_updates.py, whether
the model is the one served): `park_step` and `serve_step`, each a table tested
entry by entry.
The RL loop calls the verbs (rl/engine_host.py) and never decides between
sleeping and stopping itself.  Where vLLM has no sleep mode (its CPU build) sleeping
pauses the engine and keeps its weights: the decisions are the same.
"""

from __future__ import annotations

import logging
from pathlib import Path

from rollout.engines.config import EngineError, EngineState
from rollout.engines.engine import Engine
from rollout.engines.weight_updates import Parked, Served, UpdateRule

log = logging.getLogger("rollout.engines.engine")


def park_step(state: EngineState | None, update: UpdateRule) -> Parked:
    """Phase 7's decision: only a ready engine is parked, as the weight-update mode's
    rule says (asleep, or stopped)."""
    if state is not EngineState.READY:
        return Parked.IDLE
    return update.park


def serve_step(state: EngineState | None, update: UpdateRule, *, same_model: bool) -> Served:
    """Phase 12's decision (and the first start's): keep, update or reload in place, start."""
    if state is EngineState.READY:
        if same_model:
            return Served.KEPT
        return update.serve
    if state is EngineState.SLEEPING:
        return Served.RELOADED
    return Served.STARTED


def park(engine: Engine | None) -> Parked:
    """Free the accelerator: sleep, or stop (restart mode, or a sleep that failed)."""
    if engine is None:
        return Parked.IDLE
    step = park_step(engine.state, engine.config.update)
    if step is Parked.IDLE:
        return Parked.IDLE
    if step is Parked.ASLEEP:
        try:
            engine.sleep()
            return Parked.ASLEEP
        except EngineError as exc:
            log.warning("putting the %s engine to sleep failed, stopping it instead: %s",
                        engine.config.kind.value, exc)
    engine.stop()
    return Parked.STOPPED


def serve(engine: Engine, model_dir: Path, *, serving: Path | None) -> Served:
    """Make `engine` serve `model_dir`; EngineError when it cannot start.  A reload
    that fails is logged and replaced by a restart (RFC 48920: a failed reload
    may leave a mix of old and new weights, which must not be served)."""
    step = serve_step(engine.state, engine.config.update, same_model=serving == model_dir)
    if step is Served.KEPT:
        engine.check_alive()
        return step
    if step in (Served.RELOADED, Served.UPDATED):
        try:
            if step is Served.RELOADED:
                engine.load_weights(model_dir)
            else:
                engine.update_weights(model_dir)
            return step
        except EngineError as exc:
            log.warning("reloading %s in place failed, restarting the engine instead: %s",
                        model_dir.name, exc)
            step = Served.RESTARTED_AFTER_FAILED_RELOAD
    if engine.state is not EngineState.STOPPED:
        engine.stop()
    engine.start(model_dir)
    return step
