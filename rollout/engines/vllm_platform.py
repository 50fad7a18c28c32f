"""What the vLLM an engine would run supports, asked of that vLLM.

    probe(vllm_executable) -> VllmPlatform(device, sleep_mode, version)

`vllm serve --enable-sleep-mode` is refused where vLLM has no sleep mode
("Sleep mode is not supported on current platform": its CPU build, for one).
Whether it has one is vLLM's own decision (`current_platform.
is_sleep_mode_available()`, vllm/platforms/interface.py in 0.29.0: CUDA, ROCm
and XPU), so the daemon asks the executable's own interpreter (the `vllm`
script's shebang) rather than guess from the node.  The answer (about 4 s of
imports) is kept per executable file for the life of the process.

Where the executable cannot be asked (not a Python script, or the probe
fails) the platform is the one this node shows: CUDA when NVML sees a GPU,
else none with sleep mode; the reason is logged.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from rollout.engines import process as proc_mod

log = logging.getLogger("rollout.engines.engine")

PROBE_TIMEOUT_S: Final = 120.0  # importing vllm.platforms: about 4 s on 2 idle cores
_PROBE: Final = (
    "import json\n"
    "from importlib.metadata import version\n"
    "from vllm.platforms import current_platform as p\n"
    "print(json.dumps({'device': p.device_type, 'sleep_mode': "
    "bool(p.is_sleep_mode_available()), 'version': version('vllm')}))\n"
)


@dataclass(frozen=True, kw_only=True)
class VllmPlatform:
    device: str  # vLLM's current_platform.device_type: "cuda", "cpu", ...
    sleep_mode: bool  # whether `vllm serve --enable-sleep-mode` is accepted
    version: str  # the vllm distribution's version ("0.29.0+cpu" for the CPU build)
    asked: bool = True  # False: guessed from this node, vLLM could not be asked


_CACHE: dict[tuple[str, int, int], VllmPlatform] = {}


def interpreter(executable: str) -> Path | None:
    """The Python that runs `executable` (its shebang), or None."""
    found = shutil.which(executable)
    if found is None:
        return None
    try:
        with open(found, "rb") as f:
            first = f.readline(512)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    parts = first[2:].decode(errors="replace").split()
    if not parts:
        return None
    if Path(parts[0]).name == "env" and len(parts) > 1:  # #!/usr/bin/env python3
        resolved = shutil.which(parts[1])
        return Path(resolved) if resolved else None
    return Path(parts[0]) if "python" in Path(parts[0]).name else None


def probe(executable: str, *, env: dict[str, str] | None = None) -> VllmPlatform:
    """What vLLM reports for this executable's installation (cached per file)."""
    found = shutil.which(executable)
    key = (found or executable, *_stamp(found))
    if key in _CACHE:
        return _CACHE[key]
    python = interpreter(executable)
    platform = _ask(python, env) if python is not None else None
    if platform is None:
        gpus = proc_mod.visible_gpu_count(dict(env or os.environ))
        platform = VllmPlatform(device="cuda" if gpus else "unknown", sleep_mode=bool(gpus),
                                version="unknown", asked=False)
        log.warning("could not ask %s which platform it runs on (%s); going by this node: %s",
                    executable, "no Python interpreter in its first line" if python is None
                    else "the probe failed, see above",
                    f"{gpus} GPU(s), sleep mode on" if gpus else "no GPU, sleep mode off")
    else:
        log.info("vLLM %s at %s runs on %s: sleep mode %s", platform.version, found,
                 platform.device, "available" if platform.sleep_mode else "not available")
    _CACHE[key] = platform
    return platform


def _stamp(path: str | None) -> tuple[int, int]:
    try:
        st = os.stat(path) if path else None
    except OSError:
        st = None
    return (st.st_mtime_ns, st.st_size) if st is not None else (0, 0)


def _ask(python: Path, env: dict[str, str] | None) -> VllmPlatform | None:
    try:
        done = subprocess.run([str(python), "-c", _PROBE], capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S, env=env, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("asking %s for vLLM's platform failed: %s", python, exc)
        return None
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        log.warning("asking %s for vLLM's platform failed (exit %d): %s", python,
                    done.returncode, done.stderr.strip()[-500:])
        return None
    try:
        answer = json.loads(lines[-1])
        return VllmPlatform(device=str(answer["device"]), sleep_mode=answer["sleep_mode"] is True,
                            version=str(answer["version"]))
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("vLLM's platform answer %r cannot be read: %s", lines[-1], exc)
        return None
