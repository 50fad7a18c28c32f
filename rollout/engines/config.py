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
from typing import ClassVar, Final

from coordinator.config.settings import Section, SettingError, setting
from rollout.engines import process as proc_mod
from rollout.engines.weight_updates import WEIGHT_UPDATES, UpdateRule, WeightUpdate
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


class EngineState(str, enum.Enum):
    """STOPPED → STARTING → READY ⇄ SLEEPING; → STOPPING → STOPPED; FAILED from any live state."""

    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    SLEEPING = "sleeping"  # alive, weights (and KV cache) released: see server.py
    STOPPING = "stopping"
    FAILED = "failed"


@dataclass(frozen=True, kw_only=True)
class EngineConfig(Section):
    """One inference engine.  Settings marked (hf)/(vllm) apply to that kind only."""

    SECTION: ClassVar[str] = "engine"

    kind: EngineKind = setting(EngineKind.HF, "Inference engine: hf (built in, CPU or one "
                               "GPU) or vllm (installed separately).", flag="--engine")
    host: str = setting("127.0.0.1", "Address the server binds (loopback: the daemon is on "
                        "the same node).", node_local=True)
    port: int = setting(0, "Server port; 0 picks a free one at each start.", ge=0, le=65535,
                        node_local=True, fix="give a TCP port, or 0 to pick a free port")
    api_key: str | None = setting(None, "Key the server requires; none: a fresh random key "
                                  "at each start.", node_local=True)
    # A stable name, so clients never see model paths.
    served_model_name: str = setting("policy", "The model's name in requests to the server.")
    seed: int = setting(0, "The server's sampling seed.", ge=0)
    max_model_len: int | None = setting(
        None, "Most tokens of prompt and answer together; none: the model's own context.",
        unit="tokens", ge=1)
    dtype: str = setting("auto", "The server's compute dtype (vLLM's --dtype choices).",
                         choices=DTYPES)
    extra_args: tuple[str, ...] = setting(
        (), "Appended verbatim to the server command.", node_local=True)
    env: tuple[tuple[str, str], ...] = setting(
        (), "Extra environment of the server, as [name, value] pairs.", node_local=True)
    cuda_visible_devices: str | None = setting(
        None, "GPUs the server sees, e.g. '0,1'; none: the daemon's own.", node_local=True)
    tensor_parallel_size: int = setting(1, "(vllm) GPUs per engine replica.", ge=1)
    # With 8 GPUs and tp 1, dp 8 rolls out on every GPU of the node.
    data_parallel_size: int = setting(
        1, "(vllm) Engine replicas behind one server, each on tensor_parallel_size GPUs.", ge=1)
    weight_update: WeightUpdate = setting(
        WeightUpdate.RELOAD, "How phase 12 serves new weights: reload (wake the sleeping "
        "engine and load the checkpoint in place) or restart (stop and cold-start it).")
    # Level 2 is enough: the reload at phase 12 brings the new weights anyway.
    sleep_level: int = setting(
        2, "Sleep level at phase 7: 1 keeps the weights in CPU memory, 2 drops them.",
        ge=1, le=2, fix="give 1 (keep the weights in CPU memory) or 2 (drop them)")
    # A sleeping vLLM keeps its CUDA context (and, at level 1, nothing else on the GPU).
    sleep_gpu_residual_mib: int = setting(
        4096, "GPU memory a sleeping engine may keep per process; more fails the phase.",
        unit="MiB", ge=0)
    verify_weights: bool = setting(
        True, "Phase 12 compares the served log-probabilities of the checkpoint's probe "
        "sequences with the trainer's.")
    probe_tolerance: float | None = setting(
        None, "Largest difference of those log-probabilities; none: a tolerance for the "
        "served dtype.", gt=0)
    gpu_memory_utilization: float = setting(
        0.9, "(vllm) Fraction of the GPU's memory the engine may take.", gt=0, le=1,
        fix="it is a fraction of the GPU, e.g. 0.9")
    use_model_generation_config: bool = setting(
        False, "(vllm) Let the model's generation_config.json set sampling defaults "
        "(rollout/engines/vllm.py).")
    vllm_executable: str = setting("vllm", "(vllm) The `vllm` executable to run.",
                                   node_local=True)
    device: str = setting("cpu", "(hf) cpu, cuda or cuda:N.", node_local=True)
    max_batch: int = setting(64, "(hf) Rows (prompts x n) per forward pass.", ge=1)
    threads: int = setting(0, "(hf) Torch threads; 0: torch's default.", ge=0,
                           node_local=True)
    python_executable: str | None = setting(
        None, "(hf) Python that runs the server; none: the daemon's interpreter.",
        node_local=True)
    prewarm: bool = setting(
        False, "(hf) Keep a spare server with its imports done (rollout/engines/hf.py).",
        node_local=True)
    # A cold vLLM start compiles and captures graphs.
    ready_timeout_s: float = setting(1200.0, "How long a start may take before it fails.",
                                     unit="s", gt=0)
    ready_poll_s: float = setting(0.5, "Between two readiness probes of a starting server.",
                                  unit="s", gt=0)
    stop_grace_s: float = setting(10.0, "After SIGTERM, before SIGKILL.", unit="s", gt=0)
    kill_timeout_s: float = setting(10.0, "After SIGKILL, before the stop fails.", unit="s",
                                    gt=0)
    gpu_release_timeout_s: float = setting(
        60.0, "How long a stopped or sleeping server may take to release GPU memory.",
        unit="s", gt=0)
    request_timeout_s: float = setting(
        600.0, "One request: n samples of up to max_tokens.", unit="s", gt=0)
    log_tail_lines: int = setting(40, "Lines of the server's log an error shows.", ge=1)

    def check(self) -> None:
        if self.api_key is not None and (
                not self.api_key or any(c.isspace() for c in self.api_key)):
            raise SettingError("engine.api_key is empty or contains whitespace: use none for "
                               "a random key", key="engine.api_key", value="(hidden)")
        if not self.served_model_name or any(c.isspace() for c in self.served_model_name):
            raise SettingError(f"engine.served_model_name={self.served_model_name!r} is not a "
                               "usable name: give one word, e.g. policy",
                               key="engine.served_model_name", value=self.served_model_name)
        if self.weight_update is WeightUpdate.RELOAD and not _is_loopback(self.host):
            raise SettingError(
                f"weight_update='reload' with host={self.host!r}: the reload needs vLLM's "
                "development endpoints (/sleep, /collective_rpc), which vLLM does not guard "
                "with the API key; bind host='127.0.0.1' (the daemon is on the same node) or "
                "set weight_update='restart'", key="engine.host", value=self.host)
        if self.cuda_visible_devices is not None:
            ids = self.cuda_visible_devices.split(",")
            if not all(ids) or any(c.isspace() for c in self.cuda_visible_devices):
                raise SettingError(
                    f"cuda_visible_devices={self.cuda_visible_devices!r} is not a comma-separated "
                    "list of GPU indices or UUIDs, e.g. '0,1'",
                    key="engine.cuda_visible_devices", value=self.cuda_visible_devices)
            if self.kind is EngineKind.VLLM and len(ids) < self.gpus:
                raise SettingError(
                    f"tensor_parallel_size={self.tensor_parallel_size} x data_parallel_size="
                    f"{self.data_parallel_size} needs {self.gpus} GPUs but "
                    f"cuda_visible_devices={self.cuda_visible_devices!r} shows {len(ids)}",
                    key="engine.cuda_visible_devices", value=self.cuda_visible_devices)
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise SettingError(f"engine.device={self.device!r} is not cpu, cuda or cuda:N",
                               key="engine.device", value=self.device)
        if self.ready_poll_s >= self.ready_timeout_s:
            raise SettingError(
                f"ready_poll_s={self.ready_poll_s} must be below ready_timeout_s="
                f"{self.ready_timeout_s}", key="engine.ready_poll_s", value=self.ready_poll_s)

    @property
    def update(self) -> UpdateRule:
        """The one reading of weight_update: its rule (rollout/engines/weight_updates.py)."""
        return WEIGHT_UPDATES[self.weight_update]

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
