"""What an inference engine is: its kind, its states, its configuration, its errors.

Shared by every engine (server.py and its hf/vllm subclasses) and by
the clients that talk to them (client.py raises EngineErrors).  Nothing here
starts a process; import the public names from rollout.engines.engine.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from rollout.engines import process as proc_mod
from rollout.errors import RolloutError

DTYPES: Final = ("auto", "half", "float16", "bfloat16", "float", "float32")


# --- errors ----------------------------------------------------------------


class EngineError(RolloutError, RuntimeError):
    """Root of the inference-engine errors (under the package's RolloutError)."""


class EngineStateError(EngineError):
    """An operation was asked in a state that does not allow it."""


class EngineStartError(EngineError):
    """The server did not become ready; carries its log tail."""

    def __init__(self, message: str, *, log_path: Path | None = None, log_tail: str = "") -> None:
        self.log_path = log_path
        self.log_tail = log_tail
        super().__init__(
            f"{message}\n--- last lines of {log_path} ---\n{log_tail}" if log_path else message
        )


class EngineDied(EngineError):
    """The server process exited while it should have been running."""

    def __init__(
        self, *, kind: str, pid: int, returncode: int, log_path: Path, log_tail: str,
        log_text: str | None = None,
    ) -> None:
        """`log_text`: more of the log than `log_tail`, searched for the stated cause
        (vLLM states it before a page of shutdown traceback)."""
        self.kind = kind
        self.pid = pid
        self.returncode = returncode
        self.log_path = log_path
        self.log_tail = log_tail
        self.cause = stated_cause(log_text if log_text is not None else log_tail)
        why = (f"it says: {self.cause}; fix that and start the engine again" if self.cause
               else f"its log {log_path} ends with the cause (out of memory, bad model "
               "directory, port in use); fix it and start the engine again")
        super().__init__(
            f"{kind} inference server pid {pid} died: {proc_mod.describe_exit(returncode)}; "
            f"{why}\n--- last lines of {log_path} ---\n{log_tail}"
        )


# A line where a server states why it stops: argparse's "prog: error: ...", a
# Python exception's last line, pydantic's "Value error, ...", vLLM's report of
# a worker process that died.
_STATED: Final = re.compile(r"^(?:[\w.]*(?:Error|Exception)(?:: | \[)|Value error, )|"
                            r"^[\w./-]+: error: |died unexpectedly \(exit code: -?\d+\)")
# Lines that wrap or follow a cause stated earlier: never the cause itself.
_WRAPPERS: Final = re.compile(r"root cause|initialization failed|See stack trace|"
                              r"\d+ validation errors? for|RuntimeError: cancelled")
# vLLM's prefixes: "(APIServer pid=7) ", "ERROR 11-25 10:58:55 [file.py:944] ".
_PREFIX: Final = re.compile(r"^(?:\(\w+ pid=\d+\)\s*)?(?:(?P<level>[A-Z]+) \d\d-\d\d "
                            r"[\d:]+ \[[^\]]*\]\s*)?")
_SIGNAL: Final = re.compile(r"exit code: -(\d+)")


def stated_cause(log_text: str) -> str | None:
    """The first line of a server's log that states why it failed, in its own words
    (vLLM's argparse error, the exception it raised, a worker killed by a signal),
    or None.  The first, because what follows it is shutdown: tracebacks of the
    processes it took down and lines that point back at it.  Lines vLLM logs at
    INFO, WARNING or DEBUG are never the cause."""
    for raw in log_text.splitlines():
        prefix = _PREFIX.match(raw)
        if prefix is not None and prefix.group("level") in ("INFO", "WARNING", "DEBUG"):
            continue
        line = raw[prefix.end() if prefix else 0:].strip()
        if _STATED.search(line) and not _WRAPPERS.search(line):
            signal_number = _SIGNAL.search(line)
            if signal_number is not None:
                line += f" ({proc_mod.describe_exit(-int(signal_number.group(1)))})"
            return line[:500]
    return None


class GpuNotReleased(EngineError, TimeoutError):
    """Processes still hold accelerator memory after the release deadline."""

    def __init__(self, holders: Mapping[int, int], timeout_s: float, *,
                 allowed_mib: int = 0) -> None:
        self.holders = dict(holders)
        self.timeout_s = timeout_s
        listing = ", ".join(f"pid {p} ({mib} MiB)" for p, mib in sorted(holders.items()))
        if allowed_mib:
            message = (f"GPU memory still held after {timeout_s:g}s of sleep by {listing}, "
                       f"above sleep_gpu_residual_mib={allowed_mib}: the sleeping inference "
                       "server kept its weights or KV cache (was it started with "
                       "--enable-sleep-mode?); set engine.weight_update='restart', or raise "
                       "sleep_gpu_residual_mib if training fits beside that residue")
        else:
            message = (f"GPU memory still held after {timeout_s:g}s by {listing}: processes "
                       "of the stopped inference server did not release it; kill them "
                       "(kill -9 PID) before training, or raise gpu_release_timeout_s if the "
                       "driver is slow to free memory")
        super().__init__(message)


# --- configuration ---------------------------------------------------------


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class EngineKind(str, enum.Enum):
    HF = "hf"
    VLLM = "vllm"


class WeightUpdate(str, enum.Enum):
    RELOAD = "reload"
    RESTART = "restart"


class EngineState(str, enum.Enum):
    """STOPPED → STARTING → READY ⇄ SLEEPING; → STOPPING → STOPPED; FAILED from any live state."""

    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    SLEEPING = "sleeping"  # alive, weights (and KV cache) released: see server.py
    STOPPING = "stopping"
    FAILED = "failed"


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """One inference engine.  Fields marked (hf)/(vllm) apply to that kind only."""

    kind: EngineKind = EngineKind.HF
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port is picked at each start
    api_key: str | None = None  # None: a fresh random key at each start
    served_model_name: str = "policy"  # stable name, so clients never see model paths
    seed: int = 0
    max_model_len: int | None = None
    dtype: str = "auto"
    extra_args: tuple[str, ...] = ()  # appended verbatim to the server command
    env: tuple[tuple[str, str], ...] = ()  # extra environment for the server
    cuda_visible_devices: str | None = None  # None: inherit the daemon's
    tensor_parallel_size: int = 1  # (vllm) GPUs per engine replica
    # (vllm) engine replicas behind one server, each on tensor_parallel_size
    # GPUs: with 8 GPUs and tp 1, dp 8 rolls out on every GPU of the node.
    data_parallel_size: int = 1
    # How phase 12 serves new weights: "reload" wakes the sleeping engine and
    # loads the checkpoint in place; "restart" stops and cold-starts it.
    weight_update: WeightUpdate = WeightUpdate.RELOAD
    # Sleep level at phase 7: 1 keeps the weights in CPU memory, 2 drops them
    # (the reload at phase 12 brings the new ones anyway).
    sleep_level: int = 2
    # A sleeping vLLM keeps its CUDA context (and, at level 1, nothing else on
    # the GPU): more than this per process after /sleep fails the phase.
    sleep_gpu_residual_mib: int = 4096
    # Phase 12 compares the served log-probabilities of the checkpoint's probe
    # sequences with the trainer's; None: a tolerance for the served dtype.
    verify_weights: bool = True
    probe_tolerance: float | None = None
    gpu_memory_utilization: float = 0.9  # (vllm)
    use_model_generation_config: bool = False  # (vllm) see vllm.py
    vllm_executable: str = "vllm"  # (vllm)
    device: str = "cpu"  # (hf)
    max_batch: int = 64  # (hf) rows (prompts x n) per forward pass
    threads: int = 0  # (hf) torch threads; 0 = torch's default
    python_executable: str | None = None  # (hf) None: the daemon's interpreter
    prewarm: bool = False  # (hf) keep a spare server with imports done: see hf.py
    ready_timeout_s: float = 1200.0  # a cold vLLM start compiles and captures graphs
    ready_poll_s: float = 0.5
    stop_grace_s: float = 10.0
    kill_timeout_s: float = 10.0
    gpu_release_timeout_s: float = 60.0
    request_timeout_s: float = 600.0  # one request: n samples of up to max_tokens
    log_tail_lines: int = 40

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", EngineKind(self.kind))
        except ValueError:
            raise ValueError(
                f"kind={self.kind!r} is not an engine: use one of {[k.value for k in EngineKind]}"
            ) from None
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port} is outside 0..65535: use 0 to pick a free port")
        if self.api_key is not None and (
            not self.api_key or any(c.isspace() for c in self.api_key)
        ):
            raise ValueError("api_key is empty or contains whitespace: use None for a random key")
        if not self.served_model_name or any(c.isspace() for c in self.served_model_name):
            raise ValueError(f"served_model_name={self.served_model_name!r} is not a usable name")
        if self.dtype not in DTYPES:
            raise ValueError(
                f"dtype={self.dtype!r} is not one of {DTYPES} (vLLM's --dtype choices)"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(
                f"max_model_len={self.max_model_len} is below 1: use None for the model's own"
            )
        if self.tensor_parallel_size < 1 or self.data_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size={self.tensor_parallel_size} and data_parallel_size="
                f"{self.data_parallel_size} must be >= 1: GPUs per replica, replicas per node"
            )
        if self.sleep_gpu_residual_mib < 0 or (
                self.probe_tolerance is not None and not self.probe_tolerance > 0):
            raise ValueError(f"sleep_gpu_residual_mib={self.sleep_gpu_residual_mib} must be >= 0 "
                             f"and probe_tolerance={self.probe_tolerance} > 0 (or None: by dtype)")
        if self.sleep_level not in (1, 2):
            raise ValueError(f"sleep_level={self.sleep_level} is not 1 (keep the weights in "
                             "CPU memory) or 2 (drop them)")
        try:
            object.__setattr__(self, "weight_update", WeightUpdate(self.weight_update))
        except ValueError:
            raise ValueError(f"weight_update={self.weight_update!r} is not 'reload' or "
                             "'restart'") from None
        if self.weight_update is WeightUpdate.RELOAD and not _is_loopback(self.host):
            raise ValueError(
                f"weight_update='reload' with host={self.host!r}: the reload needs vLLM's "
                "development endpoints (/sleep, /collective_rpc), which vLLM does not guard "
                "with the API key; bind host='127.0.0.1' (the daemon is on the same node) or "
                "set weight_update='restart'")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization={self.gpu_memory_utilization} is outside (0, 1]: "
                "it is a fraction of the GPU, e.g. 0.9"
            )
        if self.cuda_visible_devices is not None:
            ids = self.cuda_visible_devices.split(",")
            if not all(ids) or any(c.isspace() for c in self.cuda_visible_devices):
                raise ValueError(
                    f"cuda_visible_devices={self.cuda_visible_devices!r} is not a comma-separated "
                    "list of GPU indices or UUIDs, e.g. '0,1'"
                )
            if self.kind is EngineKind.VLLM and len(ids) < self.gpus:
                raise ValueError(
                    f"tensor_parallel_size={self.tensor_parallel_size} x data_parallel_size="
                    f"{self.data_parallel_size} needs {self.gpus} GPUs but "
                    f"cuda_visible_devices={self.cuda_visible_devices!r} shows {len(ids)}"
                )
        object.__setattr__(self, "extra_args", tuple(self.extra_args))
        object.__setattr__(self, "env", tuple((str(k), str(v)) for k, v in self.env))
        self._check_local()

    def _check_local(self) -> None:
        """The hf engine's device and sizes, the timeouts, the log tail."""
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device={self.device!r} is not cpu, cuda or cuda:N")
        if self.log_tail_lines < 1:
            raise ValueError(f"log_tail_lines={self.log_tail_lines} is below 1: show at least one")
        if self.max_batch < 1 or self.threads < 0:
            raise ValueError(
                f"max_batch={self.max_batch} must be >= 1 and threads={self.threads} >= 0"
            )
        for name in (
            "ready_timeout_s",
            "ready_poll_s",
            "stop_grace_s",
            "kill_timeout_s",
            "gpu_release_timeout_s",
            "request_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0 seconds")
        if self.ready_poll_s >= self.ready_timeout_s:
            raise ValueError(
                f"ready_poll_s={self.ready_poll_s} must be below ready_timeout_s={self.ready_timeout_s}"
            )

    @property
    def reloads_in_place(self) -> bool:
        """The one reading of weight_update: True keeps the engine's process between
        iterations (asleep during training, new weights loaded in place) and starts
        its server with the sleep and reload endpoints; False stops and restarts it."""
        return self.weight_update is WeightUpdate.RELOAD

    @property
    def gpus(self) -> int:
        """GPUs the engine occupies: every replica's tensor-parallel group."""
        return self.tensor_parallel_size * self.data_parallel_size

    def served_dtype(self, checkpoint_dtype: str | None) -> str:
        """The dtype the engine computes in, for a checkpoint saved in `checkpoint_dtype`.

        The hf server maps "auto" to float32 (rollout/hf/request.py DTYPES).  vLLM's "auto"
        keeps a bfloat16 checkpoint's dtype and casts float32 ones to half
        precision: counted as bfloat16, the coarser of the two.
        """
        names = {"half": "float16", "float": "float32"}
        if self.dtype != "auto":
            return names.get(self.dtype, self.dtype)
        if self.kind is EngineKind.HF:
            return "float32"
        return checkpoint_dtype if checkpoint_dtype in ("bfloat16", "float16") else "bfloat16"

    @property
    def connect_host(self) -> str:
        # A wildcard bind address is not an address to connect to.
        return "127.0.0.1" if self.host in ("0.0.0.0", "", "::") else self.host
