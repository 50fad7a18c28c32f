"""Child-process lifecycle for inference servers: spawn, stop the whole tree, GPU release.

An inference server is restarted every RL iteration, and on a GPU node the
trainer that follows needs every byte of accelerator memory back.  So a stop
must leave nothing behind: not the server, not the workers it forked (vLLM
spawns engine-core and tensor-parallel worker processes, some of which leave
the process group), and not a CUDA context held by a zombie.

    spawn ──► running ──► stop(): SIGTERM to group + tree ──grace──► SIGKILL
                                  survivors (tree re-scanned) ──deadline──► report

Orphans: each child gets PR_SET_PDEATHSIG=SIGKILL, so if the daemon that
started it is SIGKILLed the server dies with it.  Linux delivers that signal
when the parent *thread* exits, so every child is forked by the process's
spawner thread (coordinator/machine/lifetime.py), which ends only with the process:
an engine started from a thread that returns (the rollout ahead of training,
rl/ahead.py) stays up.  Grandchildren do not inherit it; a SIGKILLed daemon
can leave vLLM workers behind, which the next stop cannot see.  That is a
known gap (no subreaper here), not silently handled.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import psutil

from coordinator.errors import UnsafeFileError
from coordinator.machine.lifetime import (
    describe_exit as describe_exit,  # re-exported: callers import it here
)
from coordinator.machine.lifetime import spawn
from coordinator.storage.fsio import open_append, open_regular
from rollout.errors import RolloutError

log = logging.getLogger(__name__)

_TAIL_BYTES: Final = 64 * 1024  # enough for ~50 lines of a Python traceback
_POLL_S: Final = 0.02  # exit polling; stop() runs once per iteration, cost is nil


@dataclass(frozen=True, kw_only=True)
class StopReport:
    """What stop() observed; shutdown reports instead of raising."""

    pid: int
    returncode: int | None
    escalated_to_sigkill: bool
    survivors: tuple[int, ...]
    tree_pids: tuple[int, ...]

    @property
    def clean(self) -> bool:
        return not self.survivors and self.returncode is not None


class ManagedProcess:
    """One child process in its own session, logging to a file, stoppable as a tree."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        log_path: Path,
        env: Mapping[str, str],
        cwd: Path | None = None,
        stdin_pipe: bool = False,
        pass_fds: Sequence[int] = (),
    ) -> None:
        if not argv:
            raise ValueError("argv is empty: give the server command to run")
        self.argv = tuple(argv)
        self.log_path = Path(log_path)
        # The log may sit in the run directory: appended to without ever
        # following a symlink, and refused when it is not a regular file.
        fd = open_append(self.log_path)
        with os.fdopen(fd, "ab", buffering=0) as logf:
            # One log file across restarts; the tail of this run starts here.
            logf.write(
                f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} start: {' '.join(self.argv)}\n".encode()
            )
            self.log_offset = logf.tell()
            self._popen = spawn(
                self.argv,
                stdin=subprocess.PIPE if stdin_pipe else subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=dict(env),
                cwd=cwd,
                start_new_session=True,
                close_fds=True,
                pass_fds=tuple(pass_fds),
            )
        self.pid = self._popen.pid
        # Every pid ever seen in the tree: GPU release is checked against all
        # of them, including workers that exited or re-parented before stop.
        self._seen: set[int] = {self.pid}
        log.info("started pid %d: %s (log %s)", self.pid, self.argv[0], self.log_path)

    def send_line(self, text: str) -> None:
        """Write one line to the child's stdin and close it (stdin_pipe=True only)."""
        if self._popen.stdin is None:
            raise ValueError("this process was started without stdin_pipe=True")
        if "\n" in text:
            raise ValueError(f"{text!r} contains a newline: send a single line")
        try:
            self._popen.stdin.write(text.encode() + b"\n")
            self._popen.stdin.close()
        except BrokenPipeError:
            pass  # the child died; the caller sees it through returncode

    @property
    def returncode(self) -> int | None:
        return self._popen.poll()

    def is_running(self) -> bool:
        return self._popen.poll() is None

    def tree(self) -> list[psutil.Process]:
        """The root and its live descendants (recursive), recorded as seen."""
        procs: list[psutil.Process] = []
        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            procs = []
        # Descendants that left the group are still found through the tree;
        # those already re-parented away are found through the group.
        with contextlib.suppress(psutil.Error):
            for p in psutil.process_iter(["pid"]):
                if p.pid not in {q.pid for q in procs} and _pgid(p.pid) == self.pid:
                    procs.append(p)
        self._seen.update(p.pid for p in procs)
        return procs

    def pids(self) -> tuple[int, ...]:
        """Live pids of the tree now (root first)."""
        return tuple(p.pid for p in self.tree())

    @property
    def seen_pids(self) -> tuple[int, ...]:
        return tuple(sorted(self._seen))

    def log_tail(self, n_lines: int = 40) -> str:
        return log_tail(self.log_path, n_lines, start=self.log_offset)

    def stop(self, *, grace_s: float, kill_timeout_s: float = 10.0,
             kill_expected: bool = False) -> StopReport:
        """SIGTERM the group and tree, wait `grace_s`, SIGKILL what is left, reap.
        `kill_expected`: what is left may ignore SIGTERM for a known reason, with
        nothing to lose (the caller says why): the SIGKILL is logged at INFO."""
        if self._popen.stdin is not None and not self._popen.stdin.closed:
            self._popen.stdin.close()
        procs = self.tree()
        escalated = False
        if self._popen.poll() is None or len(procs) > 0:
            _signal_all(self.pid, procs, signal.SIGTERM)
            survivors = self._wait(procs, grace_s)
            if survivors:
                escalated = True
                # Re-scan: the server may have forked while shutting down.
                procs = list({p.pid: p for p in [*survivors, *self.tree()]}.values())
                (log.info if kill_expected else log.warning)(
                    "pid %d: %d processes ignored SIGTERM for %gs, sending SIGKILL",
                    self.pid,
                    len(procs),
                    grace_s,
                )
                _signal_all(self.pid, procs, signal.SIGKILL)
                survivors = self._wait(procs, kill_timeout_s)
        else:
            survivors = []
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout=0.1)
        report = StopReport(
            pid=self.pid,
            returncode=self._popen.poll(),
            escalated_to_sigkill=escalated,
            survivors=tuple(sorted(p.pid for p in survivors)),
            tree_pids=self.seen_pids,
        )
        log.info(
            "stopped pid %d: %s, survivors %s",
            self.pid,
            describe_exit(report.returncode),
            report.survivors,
        )
        return report

    def _wait(self, procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
        """Wait for all of `procs` to exit; the root is reaped through Popen.

        psutil must not wait on the root: it would reap it with waitpid and
        Popen would then report exit status 0 for a process killed by a signal.
        """
        deadline = time.monotonic() + timeout_s
        others = [p for p in procs if p.pid != self.pid]
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        # Not psutil.wait_procs: a re-parented worker stays a zombie until its
        # new parent reaps it (a container's pid 1 may be slow to), yet a
        # zombie holds no memory, GPU or port any more: it counts as gone.
        alive = [p for p in others if _is_alive(p)]
        while alive and time.monotonic() < deadline:
            time.sleep(_POLL_S)
            alive = [p for p in alive if _is_alive(p)]
        if self._popen.poll() is None:
            alive.insert(0, psutil.Process(self.pid))
        return alive


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _is_alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _signal_all(pgid: int, procs: Iterable[psutil.Process], sig: signal.Signals) -> None:
    # Race: the group may already be empty; ESRCH then just means done.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
    for p in procs:
        # psutil checks the creation time, so a recycled pid is never signalled.
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            p.send_signal(sig)


def log_tail(path: Path, n_lines: int = 40, *, start: int = 0) -> str:
    """The last `n_lines` lines of a log file after byte `start` ('' if none)."""
    if n_lines < 1:
        raise ValueError(f"n_lines={n_lines} is below 1: ask for at least one line")
    try:
        fd = open_regular(path)  # never a FIFO that would block, never through a symlink
    except FileNotFoundError:
        return ""
    except UnsafeFileError as exc:
        return f"(log not shown: {exc})"
    with os.fdopen(fd, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(start, size - _TAIL_BYTES))
        data = f.read()
    lines = data.decode("utf-8", errors="replace").splitlines()
    return "\n".join(lines[-n_lines:])


def python_path(first: str, inherited: str | None) -> str:
    """A child's PYTHONPATH: `first` (the project's root), then what it inherited."""
    return first + (os.pathsep + inherited if inherited else "")


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the OS's choice for port 0).

    Another process can take it before the server binds it; the engine then
    reports the server's "address already in use" exit with its log tail.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# --- GPU release -----------------------------------------------------------

GpuQuery = Callable[[], dict[int, int]]
"""Returns {pid: used MiB} for every process holding accelerator memory."""

# One query of the GPUs' processes answers within this, or the driver is taken for
# hung: NVML is called in-process, where a wedged driver (an Xid or GSP hang, in which
# nvidia-smi hangs too) would block the wait that asked for ever.
GPU_QUERY_S: Final = 30.0


class GpuQueryHung(RolloutError, TimeoutError):
    """The GPU driver did not answer a query of its processes within GPU_QUERY_S."""


def _bounded(query: GpuQuery, seconds: float) -> dict[int, int]:
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = query()
        except BaseException as exc:  # raised in the caller's thread below
            box["error"] = exc

    thread = threading.Thread(target=run, name="gpu-query", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise GpuQueryHung(
            f"the GPU driver did not answer a query of its processes (NVML or nvidia-smi) "
            f"within {seconds:g} s: it may be hung (check `nvidia-smi` and the kernel log "
            "for Xid errors); the node may need a GPU reset")
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


def _nvml_query() -> dict[int, int]:
    import pynvml

    pynvml.nvmlInit()
    try:
        out: dict[int, int] = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                used = proc.usedGpuMemory or 0
                out[proc.pid] = out.get(proc.pid, 0) + used // (1024 * 1024)
        return out
    finally:
        pynvml.nvmlShutdown()


def parse_nvidia_smi_apps(text: str) -> dict[int, int]:
    """Parse `nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader`.

    Lines look like "12345, 1024 MiB"; memory may be "[N/A]" (counted as 0).
    """
    out: dict[int, int] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        pid_s, _, mem_s = line.partition(",")
        try:
            pid = int(pid_s.strip())
        except ValueError:
            continue  # a warning line from the driver, not a process row
        digits = "".join(ch for ch in mem_s if ch.isdigit())
        out[pid] = out.get(pid, 0) + (int(digits) if digits else 0)
    return out


def nvidia_smi_query(executable: str) -> GpuQuery:
    def query() -> dict[int, int]:
        res = subprocess.run(
            [executable, "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        return parse_nvidia_smi_apps(res.stdout)

    return query


def default_gpu_query() -> GpuQuery | None:
    """NVML if pynvml imports, else nvidia-smi if on PATH, else None (no GPU to watch)."""
    try:
        import pynvml  # noqa: F401
    except ImportError:
        pass
    else:
        return _nvml_query
    import shutil

    exe = shutil.which("nvidia-smi")
    return nvidia_smi_query(exe) if exe else None


def visible_gpu_count(env: dict[str, str]) -> int | None:
    """GPUs a server started with `env` can use: CUDA_VISIBLE_DEVICES when set, else
    the devices NVML (or nvidia-smi -L) lists; None when nothing can tell."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    try:
        import pynvml
    except ImportError:
        pass
    else:
        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    import shutil

    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    res = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=30, check=False)
    return sum(line.startswith("GPU ") for line in res.stdout.splitlines())


def wait_gpu_released(
    pids: Iterable[int],
    timeout_s: float,
    *,
    query: GpuQuery | None = None,
    poll_s: float = 0.5,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    allowed_mib: int = 0,
) -> dict[int, int]:
    """Wait until none of `pids` holds more than `allowed_mib` of accelerator memory;
    {} then, else (on timeout) the pids still holding it with their MiB, for the
    caller to report.  `allowed_mib` > 0 is for a sleeping server, which keeps
    its CUDA context.

    With no NVML and no nvidia-smi there is nothing to watch: returns at once.
    Inside a container NVML may report host pids, which never match ours; the
    check then passes vacuously (the tree was already verified gone by stop()).
    """
    watched = set(pids)
    q = query if query is not None else default_gpu_query()
    if q is None or not watched:
        return {}
    deadline = clock() + timeout_s
    while True:
        holders = {p: m for p, m in _bounded(q, GPU_QUERY_S).items()
                   if p in watched and m > allowed_mib}
        if not holders or clock() >= deadline:
            return holders
        sleep(poll_s)
