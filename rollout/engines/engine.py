"""Inference engines: an OpenAI-compatible server run as a child process.

The public face of the engines; import from here.  The parts live in:

    config.py         EngineKind, EngineState, EngineConfig and the errors
    server.py         ServerEngine: start/stop/sleep/load_weights of the
                      server process (the lifecycle diagram is there)
    control.py        the HTTP calls of sleep mode, reloads and probes
    hf.py             HfEngine: the CPU server of rollout/hf/
    vllm.py           VllmEngine: `vllm serve`
    vllm_platform.py  what the installed vLLM reports (sleep mode or not)
    process.py        the server's process group, log and exit
    serving.py        the verbs around training: park(), serve()

This module adds the `Engine` interface the coordinator programs against and
`make_engine`, which picks the implementation for a config.  The subclasses
are imported inside make_engine, so a daemon that runs one kind never loads
the other's module, and importing this one loads neither torch nor vllm.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol, runtime_checkable

from rollout.engines.config import (
    DTYPES,
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
from rollout.engines.server import PORT_FILE_VERSION, ServerEngine

__all__ = [
    "DTYPES",
    "PORT_FILE_VERSION",
    "Engine",
    "EngineConfig",
    "EngineDied",
    "EngineError",
    "EngineKind",
    "EngineStartError",
    "EngineState",
    "EngineStateError",
    "GpuNotReleased",
    "ServerEngine",
    "WeightUpdateError",
    "make_engine",
]


@runtime_checkable
class Engine(Protocol):
    config: EngineConfig

    @property
    def state(self) -> EngineState: ...
    @property
    def base_url(self) -> str: ...
    @property
    def api_key(self) -> str: ...
    @property
    def pid(self) -> int | None: ...
    def pids(self) -> tuple[int, ...]: ...
    def start(self, model_dir: Path) -> None: ...
    def stop(self) -> None: ...
    def close(self) -> None: ...
    def check_alive(self) -> None: ...
    def sleep(self, level: int | None = None) -> None: ...
    def wake_up(self) -> None: ...
    def load_weights(self, model_dir: Path) -> None: ...
    def update_weights(self, model_dir: Path) -> None: ...
    def control(self) -> EngineControl: ...


def make_engine(cfg: EngineConfig, *, log_dir: Path, port_file: Path | None = None,
                check_cancel: Callable[[], None] | None = None,
                on_spawn: Callable[[int], None] | None = None) -> Engine:
    """The engine of `cfg.kind` (imports neither torch nor vllm).  `check_cancel`
    raises once the caller is stopping: a start waiting for its server calls it
    between two probes.  `on_spawn` gets each server's pid as soon as it is
    spawned, before it is ready."""
    if cfg.kind is EngineKind.HF:
        from rollout.engines.hf import HfEngine

        return HfEngine(cfg, log_dir=log_dir, port_file=port_file, check_cancel=check_cancel,
                        on_spawn=on_spawn)
    from rollout.engines.vllm import VllmEngine

    return VllmEngine(cfg, log_dir=log_dir, port_file=port_file, check_cancel=check_cancel,
                      on_spawn=on_spawn)
