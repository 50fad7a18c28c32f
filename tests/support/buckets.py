"""Real object-store servers on loopback for the bucket tests: Azurite (Microsoft's
Azure Storage emulator, installed by scripts/setup_test.sh in .tools/azurite) and
moto's S3 server (the dev extra).

Each server is started once per test session on a free port, with its data in a
temporary directory, and stopped at the end. `Bucket` is one test's run
directory in it: a fresh prefix, the environment a node needs to reach it (the
credentials as each cloud's tools take them) and a client to read and plant
objects as a test.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from coordinator.storage import bucket_url
from coordinator.storage.objstore import ObjectStore

ROOT = Path(__file__).resolve().parents[2]
AZURITE = ROOT / ".tools/azurite/node_modules/.bin/azurite-blob"
START_TIMEOUT_S = 60.0  # node or flask importing on a loaded 2-core machine
CONTAINER = "runs"
_prefixes = itertools.count()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_listening(port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited {proc.returncode}: {log.read_text()[-2000:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.05)
    raise RuntimeError(f"the server did not listen on {port} in {START_TIMEOUT_S} s: "
                       f"{log.read_text()[-2000:]}")


@dataclasses.dataclass
class Server:
    kind: str  # "azurite" or "moto"
    port: int
    proc: subprocess.Popen[bytes]
    env: dict[str, str]

    @property
    def scheme(self) -> str:
        return "az" if self.kind == "azurite" else "s3"

    def bucket(self, name: str) -> Bucket:
        """A fresh prefix of the test container for one test."""
        url = f"{self.scheme}://{CONTAINER}/{name}-{os.getpid()}-{next(_prefixes)}"
        return Bucket(url=url, env=dict(self.env), server=self)

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)


@dataclasses.dataclass
class Bucket:
    url: str
    env: dict[str, str]
    server: Server

    @property
    def store(self) -> ObjectStore:
        return ObjectStore(bucket_url.parse(self.url), self.env)

    def read(self, key: str) -> bytes | None:
        return self.store.read(key)

    def put(self, key: str, data: bytes) -> None:
        self.store.publish(key, data)

    def node_env(self, tmp: Path, node: str) -> dict[str, str]:
        """A simulated node's whole environment: this process's, the credentials, and a
        TMPDIR of its own (its own local root, so no node sees a file another node
        fetched or wrote)."""
        local = tmp / f"node-{node}"
        local.mkdir(parents=True, exist_ok=True)
        return {**os.environ, **self.env, "TMPDIR": str(local)}


def start_azurite(work: Path) -> Server:
    if not AZURITE.exists():
        raise RuntimeError(f"{AZURITE} is missing: scripts/setup_test.sh installs Azurite")
    port = free_port()
    log = work / "azurite.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(AZURITE), "--silent", "--skipApiVersionCheck", "--location", str(work / "data"),
             "--blobHost", "127.0.0.1", "--blobPort", str(port)],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    _wait_listening(port, proc, log)
    endpoint = f"http://127.0.0.1:{port}/{bucket_url.AZURITE_ACCOUNT}"
    # Azurite's documented development connection string, on this port.
    connection = (f"DefaultEndpointsProtocol=http;AccountName={bucket_url.AZURITE_ACCOUNT};"
                  f"AccountKey={bucket_url.AZURITE_KEY};BlobEndpoint={endpoint};")
    from azure.storage.blob import BlobServiceClient

    BlobServiceClient.from_connection_string(connection).create_container(CONTAINER)
    return Server("azurite", port, proc, {"AZURE_STORAGE_CONNECTION_STRING": connection})


def start_moto(work: Path) -> Server:
    port = free_port()
    log = work / "moto.log"
    server = shutil.which("moto_server", path=str(Path(sys.executable).parent))
    if server is None:
        raise RuntimeError("moto_server is missing: scripts/setup_test.sh installs the dev extra")
    with open(log, "wb") as out:
        proc = subprocess.Popen([server, "-H", "127.0.0.1", "-p", str(port)], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    _wait_listening(port, proc, log)
    endpoint = f"http://127.0.0.1:{port}"
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/{CONTAINER}", method="PUT"),
                           timeout=10).close()
    env = {"AWS_ACCESS_KEY_ID": "testing-key-id", "AWS_SECRET_ACCESS_KEY": "testing-secret-key",
           "AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint}
    return Server("moto", port, proc, env)


@contextlib.contextmanager
def running(kind: str, work: Path) -> Iterator[Server]:
    work.mkdir(parents=True, exist_ok=True)
    server = start_azurite(work) if kind == "azurite" else start_moto(work)
    try:
        yield server
    finally:
        server.stop()
