"""The resident trainer: `python -m trainer.resident`, one process per GPU under torchrun,
alive for a whole session of the group and woken by its daemon for each iteration.

    connect to the daemon (trainer/channel.py) ── hello
    loop:   wait for a message (a thread of its own answers pings at once, busy or not)
            train JOB ─► first job: join the process group, open the session
                         (saved state, replay: trainer/train.py `prepare`)
                      ─► train the iteration, save the state when the job says,
                         publish checkpoint and metrics (trainer rank 0)
                      ─► weights, grads, optimizer to CPU memory (GPU only)
                      ─► done   (a failure: failed, then exit, the group is broken)
            save     ─► the iterations trained since the last save, this rank's
                        shard, no barrier (a clean stop: the others may be gone)
            stop / the daemon gone ─► exit

Its environment comes from the daemon: the channel's socket name and token
(channel.py), the run directory it is confined to, the daemon's pid (it dies
with torchrun, which dies with the daemon).  A failed job ends the process:
the ranks may have stopped in different places, so the daemon starts a new
group for the next attempt, from the saved state.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainer import worker
from trainer.channel import SOCKET_ENV, TOKEN_ENV, Channel, ChannelClosed, connect
from trainer.distributed import DistContext, env_int, exit_rank
from trainer.errors import TrainError
from trainer.session import Session
from trainer.train import prepare, train_iteration

log = logging.getLogger("trainer")


class Resident:
    """One trainer process's session across the jobs its daemon hands it."""

    def __init__(self, channel: Channel, run_dir: Path | None, rank: int, world: int) -> None:
        self.channel = channel
        self.run_dir = run_dir
        self.rank, self.world = rank, world
        self.ctx: DistContext | None = None
        self.session: Session | None = None
        self.state_dir: Path | None = None

    def serve(self) -> int:
        """Answer the daemon until it says stop or goes away; the process's exit code."""
        inbox: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._listen, args=(inbox,), daemon=True,
                         name="daemon-channel").start()
        while True:
            message = inbox.get()
            if message is None:
                log.error("the daemon is gone: exiting")
                return 1
            op = message["op"]
            if op == "train":
                code = self.train(message)
                if code:
                    return code
            elif op == "save":
                self.channel.send({"op": "saved", "iteration": self.save_unsaved()})
            elif op == "stop":
                log.info("stopped by the daemon")
                return 0
            else:
                log.warning("ignoring a %r message from the daemon", op)

    def _listen(self, inbox: queue.Queue[dict[str, Any] | None]) -> None:
        """Pings answered here, at once, busy or not: the daemon takes a process that
        stops answering (stopped, dead) for hung within a lease.  The rest is queued."""
        while True:
            try:
                message = self.channel.recv()
            except ChannelClosed as exc:
                log.error("lost the daemon's channel: %s", exc)
                inbox.put(None)
                return
            if message is not None and message["op"] == "ping":
                with contextlib.suppress(ChannelClosed):  # seen by the next recv
                    self.channel.send({"op": "pong", "n": message.get("n")})
            else:
                inbox.put(message)

    def train(self, message: dict[str, Any]) -> int:
        iteration = message.get("iteration")
        started = time.monotonic()
        try:
            job_path = message.get("job")
            if not isinstance(job_path, str):
                raise TrainError(f"the daemon sent no job path ({job_path!r})")
            job = worker.read_job(Path(job_path), self.run_dir)
            worker.setup_logging(self.rank, self.world, job.iteration)
            if self.ctx is None:
                self.ctx = worker.start_distributed(job)
                log.info("resident trainer on %s, strategy %s", self.ctx.device,
                         self.ctx.strategy.value)
            if self.session is None:
                self.session = prepare(job, self.ctx, run_dir=self.run_dir)
            self.state_dir = job.state_dir
            metrics = train_iteration(self.session, job, started=started)
            self.session.offload()
        except Exception as exc:
            code = worker.exit_code(exc)
            with contextlib.suppress(ChannelClosed):  # the daemon may be gone already
                self.channel.send({"op": "failed", "iteration": iteration,
                                   "error": f"{type(exc).__name__}: {exc}"[:4000],
                                   "peer": worker.lost_peer(exc)})
            return code
        gpu_mib = (torch.cuda.memory_reserved() >> 20) if torch.cuda.is_available() else 0
        self.channel.send({"op": "done", "iteration": job.iteration,
                           "seconds": time.monotonic() - started,
                           "train_seconds": metrics.get("seconds"),
                           "step": self.session.step,
                           "saved_through": self.session.saved_through, "gpu_mib": gpu_mib})
        return 0

    def save_unsaved(self) -> int | None:
        """A clean stop: this rank's shard of the state it trained since the last save;
        the iteration it saved, or None (nothing unsaved, or no shard of this rank's)."""
        session = self.session
        if session is None or self.state_dir is None or session.through <= session.saved_through:
            return None
        session.onload()
        wrote = session.save_state(self.state_dir, session.through, collective=False)
        return session.through if wrote else None


def main() -> int:
    run_dir = worker.prepare_process()
    rank, world = env_int("RANK", 0), env_int("WORLD_SIZE", 1)
    worker.setup_logging(rank, world, "-")
    name, token = os.environ.get(SOCKET_ENV), os.environ.get(TOKEN_ENV)
    if not name or not token:
        print(f"trainer: error: {SOCKET_ENV} and {TOKEN_ENV} are unset: a daemon starts the "
              "resident trainer (use `python -m trainer.train --job` by hand)", file=sys.stderr)
        return 2
    try:
        channel = connect(name)
    except OSError as exc:
        print(f"trainer: error: cannot reach the daemon's socket: {exc}", file=sys.stderr)
        return 1
    try:
        channel.send({"op": "hello", "token": token, "rank": rank, "world_size": world,
                      "local_rank": env_int("LOCAL_RANK", 0), "pid": os.getpid()})
        return Resident(channel, run_dir, rank, world).serve()
    except ChannelClosed as exc:
        log.error("lost the daemon: %s", exc)
        return 1
    finally:
        channel.close()
        if dist.is_initialized():
            with contextlib.suppress(Exception):  # shutdown after a failure must not mask it
                dist.destroy_process_group()


if __name__ == "__main__":
    exit_rank(main())  # not sys.exit: a gloo worker thread can abort interpreter shutdown
