"""One node's share of a resident trainer group: its torchrun and the channels to its processes.

    TrainerGroup.spawn   torchrun ... -m trainer.resident with the channel's name and
                         token in its environment; every local process connects and says
                         hello (trainer/channel.py); a reader thread per process
    ping / problem       signs of life: a pong updates `last_pong`; anything else goes to
                         the group's own inbox, so a reader left over from an old group
                         can never speak for a new one
    stop                 "stop" to every process (or not, when dead or hung), then the
                         torchrun tree stopped, channels closed

`group_to_keep` is the master's phase-9 choice between keeping the group and
starting a new one: a pure function of what the ranks reported.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import psutil

from coordinator.errors import ActionError
from rollout.engines.process import ManagedProcess, describe_exit
from trainer.channel import Channel, ChannelClosed, accept, listen

log = logging.getLogger(__name__)
# The trainer processes' own exit after "stop" (they hold nothing to flush).
STOP_GRACE_S: Final = 5.0
# torchrun's agent, once its processes left: SIGTERM lets it tear down, unless it
# waits in its exit barrier for the other nodes' agents (a C++ store wait that no
# signal handler interrupts, up to 300 s), which their daemons end when they stop.
AGENT_GRACE_S: Final = 2.0
HELLO_TIMEOUT_S: Final = 10.0  # a connection that says nothing this long is not ours
CONNECT_PROGRESS_S: Final = 30.0  # while a group's processes connect, a line this often

Message = tuple[int, dict[str, Any] | None, str]  # local rank, message (None: closed), why


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


@dataclass(eq=False)
class TrainerGroup:
    """This node's torchrun of group `name`, and a channel to each of its processes."""

    name: str
    members: tuple[int, ...]
    proc: ManagedProcess
    channels: dict[int, Channel] = field(default_factory=dict)  # by local rank
    pids: dict[int, int] = field(default_factory=dict)
    inbox: queue.Queue[Message] = field(default_factory=queue.Queue)
    last_pong: dict[int, float] = field(default_factory=dict)
    through: int | None = None  # the iteration the weights hold
    saved_through: int | None = None  # the newest iteration whose state it saved
    lost: str | None = None  # why it was found dead or hung
    pings: int = 0
    stopped: threading.Event = field(default_factory=threading.Event)

    @classmethod
    def spawn(cls, name: str, members: Sequence[int], command: Sequence[str], *,
              env: Mapping[str, str], log_path: Path, pass_fds: Sequence[int]) -> TrainerGroup:
        return cls(name=name, members=tuple(members),
                   proc=ManagedProcess(command, log_path=log_path, env=env, pass_fds=pass_fds))

    def connect(self, server_name: str, token: str, expected: int,
                check: Any) -> None:
        """Accept `expected` processes that prove themselves with `token`; `check()` is
        called between tries and raises to give up (cancel, deadline, torchrun gone)."""
        server = listen(server_name)
        started = said = time.monotonic()
        try:
            while len(self.channels) < expected:
                check()
                if time.monotonic() - said >= CONNECT_PROGRESS_S:  # a slow start, said why
                    said = time.monotonic()
                    log.info("trainer %s: %d of %d local process(es) connected after %.0f s "
                             "(torchrun pid %s, log %s): each connects once torch is imported "
                             "and every node's torchrun has joined the rendezvous; a node whose "
                             "daemon has not started its torchrun holds every other", self.name,
                             len(self.channels), expected, said - started, self.proc.pid,
                             self.proc.log_path)
                channel = accept(server, 0.2)
                if channel is None:
                    continue
                try:
                    hello = channel.recv(timeout=HELLO_TIMEOUT_S)
                except ChannelClosed:
                    hello = None
                local = hello.get("local_rank") if hello else None
                if not hello or hello.get("op") != "hello" or hello.get("token") != token \
                        or type(local) is not int or local in self.channels:
                    channel.close()  # a stray or forged connection: not one of ours
                    continue
                self.channels[local] = channel
                self.pids[local] = int(hello.get("pid", 0))
                self.last_pong[local] = time.monotonic()
                threading.Thread(target=self._read, args=(local, channel), daemon=True,
                                 name=f"trainer-read-{local}").start()
        finally:
            server.close()  # every local process is in: nobody else may connect

    def _read(self, local: int, channel: Channel) -> None:
        """One process's messages: pongs noted here, everything else to this group's inbox."""
        while True:
            try:
                message = channel.recv()
            except ChannelClosed as exc:
                self.inbox.put((local, None, str(exc)))
                return
            if message is not None and message["op"] == "pong":
                self.last_pong[local] = time.monotonic()
            elif message is not None:
                self.inbox.put((local, message, ""))

    def send_all(self, message: dict[str, Any]) -> None:
        for channel in self.channels.values():
            channel.send(message)

    def ping(self) -> float:
        """Ask every process for a sign of life; returns when it was asked."""
        self.pings += 1
        asked = time.monotonic()
        for channel in self.channels.values():
            with contextlib.suppress(ChannelClosed):  # a closed one is seen by its reader
                channel.send({"op": "ping", "n": self.pings})
        return asked

    def answered_since(self, asked: float) -> bool:
        return all(last >= asked for last in self.last_pong.values())

    def problem(self, lease_s: float, *, busy: bool) -> str | None:
        """Why the group is no longer usable: a closed connection or torchrun gone (idle
        only: a job in hand reads its own inbox and sees those with the trainer's own
        words), or a process that has not answered for a lease."""
        while not busy:
            try:
                local, message, why = self.inbox.get_nowait()
            except queue.Empty:
                break
            if message is None:
                return (f"lost process {local} (pid {self.pids.get(local)}): its connection "
                        f"closed ({why})")
            log.warning("unexpected %r from idle trainer process %d", message.get("op"), local)
        if not busy and self.proc.returncode is not None:
            return f"exited: torchrun pid {self.proc.pid} {describe_exit(self.proc.returncode)}"
        now = time.monotonic()
        for local, last in self.last_pong.items():
            if now - last > lease_s:
                return (f"hung: process {local} (pid {self.pids.get(local)}) has not answered "
                        f"for {now - last:.0f} s (lease {lease_s:g} s)")
        return None

    def error(self, what: str) -> ActionError:
        return ActionError(f"{what} (log {self.proc.log_path}); last lines:\n"
                           f"{self.proc.log_tail(20)}")

    def stop(self, *, graceful: bool) -> str:
        """Stop the processes (asked first when `graceful`) and the torchrun tree; how it
        ended."""
        self.stopped.set()
        if graceful:
            for channel in self.channels.values():
                with contextlib.suppress(ChannelClosed):  # it may be gone already
                    channel.send({"op": "stop"})
            # The processes leave at once; torchrun's agent would then wait for the
            # other nodes' agents (its exit barrier), so it is not waited for.
            deadline = time.monotonic() + STOP_GRACE_S
            while any(_alive(pid) for pid in self.pids.values()) and \
                    time.monotonic() < deadline:
                time.sleep(0.05)
        # Processes gone after a stop: the agent holds nothing, only waits (its barrier).
        drained = graceful and not any(_alive(pid) for pid in self.pids.values())
        report = self.proc.stop(grace_s=AGENT_GRACE_S if graceful else 0.5,
                                kill_expected=drained)
        for channel in self.channels.values():
            channel.close()
        return describe_exit(report.returncode)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
