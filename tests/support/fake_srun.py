"""A stand-in for Slurm's `srun` on one machine: start --ntasks copies of the
command, each with the variables Slurm gives a task (SLURM_PROCID, SLURM_NODEID,
SLURM_LOCALID, SLURM_NTASKS), wait for all, exit with the first failure's code.

Only what examples/launch/slurm.sbatch uses is understood: --ntasks=N (or
--ntasks N) and options of the form --name=value before the command.
"""

from __future__ import annotations

import os
import subprocess
import sys


def main(argv: list[str]) -> int:
    ntasks = int(os.environ.get("SLURM_NTASKS", "1"))
    args = list(argv)
    while args and args[0].startswith("--"):
        option = args.pop(0)
        name, _, value = option.partition("=")
        if name == "--ntasks":
            ntasks = int(value or args.pop(0))
    if not args:
        print("fake srun: no command given", file=sys.stderr)
        return 2
    procs = [subprocess.Popen(args, env={**os.environ, "SLURM_PROCID": str(task),
                                         "SLURM_NODEID": str(task), "SLURM_LOCALID": "0",
                                         "SLURM_NTASKS": str(ntasks)})
             for task in range(ntasks)]
    codes = [p.wait() for p in procs]
    return next((c for c in codes if c != 0), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
