"""Run a command and write down how it exited, even when the job is cancelled.

    python exit_recorder.py DIR cmd [args...]

Under Slurm a cancelled job's steps are signalled together, so the test cannot
ask for each daemon's exit code afterwards (there is no accounting database
here).  This wrapper forwards SIGTERM and SIGINT to its child instead of
dying, waits for it, and writes DIR/<job>-<restart>-<task>-<name>.code with
the child's exit status; then it exits with that status.  It adds one process
per task, gone as soon as its child is.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    out, cmd = Path(argv[0]), argv[1:]
    child = subprocess.Popen(cmd)

    def forward(signum: int, _frame: object) -> None:
        child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    code = child.wait()
    name = next((a for a in cmd if a in ("run", "doctor")), "command")
    tag = "-".join(os.environ.get(v, "x") for v in
                   ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "SLURM_PROCID"))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{tag}-{name}.code").write_text(str(code))
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
