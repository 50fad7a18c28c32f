"""The CPU engine: rollout.hf.server run as a child process.

With weight_update = "restart" it is restarted every RL iteration with the
newest weights, so its startup matters (with "reload", the default, it sleeps
and reloads in place like vLLM: see rollout/hf/control.py).  A cold start is
dominated by importing torch and transformers (about 3-6 s on a 2-core
node), loading a small model takes well under a second.  With `prewarm=True`
the engine therefore keeps a *spare*: right after stop() it spawns the next
server with `--model -`, which binds its port, does the imports and waits
for one line on stdin.  The next start() sends the model directory on that
line, so a restart only pays for loading the weights.  The spare holds no accelerator memory (nothing touches CUDA
before the model loads) and exits on its own when its stdin closes, e.g.
when the daemon dies; close() ends it explicitly.

    stop() ──► server tree gone, GPU released ──► spawn spare (imports...)
    start(dir) ──► spare alive? send dir : spawn cold ──► wait for a completion
"""

from __future__ import annotations

import logging
import secrets
import sys
from pathlib import Path

from rollout.engines import process as proc_mod
from rollout.engines.config import EngineKind
from rollout.engines.server import ServerEngine
from rollout.hf.server import API_KEY_ENV

log = logging.getLogger(__name__)

# The directory that holds the `rollout` package, so the child can import it
# even when the project is not installed into the interpreter.
_PROJECT_ROOT = str(Path(__file__).resolve().parent.parent)


class HfEngine(ServerEngine):
    kind = EngineKind.HF

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self._spare: tuple[proc_mod.ManagedProcess, int, str] | None = None

    def command(self, model_dir: Path | str, port: int) -> list[str]:
        c = self.config
        argv = [
            c.python_executable or sys.executable,
            "-m",
            "rollout.hf.server",
            "--model",
            str(model_dir),
            "--host",
            c.host,
            "--port",
            str(port),
            "--served-model-name",
            c.served_model_name,
            "--device",
            c.device,
            "--dtype",
            c.dtype,
            "--max-batch",
            str(c.max_batch),
            "--seed",
            str(c.seed),
            "--threads",
            str(c.threads),
        ]
        if c.max_model_len is not None:
            argv += ["--max-model-len", str(c.max_model_len)]
        argv += c.update.sleep_mode_flags  # the hf server always has sleep mode
        return argv + list(c.extra_args)

    def environment(self, api_key: str) -> dict[str, str]:
        env = super().environment(api_key)
        # The key travels in the environment, not argv, so `ps` does not show it.
        env[API_KEY_ENV] = api_key
        env["PYTHONPATH"] = proc_mod.python_path(_PROJECT_ROOT, env.get("PYTHONPATH"))
        return env

    @property
    def spare_pid(self) -> int | None:
        return self._spare[0].pid if self._spare is not None else None

    def _launch(self, model_dir: Path) -> tuple[proc_mod.ManagedProcess, int, str]:
        spare, self._spare = self._spare, None
        if spare is not None:
            proc = spare[0]
            if proc.is_running():
                proc.send_line(str(model_dir))
                log.info("hf engine: spare pid %d takes %s", proc.pid, model_dir)
                return spare
            log.warning(
                "hf engine: spare pid %d had exited (%s), starting cold",
                proc.pid,
                proc_mod.describe_exit(proc.returncode),
            )
            proc.stop(grace_s=self.config.stop_grace_s)
        return super()._launch(model_dir)

    def _spawn_spare(self) -> None:
        port = self.config.port or proc_mod.free_port(self.config.connect_host)
        api_key = self.config.api_key or secrets.token_urlsafe(24)
        proc = proc_mod.ManagedProcess(
            self.command("-", port),
            log_path=self.log_path,
            env=self.environment(api_key),
            stdin_pipe=True,
        )
        self._spare = (proc, port, api_key)
        log.info("hf engine: spare pid %d warming up on port %d", proc.pid, port)

    def stop(self) -> None:
        had_server = self._proc is not None
        super().stop()
        # Only after a real stop: the server's port (fixed or not) is free again.
        if self.config.prewarm and had_server and self._spare is None:
            self._spawn_spare()

    def close(self) -> None:
        try:
            super().stop()
        finally:
            spare, self._spare = self._spare, None
            if spare is not None:
                spare[0].stop(
                    grace_s=self.config.stop_grace_s, kill_timeout_s=self.config.kill_timeout_s
                )
