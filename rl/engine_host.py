"""One inference engine per daemon, running on the policy it is told to serve.

`ensure(ctx, model_dir)` makes the engine serve `model_dir`: a published
checkpoint is first copied into the node-local cache and verified against its
manifest (a tampered file is refused, naming it), then served from the local
copy by the engine's own verb (rollout/engines/serving.py: kept, reloaded in place
into the sleeping engine, started, restarted; a failed reload restarts), and
the served weights are checked against the checkpoint's probes
(served_weights.py).  `serve_chosen` (phase 1) is the same with the probes
checked even for a kept engine, after refusing a policy older than the one
the engine serves: phase 0's choice is then not the newest, and loading it
would train on another policy's samples as on-policy.  `release()` (phase 7) parks the engine (rollout/
serving.py: asleep, or stopped); either way the GPU is free for training.
The engine's process is registered with the daemon's runtime, so a lost peer
or a failure kills it at once.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from coordinator.errors import ActionError
from coordinator.machine.actions import StepContext
from coordinator.machine.runtime import Runtime
from coordinator.storage import trees
from rl import layout, node_local
from rl.config import RlSections
from rl.node_local import lock_dir, node_lock
from rl.sections import requests_in_flight
from rl.served_weights import checkpoint_probes, verify_served_weights
from rollout.agents import EngineEndpoint
from rollout.client import CompletionClient
from rollout.engines import serving
from rollout.engines.engine import Engine, EngineError, EngineState, make_engine
from rollout.engines.weight_updates import Parked, Served
from trainer.local_copy import remove_others
from trainer.probes import ProbeSet

log = logging.getLogger(__name__)
# A checkpoint copy on one node takes seconds to minutes; an hour means stuck.
CACHE_LOCK_TIMEOUT_S = 3600.0


class EngineHost:
    def __init__(self, s: RlSections, *, rank: int, run_dir: Path) -> None:
        self.s = s
        self.rank = rank
        self.run_dir = run_dir
        self._engine: Engine | None = None
        self._serving: Path | None = None
        self._version: int | None = None  # the policy version of _serving (rl/contracts.py)
        self._registered: int | None = None
        self._probes: ProbeSet | None = None  # of the checkpoint served before

    def cache_root(self, run_id: str) -> Path:
        """This node's cache of the run's checkpoints, shared by its daemons
        (rl/node_local.py: per user, under TMPDIR; the last daemon out removes it)."""
        return node_local.run_root(run_id, self.s.checkpoint.local_cache)

    @contextlib.contextmanager
    def local_copy(self, ctx: StepContext, model_dir: Path) -> Iterator[Path]:
        """A verified node-local copy of a published checkpoint (or a user model in place),
        held for reading while the block runs (trainer/local_copy.py held_copy).  The
        cache keeps one model (_prune_cache), so a delta advances its parent's copy in
        place where no other daemon of this node holds it: no clone of the model."""
        from trainer.checkpoint import CheckpointError
        from trainer.local_copy import held_copy

        if not trees.exists(model_dir / "manifest.json"):
            # A user's own model directory: served in place, there is no
            # manifest to verify it against.
            yield model_dir
            return
        root = self.cache_root(ctx.run_id)
        # Daemons of this node share the cache: one copies, the others reuse.
        with contextlib.ExitStack() as stack:
            with node_lock(lock_dir(root), "cache", timeout_s=CACHE_LOCK_TIMEOUT_S,
                           what="copying a checkpoint"):
                try:
                    local = stack.enter_context(held_copy(model_dir, root, advance=True))
                except CheckpointError as exc:
                    raise ActionError(f"refusing checkpoint {model_dir}: {exc}") from exc
            yield local

    def serve_chosen(self, ctx: StepContext, model_dir: Path, *, version: int) -> dict[str, Any]:
        """Phase 1: serve phase 0's choice, policy `version`, its probes checked even when
        the engine kept it; a policy older than the engine serves is refused, naming both."""
        if self._version is not None and self._version > version:
            assert self._serving is not None
            raise ActionError(
                f"rank {self.rank} on host {ctx.host}: phase 0 chose policy version {version} "
                f"({model_dir.name}), but this node's engine serves version {self._version} "
                f"({self._serving.name}), a newer one: an older policy is never served in place "
                "of the newest published one; check the checkpoints directory and run "
                f"`coordinator recover --iteration {ctx.iteration}`")
        return self.ensure(ctx, model_dir, version=version, recheck=True)

    def ensure(self, ctx: StepContext, model_dir: Path, *, version: int,
               recheck: bool = False) -> dict[str, Any]:
        """Serve `model_dir`, policy `version` (rollout/engines/serving.py decides how: kept,
        reloaded in place, started, restarted); then check the served weights against its
        probes (a kept engine's only with `recheck`)."""
        with self.local_copy(ctx, model_dir) as local:
            result = self._serve(ctx, local, version=version, recheck=recheck)
        if self._serving == local:  # served and checked: the older copies go
            self._prune_cache(local, self.cache_root(ctx.run_id))
        return result

    def _serve(self, ctx: StepContext, local: Path, *, version: int,
               recheck: bool) -> dict[str, Any]:
        if self._engine is None:
            self._engine = make_engine(
                self.s.engine, log_dir=layout.logs(self.run_dir, self.rank),
                port_file=layout.engine_port_file(self.run_dir, self.rank),
                # The daemon's, not this step's: the engine outlives the step (and
                # a rollout ahead's own stop must not cancel a later start).
                check_cancel=ctx.runtime.check_cancel,
                on_spawn=lambda pid: self._register(ctx.runtime, pid))
        engine = self._engine
        devices = self.s.engine.cuda_visible_devices
        log.info("rank %d: the %s engine is to serve %s%s", self.rank, self.s.engine.kind.value,
                 local, "" if devices is None else f" on CUDA_VISIBLE_DEVICES={devices}")
        try:
            how = serving.serve(engine, local, serving=self._serving)
        except EngineError as exc:
            self._serving, self._version = None, None
            raise ActionError(f"rank {self.rank} on host {ctx.host}: the {self.s.engine.kind.value}"
                              f" inference engine could not serve {local}: {exc}") from exc
        finally:
            self._register(ctx.runtime, engine.pid)
        if how is Served.KEPT and not recheck:  # verified when it was loaded
            return {"engine": how.value, "engine_pid": engine.pid}
        # Unknown until the probes say what it serves: a failed check is loaded again.
        self._serving, self._version = None, None
        verdict = verify_served_weights(
            engine.control(), self.s.engine, local, rank=self.rank, host=ctx.host,
            previous=None if how is Served.KEPT else self._probes)
        self._probes = checkpoint_probes(local)
        self._serving, self._version = local, version
        return {"engine": how.value, "engine_pid": engine.pid, **verdict.payload()}

    def _register(self, runtime: Runtime, pid: int | None) -> None:
        """The engine's process is the daemon's child from its spawn: a failure anywhere
        kills it, one still loading its weights too (and the start's readiness probe
        ends with it, instead of outlasting coordination.cancel_grace_s)."""
        if pid == self._registered:
            return
        if self._registered is not None:
            runtime.remove_child(self._registered)
        self._registered = pid
        if pid is not None:
            runtime.add_child(pid, f"{self.s.engine.kind.value} inference engine")

    def release(self, ctx: StepContext) -> dict[str, Any]:
        """Phase 7: free the accelerator for training (rollout/engines/serving.py: sleep, or
        stop in restart mode or when the sleep fails)."""
        parked = serving.park(self._engine)
        if parked is Parked.IDLE:
            return {}
        if parked is Parked.STOPPED:
            self._register(ctx.runtime, None)
            self._serving, self._version = None, None
            return {"engine": parked.value}
        assert self._engine is not None
        return {"engine": parked.value, "engine_pid": self._engine.pid}

    def _prune_cache(self, keep: Path, root: Path) -> None:
        """Old local copies go once the engine serves a newer one: the cache holds one model.

        Only copies inside the cache root: a user's model served in place lives
        elsewhere and is never touched.  The node's daemons move to a new policy
        together (phase 12), and the lock keeps a copy being made from going; a
        copy another daemon still reads (held_copy) stays.
        """
        if keep.parent != root or not root.is_dir():
            return
        with node_lock(lock_dir(root), "cache", timeout_s=CACHE_LOCK_TIMEOUT_S,
                       what="copying a checkpoint"):
            for child, gone in remove_others(root, keep):
                if gone:
                    log.info("rank %d: removed old cached model %s", self.rank, child)
                else:
                    log.info("rank %d: old cached model %s is still being read: kept",
                             self.rank, child)

    def endpoint(self) -> EngineEndpoint:
        """The engine as an agent plugin sees it (rollout/agents.py)."""
        engine = self._engine
        assert engine is not None
        return EngineEndpoint(engine.base_url, engine.api_key, self.s.engine.served_model_name,
                              self.client())

    def client(self) -> CompletionClient:
        engine = self._engine
        if engine is None or engine.state is not EngineState.READY:
            raise ActionError("no inference engine is running: ensure() must come first")
        r = self.s.rollout
        return CompletionClient(
            engine.base_url, engine.api_key, model=self.s.engine.served_model_name,
            concurrency=requests_in_flight(r, self.s.engine),
            request_timeout_s=self.s.engine.request_timeout_s,
            retries=r.request_retries, health_check=engine.check_alive,
        )

    def check_alive(self) -> None:
        if self._engine is not None and self._engine.state is EngineState.READY:
            self._engine.check_alive()

    def close(self) -> None:
        if self._engine is not None:
            try:
                self._engine.close()
            except Exception:  # shutdown path: log, never raise
                log.exception("closing the engine failed")
            self._engine = None
