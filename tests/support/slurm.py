"""A real Slurm cluster of three nodes on this host, for the launch recipe's tests.

Debian's Slurm (slurmctld, slurmd, the client tools) and munge, installed by
scripts/setup_test.sh.  Everything lives under one directory: a munge key and a
munged on its own socket, a slurm.conf naming that socket, slurmctld and one
`slurmd -N nI` per node, each on its own port (several slurmd on one host, as
Slurm allows for testing), with no cgroups (proctrack/linuxproc).  Nothing
touches /etc: the clients find the cluster through SLURM_CONF.

    cluster = SlurmCluster.start(tmp_dir)
    job = cluster.sbatch(script, env=...)       # a job id
    cluster.wait_for(job, {"COMPLETED"}, timeout_s=...)
    cluster.stop()                              # every daemon killed and reaped
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

NODES: Final = ("n1", "n2", "n3")
TOOLS: Final = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel")
# Each slurmd registers within a second or two on an idle machine; a loaded
# 2-core CI box running the suite beside it gets a generous margin.
START_TIMEOUT_S: Final = 60.0


def missing_tools() -> list[str]:
    return [t for t in TOOLS if shutil.which(t) is None and
            not Path("/usr/sbin", t).exists()]


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _tool(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


SLURM_CONF: Final = """\
ClusterName=coordtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
AuthType=auth/munge
AuthInfo=socket={root}/munge.socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/ctld
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
# scancel: SIGTERM, then SIGKILL after this many seconds.
KillWait=10
MinJobAge=3600
InactiveLimit=0
SlurmdTimeout=120
SlurmctldTimeout=120
{nodes}
PartitionName=debug Nodes={node_list} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


@dataclass
class SlurmCluster:
    root: Path
    env: dict[str, str]
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @classmethod
    def start(cls, root: Path) -> SlurmCluster:
        root.mkdir(parents=True, exist_ok=True)
        root.chmod(0o755)
        for d in ("ctld", "spool"):
            (root / d).mkdir(exist_ok=True)
        ports = free_ports(1 + len(NODES))
        host = socket.gethostname()
        nodes = "\n".join(
            f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs=2 "
            f"RealMemory=2000 State=UNKNOWN" for name, port in zip(NODES, ports[1:], strict=True))
        conf = root / "slurm.conf"
        conf.write_text(SLURM_CONF.format(host=host, root=root, ctld_port=ports[0], nodes=nodes,
                                          node_list=",".join(NODES)))
        cluster = cls(root=root, env={**os.environ, "SLURM_CONF": str(conf)})
        try:
            cluster._start_munge()
            cluster._spawn([_tool("slurmctld"), "-D", "-i", "-f", str(conf)], "slurmctld")
            for name in NODES:
                cluster._spawn([_tool("slurmd"), "-D", "-N", name, "-f", str(conf)],
                               f"slurmd-{name}")
            cluster._wait_until_idle()
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _start_munge(self) -> None:
        key = self.root / "munge.key"
        subprocess.run([_tool("mungekey"), "-c", "-f", "-k", str(key)], check=True,
                       capture_output=True, timeout=30)
        key.chmod(0o600)
        self._spawn([_tool("munged"), "-F", "-f", f"--socket={self.root}/munge.socket",
                     f"--key-file={key}", f"--log-file={self.root}/munged.log",
                     f"--pid-file={self.root}/munged.pid",
                     f"--seed-file={self.root}/munged.seed"], "munged")
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (self.root / "munge.socket").exists():
            self._check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"munged did not create its socket: {self.logs()}")
            time.sleep(0.1)

    def _spawn(self, argv: list[str], name: str) -> None:
        log = open(self.root / f"{name}.stdout", "wb")  # noqa: SIM115 - lives with the process
        self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                           env=self.env, start_new_session=True))

    def _check_alive(self) -> None:
        dead = [p.args for p in self.procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"Slurm daemons exited: {dead}; logs: {self.logs()}")

    def _wait_until_idle(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            self._check_alive()
            out = self.scontrol("show", "nodes", check=False)
            states = re.findall(r"State=(\S+)", out)
            if len(states) == len(NODES) and all(s.startswith("IDLE") for s in states):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the nodes are not idle after {START_TIMEOUT_S:g} s "
                                   f"({states}); logs: {self.logs()}")
            time.sleep(0.3)

    def logs(self) -> str:
        parts = []
        for f in sorted(self.root.glob("*.log")) + sorted(self.root.glob("*.stdout")):
            with contextlib.suppress(OSError):
                parts.append(f"--- {f.name}\n{f.read_text(errors='replace')[-1500:]}")
        return "\n".join(parts)

    def scontrol(self, *args: str, check: bool = True) -> str:
        done = subprocess.run([_tool("scontrol"), *args], env=self.env, capture_output=True,
                              text=True, timeout=30)
        if check and done.returncode != 0:
            raise RuntimeError(f"scontrol {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def sbatch(self, *args: str, env: Mapping[str, str] | None = None,
               cwd: Path | None = None) -> int:
        done = subprocess.run([_tool("sbatch"), "--parsable", *args],
                              env={**self.env, **(env or {})}, capture_output=True, text=True,
                              timeout=30, cwd=cwd)
        if done.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)}: {done.stderr.strip()}")
        return int(done.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        out = self.scontrol("show", "job", str(job_id), "--oneliner", check=False)
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def state(self, job_id: int) -> str:
        return self.job(job_id).get("JobState", "UNKNOWN")

    def wait_for(self, job_id: int, states: set[str], *, timeout_s: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} is {info.get('JobState')} after {timeout_s:g} s,"
                                   f" not one of {sorted(states)}: {info.get('Reason')}")
            time.sleep(0.5)

    def scancel(self, job_id: int) -> None:
        subprocess.run([_tool("scancel"), str(job_id)], env=self.env, check=True, timeout=30)

    def requeue(self, job_id: int) -> None:
        """`scontrol requeue`; then the job may start again at once: Slurm otherwise
        holds a requeued job for two minutes (its BeginTime), which tests nothing."""
        self.scontrol("requeue", str(job_id))
        deadline = time.monotonic() + 30
        while self.state(job_id) != "PENDING" and time.monotonic() < deadline:
            time.sleep(0.2)
        self.scontrol("update", f"JobId={job_id}", "StartTime=now")

    def stop(self) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.procs.clear()
