"""The lifecycle shared by both engines: an OpenAI-compatible server run as a child process.

Both engines (the CPU `hf` server of this package and `vllm serve`) are the
same thing seen from the coordinator: a command line, a port, an API key, a
log file.  `ServerEngine` owns that lifecycle; subclasses only build the
command and its environment.

    STOPPED ──start()──► STARTING ──a real completion succeeds──► READY ◄─────────┐
       ▲                    │ died / not ready in time          │    sleep()     │ load_weights(dir)
       │                    ▼                                   │       ▼        │ or wake_up()
       └──── STOPPED ◄── STOPPING ◄───────── stop() ────────────┴── SLEEPING ───┘
                FAILED: the server died, stop() could not release it, or a
                        sleep/wake/reload step failed; start() again (it cleans
                        up first) or stop().

Sleeping (weight_update = "reload") the server process stays up with its
weights and KV cache released; load_weights wakes it on a new checkpoint in
place (control.py has the request sequence).  The server is started
for it with --enable-sleep-mode and VLLM_SERVER_DEV_MODE=1.

Waits for / released by:
    start()  waits for  the server answering one completion (ready_timeout_s),
                        or until check_cancel raises (then stops the server)
    stop()   waits for  the whole process tree to exit (stop_grace_s, then
                        SIGKILL) and for the GPU memory of those pids to be
                        released (gpu_release_timeout_s)
    sleep()  waits for  /sleep, then each server process to hold at most
                        sleep_gpu_residual_mib (gpu_release_timeout_s)
    load_weights()      each request at most request_timeout_s

close() is stop() plus ending whatever an engine keeps for its next start
(the hf engine's warm spare, see hf.py); call it at daemon shutdown.
Engines are driven from one thread at a time; whichever starts the server,
it dies with the daemon, not with that thread (process.py, PR_SET_PDEATHSIG).
The port file, when given, holds
{"version": 1, "kind", "host", "port", "pid", "model_dir"} (never the key).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

import tenacity

from coordinator.storage.fsio import publish_bytes, remove
from rollout.engines import process as proc_mod
from rollout.engines.config import (
    EngineConfig,
    EngineDied,
    EngineError,
    EngineKind,
    EngineStartError,
    EngineState,
    EngineStateError,
    GpuNotReleased,
)
from rollout.engines.control import EngineControl, WeightUpdateError

# The logger of the public module, as before the split: log filters and
# greps of daemon logs for "rollout.engines.engine" keep matching lifecycle lines.
log = logging.getLogger("rollout.engines.engine")

PORT_FILE_VERSION: Final = 1
_READY_PROMPT: Final = "1"  # one character: valid for every tokenizer, tiny ones included
# A server that is up (/health answers) and fails the readiness completion with a
# server error this many times in a row is broken, not still loading.
READY_SERVER_ERRORS: Final = 3
# How far back a dead server's log is searched for the cause it stated.
CAUSE_SEARCH_LINES: Final = 400


# While an engine starts, a line at most this often says it still waits, and on what.
READY_PROGRESS_S: Final = 30.0


class _NotReady(Exception):
    """One readiness probe failed in a way worth retrying."""


class ServerEngine:
    """Shared lifecycle; subclasses implement `command` (and may extend `environment`)."""

    kind: EngineKind

    def __init__(
        self,
        config: EngineConfig,
        *,
        log_dir: Path,
        port_file: Path | None = None,
        sleep: Callable[[float], None] = time.sleep,
        check_cancel: Callable[[], None] | None = None,
        on_spawn: Callable[[int], None] | None = None,
    ) -> None:
        if config.kind is not self.kind:
            raise ValueError(
                f"config.kind={config.kind.value!r} given to the {self.kind.value} engine"
            )
        self.config = config
        self.log_dir = Path(log_dir)
        self.port_file = Path(port_file) if port_file is not None else None
        self._sleep = sleep
        # Raises once the caller is stopping: a start waiting ready_timeout_s for a
        # server still loading its weights gives up at the next probe instead.
        self._check_cancel = check_cancel or (lambda: None)
        # Told each server's pid the moment it is spawned, before it is ready: the
        # caller's failure handling can then kill a server still loading, which
        # also ends a readiness probe that the loading server is slow to answer.
        self._on_spawn = on_spawn or (lambda pid: None)
        self._state = EngineState.STOPPED
        self._proc: proc_mod.ManagedProcess | None = None
        self._port: int | None = None
        self._api_key: str | None = None
        self._log_offset = 0
        self.model_dir: Path | None = None
        self.startup_s: float | None = None  # last start's duration, for reports

    # subclass hooks
    def command(self, model_dir: Path, port: int) -> list[str]:
        raise NotImplementedError

    def _launch(self, model_dir: Path) -> tuple[proc_mod.ManagedProcess, int, str]:
        """Spawn the server for `model_dir`: (process, port, api key)."""
        port = self.config.port or proc_mod.free_port(self.config.connect_host)
        api_key = self.config.api_key or secrets.token_urlsafe(24)
        proc = proc_mod.ManagedProcess(
            self.command(model_dir, port), log_path=self.log_path, env=self.environment(api_key)
        )
        return proc, port, api_key

    def environment(self, api_key: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
        env.update(self.config.update.server_env)  # reload: the sleep and reload routes
        if self.config.cuda_visible_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.config.cuda_visible_devices
        env.update(dict(self.config.env))
        return env

    # properties
    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def base_url(self) -> str:
        if self._port is None:
            raise EngineStateError(f"engine is {self._state.value}: start it to get a URL")
        return f"http://{self.config.connect_host}:{self._port}"

    @property
    def api_key(self) -> str:
        if self._api_key is None:
            raise EngineStateError(f"engine is {self._state.value}: start it to get its API key")
        return self._api_key

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.kind.value}_server.log"

    def pids(self) -> tuple[int, ...]:
        return self._proc.pids() if self._proc is not None else ()

    def _set_state(self, state: EngineState) -> None:
        log.info(
            "%s engine: %s -> %s (pid %s)",
            self.kind.value,
            self._state.value,
            state.value,
            self.pid,
        )
        self._state = state

    # lifecycle
    def start(self, model_dir: Path) -> None:
        if self._state not in (EngineState.STOPPED, EngineState.FAILED):
            raise EngineStateError(f"start() while {self._state.value}: stop() the engine first")
        if self._proc is not None:  # FAILED with leftovers: clear them before reuse
            self.stop()
        model_dir = Path(model_dir).resolve()
        if not (model_dir / "config.json").is_file():
            raise EngineStartError(
                f"model directory {model_dir} has no config.json: give a Hugging Face model directory"
            )
        t0 = time.monotonic()
        self.model_dir = model_dir
        self.log_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
        self._proc, self._port, self._api_key = self._launch(model_dir)
        self._on_spawn(self._proc.pid)
        self._log_offset = self._proc.log_offset
        self._set_state(EngineState.STARTING)
        self._publish_port_file()
        try:
            self._wait_ready()
        except BaseException:
            self._fail_start()
            raise
        self.startup_s = time.monotonic() - t0
        log.info(
            "%s engine ready on %s in %.1fs (model %s)",
            self.kind.value,
            self.base_url,
            self.startup_s,
            model_dir,
        )
        self._set_state(EngineState.READY)

    def _publish_port_file(self) -> None:
        if self.port_file is None or self._proc is None:
            return
        record = {
            "version": PORT_FILE_VERSION,
            "kind": self.kind.value,
            "host": self.config.connect_host,
            "port": self._port,
            "pid": self._proc.pid,
            "model_dir": str(self.model_dir),
        }
        publish_bytes(self.port_file, (json.dumps(record, sort_keys=True) + "\n").encode())

    def _wait_ready(self) -> None:
        # client.py imports this module (its errors are EngineErrors).
        from rollout.client import CompletionClient, HttpError, TransientError

        cfg = self.config
        client = CompletionClient(
            self.base_url,
            self.api_key,
            model=cfg.served_model_name,
            concurrency=1,
            request_timeout_s=cfg.request_timeout_s,
            retries=0,
        )

        server_errors = [0]  # in a row, from a server whose /health says it is up
        last = ["none answered yet"]  # the last probe's error, for the progress lines
        done = threading.Event()

        def probe() -> None:
            self._check_cancel()  # not retried: start() stops the server and raises it
            self.check_alive()  # EngineDied is not retried: the log says why
            try:
                # /health first, with a short timeout: a port that accepts but
                # never answers (a stranger on our port) must not stall the
                # liveness check for a whole request timeout.
                client.health(timeout_s=min(5.0, cfg.request_timeout_s))
                client.complete_one(_READY_PROMPT, n=1, max_tokens=1, temperature=1.0, seed=0)
            except TransientError as e:
                # A server still loading refuses connections or answers 503; one
                # that is up and answers 500 to a one-token completion is broken,
                # and waiting ready_timeout_s for it would only hide that.
                broken = e.status is not None and e.status >= 500 and e.status != 503
                server_errors[0] = server_errors[0] + 1 if broken else 0
                if server_errors[0] >= READY_SERVER_ERRORS:
                    raise EngineStartError(
                        f"{self.kind.value} server at {self.base_url} is up (/health answers) "
                        f"but answered the readiness completion with HTTP {e.status} "
                        f"{server_errors[0]} times in a row: {e}",
                        log_path=self.log_path, log_tail=self._tail()) from e
                last[0] = str(e)
                raise _NotReady(str(e)) from e
            except HttpError as e:
                raise EngineStartError(
                    f"{self.kind.value} server at {self.base_url} refused the readiness "
                    f"completion: {e}",
                    log_path=self.log_path,
                    log_tail=self._tail(),
                ) from e

        # A start takes minutes on a large model, and one probe may wait a whole request
        # timeout: a thread says every READY_PROGRESS_S that it still waits, and on what.
        def progress() -> None:
            started = time.monotonic()
            while not done.wait(READY_PROGRESS_S):
                pid = self._proc.pid if self._proc is not None else None
                log.info("%s server (pid %s) not serving yet after %.0f s of ready_timeout_s=%g "
                         "(last probe: %s); its log: %s", self.kind.value, pid,
                         time.monotonic() - started, cfg.ready_timeout_s, last[0], self.log_path)

        threading.Thread(target=progress, name="engine-start-progress", daemon=True).start()
        try:
            tenacity.Retrying(
                stop=tenacity.stop_after_delay(cfg.ready_timeout_s),
                wait=tenacity.wait_fixed(cfg.ready_poll_s),
                retry=tenacity.retry_if_exception_type(_NotReady),
                sleep=self._sleep,
                reraise=True,
            )(probe)
        except _NotReady as e:
            raise EngineStartError(
                f"{self.kind.value} server did not answer a completion within "
                f"ready_timeout_s={cfg.ready_timeout_s:g}s (last error: {e}); raise the "
                "timeout for large models, or read the log for a hang",
                log_path=self.log_path,
                log_tail=self._tail(),
            ) from None
        finally:
            done.set()

    def _fail_start(self) -> None:
        # Leave nothing running behind a failed start; keep the error of start().
        try:
            self.stop()
        except EngineError as e:
            log.error("cleanup after failed start: %s", e)
        self._set_state(EngineState.FAILED)

    def _tail(self) -> str:
        return proc_mod.log_tail(self.log_path, self.config.log_tail_lines, start=self._log_offset)

    def stop(self) -> None:
        """Stop the tree and wait for GPU release; raise EngineError if either fails."""
        if self._proc is None:
            self._set_state(EngineState.STOPPED)
            return
        self._set_state(EngineState.STOPPING)
        proc, self._proc = self._proc, None
        report = proc.stop(
            grace_s=self.config.stop_grace_s, kill_timeout_s=self.config.kill_timeout_s
        )
        if self.port_file is not None:  # beneath the run directory (or its bucket's object)
            remove(self.port_file)
        if report.survivors:
            self._set_state(EngineState.FAILED)
            raise EngineError(
                f"{self.kind.value} server pids {list(report.survivors)} survived SIGKILL for "
                f"{self.config.kill_timeout_s:g}s (stuck in the kernel, e.g. on a GPU driver "
                "call): inspect them with ps, the node may need a reset"
            )
        holders = proc_mod.wait_gpu_released(report.tree_pids,
                                             self.config.gpu_release_timeout_s)
        if holders:
            self._set_state(EngineState.FAILED)
            raise GpuNotReleased(holders, self.config.gpu_release_timeout_s)
        self._port = None if self.config.port == 0 else self._port
        self._set_state(EngineState.STOPPED)

    def close(self) -> None:
        """stop(), and release anything kept for the next start (nothing here)."""
        self.stop()

    # sleep mode: the server stays up, its weights go and come back
    def control(self) -> EngineControl:
        from rollout.client import CompletionClient

        client = CompletionClient(self.base_url, self.api_key,
                                  model=self.config.served_model_name, concurrency=1,
                                  request_timeout_s=self.config.request_timeout_s, retries=0)
        return EngineControl(client, reload_timeout_s=self.config.request_timeout_s,
                             pause=self._sleep)

    def _require(self, state: EngineState, what: str) -> None:
        if self._state is not state:
            raise EngineStateError(f"{what} while {self._state.value}: the engine must be "
                                   f"{state.value}")
        if not self.config.update.keeps_process:
            raise EngineStateError(f"{what} with weight_update='restart': the server was "
                                   "started without sleep mode")

    def _controlled(self, step: Callable[[], None]) -> None:
        """Run a control step; on failure the engine is FAILED (a died server says so)."""
        try:
            step()
        except WeightUpdateError:
            self._set_state(EngineState.FAILED)
            self.check_alive()  # EngineDied with the log tail beats "connection refused"
            raise

    def sleep(self, level: int | None = None) -> None:
        """Release the weights and KV cache; the process stays (READY -> SLEEPING)."""
        self._require(EngineState.READY, "sleep()")
        level = level or self.config.sleep_level
        self._controlled(lambda: self.control().sleep(level))
        holders = proc_mod.wait_gpu_released(self.pids(), self.config.gpu_release_timeout_s,
                                             allowed_mib=self.config.sleep_gpu_residual_mib)
        if holders:
            self._set_state(EngineState.FAILED)
            raise GpuNotReleased(holders, self.config.gpu_release_timeout_s,
                                 allowed_mib=self.config.sleep_gpu_residual_mib)
        self._set_state(EngineState.SLEEPING)

    def wake_up(self) -> None:
        """Everything back as it was (level 1 restores the old weights): SLEEPING -> READY."""
        self._require(EngineState.SLEEPING, "wake_up()")
        self._controlled(lambda: self.control().wake_up())
        self._set_state(EngineState.READY)

    def load_weights(self, model_dir: Path) -> None:
        """Wake on a new checkpoint in place (SLEEPING -> READY); WeightUpdateError names the step."""
        self._require(EngineState.SLEEPING, "load_weights()")
        self._in_place(model_dir, lambda c, path: c.load_weights(path), "reloaded in place")
        self._set_state(EngineState.READY)

    def update_weights(self, model_dir: Path) -> None:
        """A new checkpoint into the serving engine, between requests (READY -> READY):
        paused (requests in flight finish, new ones wait), reloaded in place, the
        prefix cache reset, resumed; WeightUpdateError names the step."""
        self._require(EngineState.READY, "update_weights()")
        self._in_place(model_dir, lambda c, path: c.update_weights(path),
                       "updated in place (paused, reloaded, resumed)")

    def _in_place(self, model_dir: Path, sequence: Callable[[EngineControl, str], None],
                  how: str) -> None:
        """One control sequence that puts `model_dir` into the running server."""
        model_dir = Path(model_dir).resolve()
        t0 = time.monotonic()
        self._controlled(lambda: sequence(self.control(), str(model_dir)))
        self.model_dir = model_dir
        self._publish_port_file()
        log.info("%s engine pid %s serves %s, %s in %.2fs", self.kind.value, self.pid,
                 model_dir, how, time.monotonic() - t0)

    def check_alive(self) -> None:
        """Raise EngineDied (exit status, log tail) if the server process has exited."""
        if self._proc is None:
            raise EngineStateError(f"engine is {self._state.value}: there is no server process")
        rc = self._proc.returncode
        if rc is not None:
            if self._state is not EngineState.STOPPING:
                self._set_state(EngineState.FAILED)
            raise EngineDied(
                kind=self.kind.value,
                pid=self._proc.pid,
                returncode=rc,
                log_path=self.log_path,
                log_tail=self._tail(),
                log_text=proc_mod.log_tail(self.log_path, CAUSE_SEARCH_LINES,
                                           start=self._log_offset),
            )
