"""The GPU engine: `vllm serve` run as a child process.

Nothing here imports vllm: the daemon only builds a command line, so a CPU
node without vllm installed can still load this module and test it.

Every flag was checked against vLLM's documented CLI:
  - `vllm serve` reference: https://docs.vllm.ai/en/v0.12.0/cli/serve/ (positional
    model_tag; frontend --host, --port, --api-key, --served-model-name)
  - engine arguments: https://docs.vllm.ai/en/v0.8.5/serving/engine_args.html
    (--tensor-parallel-size, --gpu-memory-utilization, --max-model-len,
    --dtype {auto,half,float16,bfloat16,float,float32}, --seed,
    --generation-config)
  - --generation-config "vllm" (ignore the model's generation_config.json,
    use vLLM's defaults): vllm-project/vllm PR #11164, vLLM >= 0.6.6.
  - `return_token_ids` (read by rollout.client): vllm-project/vllm PR #22587,
    released in vLLM 0.10.2, so this engine needs vllm >= 0.10.2.
  - VLLM_API_KEY: vLLM's api_server uses `args.api_key or envs.VLLM_API_KEY`,
    so the key is passed in the environment instead of --api-key and does not
    show in `ps` (vLLM's security guide recommends the same).
"""

from __future__ import annotations

from pathlib import Path

from rollout.engine_config import EngineConfig, EngineKind
from rollout.server_engine import ServerEngine

API_KEY_ENV = "VLLM_API_KEY"


def build_vllm_command(cfg: EngineConfig, model_dir: Path, port: int) -> list[str]:
    """The `vllm serve` argv for `cfg` (pure: no environment, no I/O)."""
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
    return argv + list(cfg.extra_args)


class VllmEngine(ServerEngine):
    kind = EngineKind.VLLM

    def command(self, model_dir: Path, port: int) -> list[str]:
        return build_vllm_command(self.config, model_dir, port)

    def environment(self, api_key: str) -> dict[str, str]:
        env = super().environment(api_key)  # includes CUDA_VISIBLE_DEVICES passthrough
        env[API_KEY_ENV] = api_key
        return env
