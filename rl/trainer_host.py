"""One resident trainer per daemon: a torchrun group that lives for a whole session.

    phase 9   status(): this node's trainer (group, members, the iteration it
              holds; each process must answer a ping within a lease first) goes
              into the arrival; the master keeps the group when every member holds
              the same live one at iteration N-1, else starts a new one on a port
              it holds (rl/training.py, rl/trainer_group.py `group_to_keep`)
    phase 10  start(): stop any old group; torchrun ... -m trainer.resident; every
              local process connects on the node-local channel (trainer/channel.py)
              submit(): the job to every local process, then each one's "done",
              watching torchrun, the connections, the daemon's cancel event and
              torchrun.wall_limit_s; then the GPU must be free (NVML, as phase 7
              checks the engine) or the group is stopped
    watcher   a thread pings the processes every heartbeat (each answers from a
              thread of its own, busy or not): one that dies (its connection
              closes, torchrun exits) or does not answer for a lease is named in
              the log at once.  Between jobs its group is stopped and the next
              phase 9 reports no trainer, so the master starts a new group;
              during a job the tree is killed and phase 10 fails, naming it
    exit      close(): an idle trainer first saves what it trained since the last
              save (a clean stop), then stops; a lingering tree is killed

    TrainerState:  NONE ──start──► IDLE ──submit──► BUSY ──done──► IDLE
                   IDLE, BUSY ──death, hang, failure, stop──► NONE

While it trains, the torchrun tree is one of the daemon's children (a lost
peer kills it at once, coordinator/machine/runtime.py); between jobs it is not, so a
failure elsewhere leaves an idle, consistent trainer alone.  A daemon that
dies takes it along: torchrun gets PR_SET_PDEATHSIG tied to the daemon's
lifetime (forked by its spawner thread, coordinator/machine/lifetime.py), each
trainer process from torchrun's main thread (trainer/lifeline.py), and a
trainer whose channel closes exits.
"""

from __future__ import annotations

import enum
import logging
import os
import queue
import secrets
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from coordinator.errors import ActionError
from coordinator.machine.actions import StepContext
from coordinator.storage import fsio
from coordinator.storage.beneath import RUN_DIR_ENV
from rl import layout
from rl.config import RlSections
from rl.trainer_group import TrainerGroup
from rollout.engines.process import describe_exit, wait_gpu_released
from trainer.channel import MODEL_DIR_ENV, SOCKET_ENV, TOKEN_ENV, ChannelClosed
from trainer.lifeline import LAUNCHER_PID_ENV

log = logging.getLogger(__name__)
# An idle trainer asked to save on a clean stop: Slurm's KillWait defaults to
# 30 s before SIGKILL, so a save that cannot finish by then is not waited for.
SAVE_ON_STOP_TIMEOUT_S: Final = 25.0
LOG_NAME: Final = "trainer"


class TrainerState(str, enum.Enum):
    NONE = "none"  # no group on this node
    IDLE = "idle"  # a group, between jobs
    BUSY = "busy"  # a job in hand


class TrainerHost:
    def __init__(self, s: RlSections, *, rank: int, run_dir: Path, beat_s: float,
                 lease_s: float, cuda_visible_devices: str | None = None,
                 shares_gpus: bool = True) -> None:
        self.s = s
        # The GPUs run.train_nodes gives this node's trainer (None: the daemon's own).
        self.cuda_visible_devices = cuda_visible_devices
        # Whether the engine uses the trainer's GPUs between jobs (colocated): only
        # then must the trainer give them back after each job.
        self.shares_gpus = shares_gpus
        self.rank = rank
        self.run_dir = run_dir
        # coordination's heartbeat and lease: a trainer is pinged every beat and is
        # hung once it has not answered for a lease.
        self.beat_s, self.lease_s = beat_s, lease_s
        self.state = TrainerState.NONE
        self.lost: str | None = None  # why the last group was found dead or hung
        self._group: TrainerGroup | None = None
        self._lock = threading.RLock()
        self._host = ""

    @property
    def group(self) -> str | None:
        return self._group.name if self._group is not None else None

    # ------------------------------------------------------------- phase 9

    def status(self) -> dict[str, Any] | None:
        """This node's trainer as the master weighs it at phase 9 (None: none alive).

        Every process must answer a ping first, within a lease: a trainer that stopped
        answering since the watcher's last look is found here, not in the next job."""
        with self._lock:
            group = self._group
            if self.state is not TrainerState.IDLE or group is None:
                return None
            asked = group.ping()
        problem = None
        while problem is None and time.monotonic() < asked + self.lease_s:
            if group.stopped.is_set():
                return None  # the watcher found it gone meanwhile
            if group.answered_since(asked):
                return {"group": group.name, "members": list(group.members),
                        "through": group.through, "pid": group.proc.pid}
            problem = group.problem(self.lease_s, busy=False)  # drains what it reports
            time.sleep(0.01)
        silent = ", ".join(f"process {local} (pid {group.pids.get(local)})"
                           for local, last in group.last_pong.items() if last < asked)
        problem = problem or \
            f"hung: {silent} did not answer a ping within the lease ({self.lease_s:g} s)"
        self._lose(group, problem, "at the training phase's start")
        return None

    # ------------------------------------------------------------- phase 10

    def start(self, ctx: StepContext, *, group: str, members: Sequence[int],
              command: list[str], pass_fds: Sequence[int] = ()) -> None:
        """A new group on this node: torchrun `command` (trainer.resident), every local
        process connected.  Any group this node had is stopped first."""
        self.stop("a new group starts")
        channel_name = f"coordinator-trainer-{secrets.token_hex(12)}"
        token = secrets.token_hex(16)
        env = dict(os.environ)
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("OMP_NUM_THREADS", "1")  # one CPU thread per trainer process
        env[LAUNCHER_PID_ENV] = str(os.getpid())  # lets a trainer see that torchrun died early
        env[RUN_DIR_ENV] = str(self.run_dir)  # the trainer confines itself to it
        # ... and reads no model outside it but the initial one (a forged job's, refused)
        env[MODEL_DIR_ENV] = str(layout.initial_model(self.run_dir, self.s.model.path))
        env[fsio.READ_RETRY_ENV] = str(fsio.read_retry(None))  # coordination.read_retry_s
        env[SOCKET_ENV], env[TOKEN_ENV] = channel_name, token
        if self.cuda_visible_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.cuda_visible_devices
        self._host = ctx.host
        started = time.monotonic()
        fresh = TrainerGroup.spawn(group, members, command, env=env, pass_fds=pass_fds,
                                   log_path=layout.child_log(self.run_dir, self.rank, LOG_NAME))
        ctx.add_child(fresh.proc.pid, "torchrun (the resident trainer)")
        try:
            fresh.connect(channel_name, token, self.s.torchrun.nproc_per_node,
                          lambda: self._check_running(ctx, fresh, started, "starting"))
        except BaseException:
            fresh.stop(graceful=False)
            raise
        finally:
            ctx.remove_child(fresh.proc.pid)
        with self._lock:
            self._group, self.state, self.lost = fresh, TrainerState.IDLE, None
        threading.Thread(target=self._watch, args=(fresh,), daemon=True,
                         name="trainer-watch").start()
        log.info("rank %d: resident trainer group %s started (torchrun pid %d, %d processes%s) "
                 "in %.1f s", self.rank, group, fresh.proc.pid, len(fresh.channels),
                 "" if self.cuda_visible_devices is None
                 else f" on CUDA_VISIBLE_DEVICES={self.cuda_visible_devices}",
                 time.monotonic() - started)

    def submit(self, ctx: StepContext, job: Path, iteration: int) -> dict[str, Any]:
        """Train iteration `iteration` (job file `job`) on the group; its "done" summary."""
        with self._lock:
            group = self._group
            if self.state is not TrainerState.IDLE or group is None:
                raise ActionError(f"rank {self.rank} has no trainer to train iteration "
                                  f"{iteration}: {self.lost or 'none was started'}")
            self.state = TrainerState.BUSY
        started = time.monotonic()
        ctx.add_child(group.proc.pid, "torchrun (the resident trainer)")
        try:
            group.send_all({"op": "train", "job": str(job), "iteration": iteration})
            done = self._await_done(ctx, group, iteration, started)
        except ChannelClosed as exc:
            self.stop("its job failed", graceful=False)
            raise group.error(f"rank {self.rank}: the trainer's connection broke: {exc}") \
                from exc
        except BaseException:
            self.stop("its job failed", graceful=False)
            raise
        finally:
            ctx.remove_child(group.proc.pid)
        first = done[min(done)]
        with self._lock:
            self.state = TrainerState.IDLE
            group.through, group.saved_through = iteration, first.get("saved_through")
        self._check_gpu_released(group, first)
        return {"trainer_pid": group.proc.pid, "group": group.name,
                "train_s": first.get("train_seconds"), "job_s": time.monotonic() - started}

    def _await_done(self, ctx: StepContext, group: TrainerGroup, iteration: int,
                    started: float) -> dict[int, dict[str, Any]]:
        done: dict[int, dict[str, Any]] = {}
        doing = f"training iteration {iteration}"
        while len(done) < len(group.channels):
            self._check_running(ctx, group, started, doing)
            try:
                local, message, why = group.inbox.get(timeout=0.1)
            except queue.Empty:
                continue
            if message is None:
                raise group.error(f"rank {self.rank}: trainer process {local} (pid "
                                  f"{group.pids.get(local)}) closed its connection ({why}) "
                                  f"while {doing}")
            if message["op"] == "failed" and message.get("peer"):
                self._yield_to_the_cause(ctx, group, iteration, message)
                raise group.error(f"rank {self.rank}: the trainer lost a peer of its group while "
                                  f"{doing}, and no other node said why: {message.get('error')}")
            if message["op"] == "failed":
                raise group.error(f"rank {self.rank}: the trainer failed iteration {iteration}: "
                                  f"{message.get('error')}")
            if message["op"] == "done" and message.get("iteration") == iteration:
                done[local] = message
        return done

    def _yield_to_the_cause(self, ctx: StepContext, group: TrainerGroup, iteration: int,
                            message: Mapping[str, Any]) -> None:
        """The trainer failed because a peer of the group went away: that peer's own
        failure (a node lost, a trainer killed) is the one to name.  Its daemon reports
        it at once, and the phase machine then cancels this rank naming it; this failure
        is reported only if nothing comes within a lease and a heartbeat."""
        log.warning("rank %d: the trainer lost a peer of its group while training iteration "
                    "%d (%s); waiting up to %.0f s for that peer's own failure", self.rank,
                    iteration, str(message.get("error"))[:200], self.lease_s + self.beat_s)
        deadline = time.monotonic() + self.lease_s + self.beat_s
        while time.monotonic() < deadline:
            ctx.check_cancel()
            time.sleep(0.05)

    def _check_running(self, ctx: StepContext, group: TrainerGroup, started: float,
                       doing: str) -> None:
        if group.lost is not None and group.inbox.empty():  # the watcher found one hung
            raise group.error(f"rank {self.rank}: the trainer {group.lost} while {doing}")
        ctx.check_cancel()
        limit = self.s.torchrun.wall_limit_s
        if time.monotonic() - started > limit:
            raise group.error(f"rank {self.rank}: training passed torchrun.wall_limit_s="
                              f"{limit:g} while {doing}")
        if group.proc.returncode is not None and group.inbox.empty():
            raise group.error(f"rank {self.rank}: torchrun {describe_exit(group.proc.returncode)} "
                              f"while {doing}")

    def _check_gpu_released(self, group: TrainerGroup, done: Mapping[str, Any]) -> None:
        """After a job on a GPU the trainer must hold no more than its CUDA context, where
        the engine needs the GPU back."""
        if not done.get("gpu_mib") or not self.shares_gpus:
            return  # a CPU trainer, nothing reserved, or GPUs of its own: nothing to wait for
        t = self.s.torchrun
        holders = wait_gpu_released(group.pids.values(), t.release_timeout_s,
                                    allowed_mib=t.offload_residual_mib)
        if holders:
            listing = ", ".join(f"pid {p} ({mib} MiB)" for p, mib in sorted(holders.items()))
            log.warning("rank %d: after training the trainer still holds GPU memory (%s) above "
                        "torchrun.offload_residual_mib=%d: stopping it so the engine has the "
                        "GPU; it starts again from the saved state. Check train.offload, or "
                        "raise offload_residual_mib if the engine fits beside it", self.rank,
                        listing, t.offload_residual_mib)
            self.stop("it kept the GPU")

    # ------------------------------------------------------------- the watcher

    def _watch(self, group: TrainerGroup) -> None:
        """Ping every beat, idle or busy; a process that died or has not answered for a
        lease is named.  Idle: the group is stopped here.  Busy: its tree is killed and
        the job's wait fails, naming it."""
        while not group.stopped.wait(self.beat_s):
            with self._lock:
                if self._group is not group:
                    return
                busy = self.state is TrainerState.BUSY
                problem = group.problem(self.lease_s, busy=busy)
                if problem is None:
                    group.ping()
                    continue
            if busy:
                group.lost = problem
                log.error("rank %d on %s: the resident trainer (group %s) %s while training: "
                          "stopping it", self.rank, self._host, group.name, problem)
                group.proc.stop(grace_s=0.5)  # the job's wait sees it and fails, naming it
                return
            self._lose(group, problem, "between training phases")
            return

    def _lose(self, group: TrainerGroup, problem: str, when: str) -> None:
        with self._lock:
            if self._group is not group:
                return  # already lost (the watcher and phase 9 may look at once)
            group.lost = self.lost = problem
        log.error("rank %d on %s: the resident trainer (group %s) %s %s: stopping it; the next "
                  "training phase starts a new group from the saved state", self.rank,
                  self._host, group.name, problem, when)
        self.stop(problem, graceful=False)

    # ------------------------------------------------------------- stopping

    def stop(self, why: str, *, save: bool = False, graceful: bool = True) -> None:
        """Stop this node's group: with `save`, an idle one first saves what it has not;
        `graceful` lets the processes leave on their own first (not when dead or hung)."""
        with self._lock:
            group, idle = self._group, self.state is TrainerState.IDLE
            self._group, self.state = None, TrainerState.NONE
        if group is None:
            return
        if save and idle and group.through is not None and \
                group.through != group.saved_through:
            self._save_on_stop(group)
        ended = group.stop(graceful=graceful)
        log.info("rank %d: resident trainer group %s stopped (%s; torchrun %s)", self.rank,
                 group.name, why, ended)

    def _save_on_stop(self, group: TrainerGroup) -> None:
        try:
            group.send_all({"op": "save"})
        except ChannelClosed:
            return
        deadline = time.monotonic() + SAVE_ON_STOP_TIMEOUT_S
        answered: dict[int, Any] = {}
        while len(answered) < len(group.channels) and time.monotonic() < deadline:
            try:
                local, message, _ = group.inbox.get(timeout=0.1)
            except queue.Empty:
                continue
            if message is None:
                break
            if message["op"] == "saved":
                answered[local] = message.get("iteration")
        saved = sorted({v for v in answered.values() if v is not None})
        log.info("rank %d: on stopping, the trainer saved the state of iteration %s",
                 self.rank, saved or "none")

    def close(self) -> None:
        """The daemon exits: save what is unsaved if idle, then stop; never raises."""
        try:
            self.stop("the daemon exits", save=True)
        except Exception:  # shutdown path: log, never raise
            log.exception("stopping the resident trainer failed")
