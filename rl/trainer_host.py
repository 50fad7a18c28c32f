"""One resident trainer per daemon: a torchrun group that lives for a whole session.

    phase 9   status(): this node's trainer (group, members, the iteration it
              holds) goes into the arrival; the master keeps the group when every
              member holds the same live one at iteration N-1, else starts a new
              one on a port it holds (rl/training.py, `group_to_keep`)
    phase 10  start(): stop any old group; torchrun ... -m trainer.resident; wait
              for every local process's hello on the node-local channel
              (trainer/channel.py)
              submit(): the job to every local process, then wait for each "done",
              watching torchrun, the connections, the daemon's cancel event and
              torchrun.wall_limit_s; then the GPU must be free (NVML, as phase 7
              checks the engine) or the group is stopped
    between   a watcher thread pings the idle processes every heartbeat: one that
              dies (its connection closes, torchrun exits) or does not answer for a
              lease is named in the log and its group stopped at once; the next
              phase 9 reports no trainer, so the master starts a new group
    exit      close(): an idle trainer first saves what it trained since the last
              save (a clean stop), then stops; a lingering tree is killed

    TrainerState:  NONE ──start──► IDLE ──submit──► BUSY ──done──► IDLE
                   IDLE, BUSY ──death, hang, failure, stop──► NONE

While it trains, the torchrun tree is one of the daemon's children (a lost
peer kills it at once, coordinator/runtime.py); between jobs it is not, so a
failure elsewhere leaves an idle, consistent trainer alone.  A daemon that
dies takes it along: torchrun gets PR_SET_PDEATHSIG from the daemon's main
thread, each trainer process from torchrun, and a trainer whose channel
closes exits.
"""

from __future__ import annotations

import contextlib
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

from coordinator import fsio
from coordinator.actions import StepContext
from coordinator.beneath import RUN_DIR_ENV
from coordinator.errors import ActionError
from rl import layout
from rl.config import RlSections
from rollout.engines.process import ManagedProcess, describe_exit, wait_gpu_released
from trainer.channel import SOCKET_ENV, TOKEN_ENV, Channel, ChannelClosed, accept, listen
from trainer.lifeline import LAUNCHER_PID_ENV

log = logging.getLogger(__name__)
# An idle trainer asked to save on a clean stop: Slurm's KillWait defaults to
# 30 s before SIGKILL, so a save that cannot finish by then is not waited for.
SAVE_ON_STOP_TIMEOUT_S: Final = 25.0
# torchrun's exit after "stop": its agent waits for its workers, then leaves.
STOP_GRACE_S: Final = 5.0
LOG_NAME: Final = "trainer"


class TrainerState(str, enum.Enum):
    NONE = "none"  # no group on this node
    IDLE = "idle"  # a group, between jobs
    BUSY = "busy"  # a job in hand


def group_to_keep(statuses: Mapping[int, Any], members: Sequence[int], iteration: int) -> \
        str | None:
    """The master's phase-9 choice: the group every member's trainer is in, if all are
    alive in the same group of exactly these members and hold iteration N-1; else None
    (start a new one).  `statuses` are the phase-9 arrivals' `trainer` entries."""
    groups = set()
    for rank in members:
        status = statuses.get(rank)
        if not isinstance(status, Mapping) or status.get("through") != iteration - 1 \
                or list(status.get("members", [])) != list(members):
            return None
        groups.add(status.get("group"))
    if len(groups) != 1:
        return None
    group = groups.pop()
    return group if isinstance(group, str) and group else None


class TrainerHost:
    def __init__(self, s: RlSections, *, rank: int, run_dir: Path, beat_s: float,
                 lease_s: float) -> None:
        self.s = s
        self.rank = rank
        self.run_dir = run_dir
        # coordination's heartbeat and lease: an idle trainer is pinged every beat
        # and is hung once it has not answered for a lease.
        self.beat_s, self.lease_s = beat_s, lease_s
        self.state = TrainerState.NONE
        self.group: str | None = None
        self.members: tuple[int, ...] = ()
        self.through: int | None = None  # the iteration the trainer holds
        self.saved_through: int | None = None
        self.lost: str | None = None  # why the last group ended between jobs
        self._proc: ManagedProcess | None = None
        self._channels: dict[int, Channel] = {}
        self._pids: dict[int, int] = {}
        self._inbox: queue.Queue[tuple[int, dict[str, Any] | None, str]] = queue.Queue()
        self._last_pong: dict[int, float] = {}
        self._lock = threading.RLock()
        self._watch_stop = threading.Event()
        self._host = ""

    # ------------------------------------------------------------- phase 9

    def status(self) -> dict[str, Any] | None:
        """This node's trainer as the master weighs it at phase 9 (None: none alive)."""
        with self._lock:
            if self.state is not TrainerState.IDLE or self._proc is None \
                    or self._proc.returncode is not None:
                return None
            return {"group": self.group, "members": list(self.members), "through": self.through,
                    "pid": self._proc.pid}

    # ------------------------------------------------------------- phase 10

    def start(self, ctx: StepContext, *, group: str, members: Sequence[int],
              command: list[str], pass_fds: Sequence[int] = ()) -> None:
        """A new group on this node: torchrun `command` (trainer.resident), every local
        process connected.  Any group this node had is stopped first."""
        self.stop("a new group starts")
        name, token = f"coordinator-trainer-{secrets.token_hex(12)}", secrets.token_hex(16)
        server = listen(name)
        env = dict(os.environ)
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("OMP_NUM_THREADS", "1")  # one CPU thread per trainer process
        env[LAUNCHER_PID_ENV] = str(os.getpid())  # lets a trainer see that torchrun died early
        env[RUN_DIR_ENV] = str(self.run_dir)  # the trainer confines itself to it
        env[fsio.READ_RETRY_ENV] = str(fsio.read_retry(None))  # coordination.read_retry_s
        env[SOCKET_ENV], env[TOKEN_ENV] = name, token
        self._host = ctx.host
        started = time.monotonic()
        try:
            proc = ManagedProcess(command, log_path=layout.child_log(self.run_dir, self.rank,
                                                                     LOG_NAME),
                                  env=env, pass_fds=pass_fds)
            with self._lock:
                self._proc, self.group, self.members = proc, group, tuple(members)
                self.through = self.saved_through = None
                self.lost = None
            ctx.add_child(proc.pid, "torchrun (the resident trainer)")
            try:
                self._connect_all(ctx, server, token, started)
            finally:
                ctx.remove_child(proc.pid)
        except BaseException:
            server.close()
            self.stop("it did not start")
            raise
        server.close()  # every local process is in: nobody else may connect
        with self._lock:
            self.state = TrainerState.IDLE
            self._last_pong = dict.fromkeys(self._channels, time.monotonic())
        self._watch_stop = threading.Event()
        threading.Thread(target=self._watch, args=(self._watch_stop, proc), daemon=True,
                         name="trainer-watch").start()
        log.info("rank %d: resident trainer group %s started (torchrun pid %d, %d processes) "
                 "in %.1f s", self.rank, group, proc.pid, len(self._channels),
                 time.monotonic() - started)

    def _connect_all(self, ctx: StepContext, server: Any, token: str, started: float) -> None:
        expected = self.s.torchrun.nproc_per_node
        while len(self._channels) < expected:
            self._check_running(ctx, started, "starting")
            channel = accept(server, 0.2)
            if channel is None:
                continue
            try:
                hello = channel.recv(timeout=10.0)
            except ChannelClosed:
                hello = None
            local = hello.get("local_rank") if hello else None
            if not hello or hello.get("op") != "hello" or hello.get("token") != token \
                    or type(local) is not int or local in self._channels:
                channel.close()  # a stray or forged connection: not one of ours
                continue
            self._channels[local] = channel
            self._pids[local] = int(hello.get("pid", 0))
            threading.Thread(target=self._read, args=(local, channel), daemon=True,
                             name=f"trainer-read-{local}").start()

    def submit(self, ctx: StepContext, job: Path, iteration: int) -> dict[str, Any]:
        """Train iteration `iteration` (job file `job`) on the group; its "done" summary."""
        with self._lock:
            if self.state is not TrainerState.IDLE or self._proc is None:
                raise ActionError(f"rank {self.rank} has no trainer to train iteration "
                                  f"{iteration}: {self.lost or 'none was started'}")
            self.state, proc = TrainerState.BUSY, self._proc
        started = time.monotonic()
        ctx.add_child(proc.pid, "torchrun (the resident trainer)")
        try:
            for channel in self._channels.values():
                channel.send({"op": "train", "job": str(job), "iteration": iteration})
            done = self._await_done(ctx, iteration, started)
        except ChannelClosed as exc:
            self.stop("its job failed")
            raise ActionError(f"rank {self.rank}: the trainer's connection broke: {exc}; log "
                              f"tail:\n{proc.log_tail(20)}") from exc
        except BaseException:
            self.stop("its job failed")
            raise
        finally:
            ctx.remove_child(proc.pid)
        first = done[min(done)]
        with self._lock:
            self.state, self.through = TrainerState.IDLE, iteration
            self.saved_through = first.get("saved_through")
            self._last_pong = dict.fromkeys(self._channels, time.monotonic())
        self._check_gpu_released(first)
        return {"trainer_pid": proc.pid, "group": self.group,
                "train_s": first.get("train_seconds"), "job_s": time.monotonic() - started}

    def _await_done(self, ctx: StepContext, iteration: int,
                    started: float) -> dict[int, dict[str, Any]]:
        done: dict[int, dict[str, Any]] = {}
        while len(done) < len(self._channels):
            self._check_running(ctx, started, f"training iteration {iteration}")
            try:
                local, message, why = self._inbox.get(timeout=0.1)
            except queue.Empty:
                continue
            if message is None:
                raise self._error(f"trainer process {local} (pid {self._pids.get(local)}) "
                                  f"closed its connection ({why}) while training iteration "
                                  f"{iteration}")
            if message["op"] == "failed":
                raise self._error(f"the trainer failed iteration {iteration}: "
                                  f"{message.get('error')}")
            if message["op"] == "done" and message.get("iteration") == iteration:
                done[local] = message
        return done

    def _check_running(self, ctx: StepContext, started: float, doing: str) -> None:
        proc = self._proc
        assert proc is not None
        if ctx.runtime.cancel.is_set():
            self.stop("the group is stopping")
            ctx.check_cancel()
        limit = self.s.torchrun.wall_limit_s
        if time.monotonic() - started > limit:
            raise self._error(f"training passed torchrun.wall_limit_s={limit:g} while {doing}")
        if proc.returncode is not None and self._inbox.empty():
            raise self._error(f"torchrun {describe_exit(proc.returncode)} while {doing}")

    def _error(self, what: str) -> ActionError:
        proc = self._proc
        tail = proc.log_tail(20) if proc is not None else ""
        where = proc.log_path if proc is not None else "?"
        return ActionError(f"rank {self.rank}: {what} (log {where}); last lines:\n{tail}")

    def _check_gpu_released(self, done: Mapping[str, Any]) -> None:
        """After a job on a GPU the trainer must hold no more than its CUDA context."""
        if not done.get("gpu_mib"):
            return  # a CPU trainer, or nothing reserved: nothing to wait for
        t = self.s.torchrun
        holders = wait_gpu_released(self._pids.values(), t.release_timeout_s,
                                    allowed_mib=t.offload_residual_mib)
        if holders:
            listing = ", ".join(f"pid {p} ({mib} MiB)" for p, mib in sorted(holders.items()))
            log.warning("rank %d: after training the trainer still holds GPU memory (%s) above "
                        "torchrun.offload_residual_mib=%d: stopping it so the engine has the "
                        "GPU; it starts again from the saved state. Check train.offload, or "
                        "raise offload_residual_mib if the engine fits beside it", self.rank,
                        listing, t.offload_residual_mib)
            self.stop("it kept the GPU")

    # ------------------------------------------------------------- between jobs

    def _read(self, local: int, channel: Channel) -> None:
        """One process's messages: pongs noted here, everything else queued."""
        while True:
            try:
                message = channel.recv()
            except ChannelClosed as exc:
                self._inbox.put((local, None, str(exc)))
                return
            if message is None:
                continue
            if message["op"] == "pong":
                self._last_pong[local] = time.monotonic()
            else:
                self._inbox.put((local, message, ""))

    def _watch(self, stop: threading.Event, proc: ManagedProcess) -> None:
        beat, lease = self.beat_s, self.lease_s
        count = 0
        while not stop.wait(beat):
            with self._lock:
                if self._proc is not proc or self.state is not TrainerState.IDLE:
                    continue
                problem = self._idle_problem(proc, lease)
                if problem is None:
                    count += 1
                    for channel in self._channels.values():
                        with contextlib.suppress(ChannelClosed):  # seen on the next tick
                            channel.send({"op": "ping", "n": count})
                    continue
                self.lost = problem
                log.error("rank %d on %s: the resident trainer (group %s) %s between training "
                          "phases: stopping it; the next training phase starts a new group from "
                          "the saved state", self.rank, self._host, self.group, problem)
                self.stop(problem)

    def _idle_problem(self, proc: ManagedProcess, lease: float) -> str | None:
        if proc.returncode is not None:
            return f"exited: torchrun pid {proc.pid} {describe_exit(proc.returncode)}"
        while True:
            try:
                local, message, why = self._inbox.get_nowait()
            except queue.Empty:
                break
            if message is None:
                return (f"lost process {local} (pid {self._pids.get(local)}): its connection "
                        f"closed ({why})")
            log.warning("rank %d: unexpected %r from idle trainer process %d", self.rank,
                        message.get("op"), local)
        now = time.monotonic()
        for local, last in self._last_pong.items():
            if now - last > lease:
                return (f"hung: process {local} (pid {self._pids.get(local)}) has not answered "
                        f"for {now - last:.0f} s (lease {lease:g} s)")
        return None

    # ------------------------------------------------------------- stopping

    def stop(self, why: str, *, save: bool = False) -> None:
        """Stop this node's group (with `save`, an idle one first saves what it has not)."""
        with self._lock:
            proc, channels = self._proc, dict(self._channels)
            idle = self.state is TrainerState.IDLE
            self._proc, self.state = None, TrainerState.NONE
            self._channels, self._pids = {}, {}
            self._watch_stop.set()
        if proc is None:
            return
        if save and idle and self.through is not None and self.through != self.saved_through:
            self._save_on_stop(channels)
        for channel in channels.values():
            with contextlib.suppress(ChannelClosed):  # it may be gone already
                channel.send({"op": "stop"})
        deadline = time.monotonic() + STOP_GRACE_S
        while proc.returncode is None and time.monotonic() < deadline:
            time.sleep(0.05)
        report = proc.stop(grace_s=2.0)
        for channel in channels.values():
            channel.close()
        self._inbox = queue.Queue()
        log.info("rank %d: resident trainer group %s stopped (%s; torchrun %s)", self.rank,
                 self.group, why, describe_exit(report.returncode))

    def _save_on_stop(self, channels: Mapping[int, Channel]) -> None:
        for channel in channels.values():
            with contextlib.suppress(ChannelClosed):
                channel.send({"op": "save"})
        deadline = time.monotonic() + SAVE_ON_STOP_TIMEOUT_S
        answered: dict[int, Any] = {}
        while len(answered) < len(channels) and time.monotonic() < deadline:
            try:
                local, message, _ = self._inbox.get(timeout=0.1)
            except queue.Empty:
                continue
            if message is None:
                break
            if message["op"] == "saved":
                answered[local] = message.get("iteration")
        log.info("rank %d: on stopping, the trainer saved the state of iteration %s",
                 self.rank, sorted({v for v in answered.values() if v is not None}) or "none")

    def close(self) -> None:
        """The daemon exits: save what is unsaved if idle, then stop; never raises."""
        try:
            self.stop("the daemon exits", save=True)
        except Exception:  # shutdown path: log, never raise
            log.exception("stopping the resident trainer failed")
