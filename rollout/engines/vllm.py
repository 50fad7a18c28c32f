"""The GPU engine: `vllm serve` run as a child process.

Nothing here imports vllm: the daemon only builds a command line, so a CPU
node without vllm installed can still load this module and test it.

The project pins vllm==0.29.0 (the `vllm` extra; its torch pin is ours).
Every flag was read in that release's argument parser, and
tests/rollout/test_vllm_flags.py checks the command flag by flag against a
fixture extracted from it (tests/support/vllm_flags/extract_vllm_flags.py):
  - frontend: --host, --port (entrypoints/launchers/cli_args.py FrontendArgs);
    the positional model directory (entrypoints/cli/serve.py)
  - engine (engine/arg_utils.py EngineArgs.add_cli_args): --served-model-name,
    --tensor-parallel-size, --data-parallel-size, --gpu-memory-utilization,
    --max-model-len, --dtype {auto,bfloat16,float,float16,float32,half},
    --seed, --generation-config, --enable-sleep-mode (a BooleanOptionalAction)
  - --generation-config "vllm": ignore the model's generation_config.json.
  - `return_token_ids` (read by rollout.client): vLLM >= 0.10.2.
  - VLLM_API_KEY: the server reads `args.api_key or envs.VLLM_API_KEY`, so
    the key travels in the environment and does not show in `ps`.
  - VLLM_SERVER_DEV_MODE=1 (server.py, with weight_update "reload")
    registers /sleep, /wake_up, /collective_rpc, /reset_prefix_cache; vLLM
    guards only /v1 routes with the key, so EngineConfig insists on a
    loopback host then.
  - --data-parallel-size D runs D replicas behind one port (tp GPUs each); the
    node must show tp x D GPUs, checked before the server starts.
  - --enable-sleep-mode only where vLLM has a sleep mode (CUDA, ROCm, XPU):
    its CPU build refuses the flag, so the daemon asks the installed vLLM
    (vllm_platform.py).  Without it, /sleep pauses the scheduler and keeps
    the weights (vLLM's CPU worker), and reload_weights still loads a
    checkpoint in place: weight_update "reload" works on both.
  - vLLM's processes rendezvous through a file in tempfile.gettempdir()
    (utils/network_utils.py: vllm_dist_<uuid>) that a stopped server leaves
    behind: each start gets a private TMPDIR, removed when it stops.  vLLM
    also binds its ZMQ sockets there (VLLM_RPC_BASE_PATH defaults to it), and a
    Unix socket's path holds at most 107 bytes: under a deep TMPDIR (the
    daemon's is inside the run's node-local directory) the private one goes
    to /tmp instead (private_tmp).
"""

from __future__ import annotations

import getpass
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Final

from rollout.engines import process as proc_mod
from rollout.engines import vllm_platform
from rollout.engines.config import EngineConfig, EngineKind, EngineStartError
from rollout.engines.server import ServerEngine

API_KEY_ENV = "VLLM_API_KEY"


def build_vllm_command(cfg: EngineConfig, model_dir: Path, port: int, *,
                       sleep_mode: bool) -> list[str]:
    """The `vllm serve` argv for `cfg` (pure: no environment, no I/O); `sleep_mode`:
    whether the installed vLLM has one (vllm_platform.probe)."""
    argv = [
        cfg.vllm_executable,
        "serve",
        str(model_dir),
        "--host",
        cfg.host,
        "--port",
        str(port),
        "--served-model-name",
        cfg.served_model_name,
        "--tensor-parallel-size",
        str(cfg.tensor_parallel_size),
        "--data-parallel-size",
        str(cfg.data_parallel_size),
        "--gpu-memory-utilization",
        str(cfg.gpu_memory_utilization),
        "--dtype",
        cfg.dtype,
        "--seed",
        str(cfg.seed),
    ]
    if cfg.max_model_len is not None:
        argv += ["--max-model-len", str(cfg.max_model_len)]
    if not cfg.use_model_generation_config:
        # A model's generation_config.json can set top_k, repetition_penalty
        # and the like as server-wide defaults; RL needs samples from the plain
        # policy at the temperature/top_p it asks for, so ignore it.
        argv += ["--generation-config", "vllm"]
    if sleep_mode:
        argv += cfg.update.sleep_mode_flags
    return argv + list(cfg.extra_args)


# sizeof(sockaddr_un.sun_path) less its terminating NUL, and what vLLM adds to its
# TMPDIR for a socket: "/" and a uuid4.
SOCKET_PATH_MAX: Final = 107
_SOCKET_NAME: Final = 1 + 36
_PREFIX: Final = "coordinator-vllm-"


def private_tmp(parent: str | None = None) -> Path:
    """A new private TMPDIR for one vLLM server, in `parent` (default: this process's
    temporary directory) where vLLM's socket paths fit in it, else in /tmp."""
    for where in (parent or tempfile.gettempdir(), "/tmp"):
        # mkdtemp's name: the prefix and 8 random characters.
        if len(os.fsencode(where)) + 1 + len(_PREFIX) + 8 + _SOCKET_NAME <= SOCKET_PATH_MAX:
            return Path(tempfile.mkdtemp(prefix=_PREFIX, dir=where))
    raise AssertionError("unreachable: /tmp is short enough")


class VllmEngine(ServerEngine):
    kind = EngineKind.VLLM

    _tmp: Path | None = None  # the running server's private TMPDIR

    def command(self, model_dir: Path, port: int) -> list[str]:
        return build_vllm_command(self.config, model_dir, port,
                                  sleep_mode=self.platform().sleep_mode)

    def platform(self) -> vllm_platform.VllmPlatform:
        """What the configured vLLM reports about its platform (asked once)."""
        return vllm_platform.probe(self.config.vllm_executable, env=super().environment(""))

    # {environment} -> GPUs the server would see (None: unknown); tests replace it.
    gpu_count: Callable[[dict[str, str]], int | None] = staticmethod(proc_mod.visible_gpu_count)

    def environment(self, api_key: str) -> dict[str, str]:
        env = super().environment(api_key)  # includes CUDA_VISIBLE_DEVICES passthrough
        env[API_KEY_ENV] = api_key
        if self._tmp is not None:
            # Compiled kernels stay where they were cached before: only the
            # rendezvous file moves into the private directory.
            env.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
                tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"))
            env["TMPDIR"] = str(self._tmp)
        return env

    def stop(self) -> None:
        try:
            super().stop()
        finally:
            if self._tmp is not None and self._proc is None:
                shutil.rmtree(self._tmp, ignore_errors=True)
                self._tmp = None

    def _launch(self, model_dir: Path) -> tuple[proc_mod.ManagedProcess, int, str]:
        cfg = self.config
        env = self.environment("")
        seen = self.gpu_count(env)
        if seen is not None and seen < cfg.gpus:
            where = (f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']!r}"
                     if "CUDA_VISIBLE_DEVICES" in env else "NVML")
            raise EngineStartError(
                f"tensor_parallel_size={cfg.tensor_parallel_size} x data_parallel_size="
                f"{cfg.data_parallel_size} needs {cfg.gpus} GPUs but this node shows {seen} "
                f"({where}): lower data_parallel_size to {max(1, seen // cfg.tensor_parallel_size)}"
                " or give the engine more GPUs")
        self._tmp = private_tmp()
        try:
            return super()._launch(model_dir)
        except BaseException:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
            raise
