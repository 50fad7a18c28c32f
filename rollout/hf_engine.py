"""The CPU engine: rollout.hf_server run as a child process.

Restarted every RL iteration with the newest weights, so its startup time
matters: it is the interpreter plus the torch/transformers imports plus
loading a small safetensors file (a few seconds on a CPU node).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from rollout.engine import EngineKind, ServerEngine
from rollout.hf_server import API_KEY_ENV

# The directory that holds the `rollout` package, so the child can import it
# even when the project is not installed into the interpreter.
_PROJECT_ROOT = str(Path(__file__).resolve().parent.parent)


def build_hf_command(cfg_python: str | None, model_dir: Path, port: int, *, host: str,
                     served_model_name: str, device: str, dtype: str, max_batch: int,
                     seed: int, threads: int, max_model_len: int | None,
                     extra_args: tuple[str, ...]) -> list[str]:
    argv = [
        cfg_python or sys.executable, "-m", "rollout.hf_server",
        "--model", str(model_dir),
        "--host", host,
        "--port", str(port),
        "--served-model-name", served_model_name,
        "--device", device,
        "--dtype", dtype,
        "--max-batch", str(max_batch),
        "--seed", str(seed),
        "--threads", str(threads),
    ]
    if max_model_len is not None:
        argv += ["--max-model-len", str(max_model_len)]
    return argv + list(extra_args)


class HfEngine(ServerEngine):
    kind = EngineKind.HF

    def command(self, model_dir: Path, port: int) -> list[str]:
        c = self.config
        return build_hf_command(
            c.python_executable, model_dir, port, host=c.host,
            served_model_name=c.served_model_name, device=c.device, dtype=c.dtype,
            max_batch=c.max_batch, seed=c.seed, threads=c.threads,
            max_model_len=c.max_model_len, extra_args=c.extra_args,
        )

    def environment(self, api_key: str) -> dict[str, str]:
        env = super().environment(api_key)
        # The key travels in the environment, not argv, so `ps` does not show it.
        env[API_KEY_ENV] = api_key
        path = env.get("PYTHONPATH")
        env["PYTHONPATH"] = _PROJECT_ROOT + (os.pathsep + path if path else "")
        return env
