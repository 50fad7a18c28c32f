"""How a new policy checkpoint reaches the rollout nodes through the shared filesystem
(issue 34, done when 3).

    python benchmarks/weight_sync_bench.py                # Qwen2.5-0.5B's shape, bf16, ~1 GB
    python benchmarks/weight_sync_bench.py --quick        # same architecture, 4 layers, ~180 MB
    python benchmarks/weight_sync_bench.py --model DIR --iterations 6 --json out.json

A model of a real architecture is built here (trainer/architectures.py, no download),
loaded in float32 and trained at an RL learning rate (AdamW, lr 1e-6, one step per
iteration on 2 x 64 random tokens).  The shared filesystem is the sshfs fixture
(tests/support/netfs.py): one export, 3 mounts, one per node; node 0 is the
trainer's.  Every node has a node-local directory of its own (plain local disk).
Each iteration, on the same trained weights, one mode after the other:

  (a) full, before issue 34: the old code path, rebuilt here.  The publisher writes
      the bf16 checkpoint straight into a hidden directory on the share, reads every
      file back to hash it, then seals it; each node verifies the checkpoint on the
      share (reads and hashes every file), then copies every file while hashing it
      again (one file after the other): every node reads the checkpoint twice.
  (b) full, now: `publish_checkpoint` (staged on node 0's disk, hashed as it is
      copied to the share) and `copy_to_local_cache` on the 3 nodes at once.
  (c) delta: iteration 1 published full (the chain's base), each later one as a
      delta of the one before (publish_checkpoint's delta_parent: taken from the
      model's tensors against the publisher's files kept on node 0's disk, which
      advance in place, trainer/kept_delta.py); every node makes it whole in
      its own cache by advancing the previous copy in place (copy_to_local_cache
      with advance, as the engine's cache does: rl/engine_host.py).  Its floor is
      /bin/cp of the bytes it moves (the delta checkpoint), each way, as (d).
  (d) floor: /bin/cp of the same files, node 0's disk -> share (mount 0), then the
      share -> each node's disk through its own mount, the 3 at once.  No fsync
      (the other modes fsync every file they write, as the protocol requires).

Per mode: the update time (from the publisher's start until every node holds its
verified local copy), its publish and fetch parts, and the bytes the file server
wrote and read.  Those are measured at the server: sftp runs in processes below the
fixture's sshd (`internal-sftp`: a session process that holds the TCP connection
and a child that does the file I/O, talking through pipes).  /proc/<pid>/io's
rchar/wchar count pipe and socket bytes too, so the file bytes are
    written = wchar(sftp children) - (rchar(sessions) - TCP bytes received)
    read    = rchar(sftp children) - (wchar(sessions) - TCP bytes sent)
with the TCP counters from `ss -ti` on the server's sockets (the wire bytes, with
SSH's framing, are kept in the JSON too).  Where that cannot be measured, the bytes
are counted from what each mode reads and writes, and the output says so.

Each mode starts after `sync`, so that none pays for the write-back of the
gigabytes the one before it left dirty.  Each mode's files go once it is measured,
but for what a later step reads ((b)'s node 0 copy, the previous weights of the next
`changed`; (c)'s chain and copies): a run takes one of these paths, and its nodes'
page cache holds that path's files alone.  (Kept until the iteration's end, the
other modes' gigabytes evicted (c)'s parents from the page cache on this machine.)
Before a mode's files on the share go, each node drops its cached pages of them
through its own mount (`remove_shared`): a file removed through one sshfs mount
stays cached in the others, a cluster's other machines, which here share one
machine's memory.

Also per iteration: the share of bf16 elements (and of tensors, and of 4 KiB
blocks of each tensor's bytes: the pages a node holding a whole copy must write
again) that changed since the previously published checkpoint (iteration 1: since
the built model); how much of (c)'s parent, on each node and the publisher's kept
files, was in the page cache as (c) began (fincore); and two
estimates of a delta's size: 6 bytes per changed element (int32 index + bf16 value)
and the XOR of the two checkpoints compressed with zlib level 1.  Apart from the
update: the engine's reload from node 1's copy made by (c), as phase 12 does it on the hf engine
(rollout/hf/weights.py `ResidentModel.reload`: the node's safetensors read and copied
into a bf16 model kept resident, on the CPU here; the file was just written, so its
pages are in the page cache, as on a node that made it).

The last line reads
    weight sync: delta bytes/model X, delta update/floor Y, full update/floor Z
X: the bytes (c) writes to the share over the model's; Y: (c)'s update time over
its own floor; Z: (b)'s update time over (d)'s; each the median over the
iterations after the first (deltas, for (c)).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import itertools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from coordinator.storage.verified import file_digest, in_parallel  # noqa: E402
from trainer.architectures import create_model, preset  # noqa: E402
from trainer.checkpoint import (  # noqa: E402
    MANIFEST_NAME,
    fsync_tree,
    publish_checkpoint,
    read_manifest,
    seal_directory,
    tmp_sibling,
    write_model_files,
)
from trainer.local_copy import copy_to_local_cache  # noqa: E402

BLOCK = 4 << 20
# What reading the server's counters may meet (ss missing or refused, a process
# gone, an unexpected line): the bytes are then counted, and the output says why.
MEASURE_ERRORS = (OSError, RuntimeError, ValueError, subprocess.SubprocessError, psutil.Error)
DTYPE = "bfloat16"
LR = 1e-6
BATCH, SEQ = 2, 64
PAGE = 4096
MB = 1e6


@dataclass
class Node:
    index: int
    share: Path  # the run directory on the share, through this node's own mount
    local: Path  # this node's disk

    def __post_init__(self) -> None:
        self.local.mkdir(parents=True, exist_ok=True)


# ---------------------------------------------------------------- the server's bytes

_SOCKET = re.compile(r"(\S+):(\d+)\s+(\S+):(\d+)")


@dataclass(frozen=True)
class ServerSample:
    sftp_r: int = 0  # rchar of the internal-sftp children: file reads + requests
    sftp_w: int = 0  # wchar: file writes + replies
    session_r: int = 0  # rchar of the session processes: socket + replies
    session_w: int = 0  # wchar: socket + requests
    tcp_in: int = 0  # bytes the server's sockets received
    tcp_out: int = 0  # bytes they sent

    def minus(self, other: ServerSample) -> dict[str, int]:
        d = {k: getattr(self, k) - getattr(other, k) for k in self.__dataclass_fields__}
        return {
            "written": d["sftp_w"] - (d["session_r"] - d["tcp_in"]),
            "read": d["sftp_r"] - (d["session_w"] - d["tcp_out"]),
            "wire_in": d["tcp_in"], "wire_out": d["tcp_out"],
        }


class ServerIo:
    """The file bytes the fixture's sshd wrote and read (module docstring)."""

    def __init__(self, sshd_pid: int, port: int) -> None:
        self.sshd_pid = sshd_pid
        self.port = port
        self.seen: dict[int, Any] = {}  # pid -> psutil.Process (kept: exited ones count too)
        self.problem: str | None = None
        try:
            self.sample()
        except MEASURE_ERRORS as exc:  # fall back to counting, and say why
            self.problem = f"{type(exc).__name__}: {exc}"

    def _tcp(self) -> tuple[int, int]:
        out = subprocess.run(["ss", "-tinH", "state", "established"], capture_output=True,
                             text=True, check=True, timeout=30).stdout
        tcp_in = tcp_out = 0
        found = 0
        lines = out.splitlines()
        for line, info in itertools.pairwise(lines):
            match = _SOCKET.search(line) if not line[:1].isspace() else None
            if match is None or int(match.group(2)) != self.port:
                continue
            received = re.search(r"bytes_received:(\d+)", info)
            sent = re.search(r"bytes_sent:(\d+)", info) or re.search(r"bytes_acked:(\d+)", info)
            if received is None or sent is None:
                raise RuntimeError(f"ss gives no byte counters: {info.strip()[:200]}")
            tcp_in += int(received.group(1))
            tcp_out += int(sent.group(1))
            found += 1
        if not found:
            raise RuntimeError(f"ss lists no connection to the sshd on port {self.port}")
        return tcp_in, tcp_out

    def sample(self) -> ServerSample:
        for proc in psutil.Process(self.sshd_pid).children(recursive=True):
            self.seen.setdefault(proc.pid, proc)
        counts = {"sftp_r": 0, "sftp_w": 0, "session_r": 0, "session_w": 0}
        sftp_children = 0
        for pid, proc in self.seen.items():
            try:
                io = proc.io_counters()
                sftp = "internal-sftp" in " ".join(proc.cmdline())
            except psutil.NoSuchProcess as exc:
                raise RuntimeError(f"sftp process {pid} exited: its bytes are lost") from exc
            kind = "sftp" if sftp else "session"
            sftp_children += sftp
            counts[f"{kind}_r"] += io.read_chars
            counts[f"{kind}_w"] += io.write_chars
        if not sftp_children:
            raise RuntimeError("no internal-sftp process below the sshd")
        tcp_in, tcp_out = self._tcp()
        return ServerSample(tcp_in=tcp_in, tcp_out=tcp_out, **counts)


class Meter:
    """Timestamps and server samples at the marks of one mode: start, published, fetched."""

    def __init__(self, server: ServerIo) -> None:
        self.server = server
        # (time before the server sample, the sample, time after it): an interval runs
        # from one mark's "after" to the next one's "before", so the sampling itself
        # (a fork of `ss`, a scan of /proc) is in no timer.
        self.marks: list[tuple[float, ServerSample | None, float]] = []

    def mark(self) -> None:
        before = time.perf_counter()
        sample = None
        if self.server.problem is None:
            try:
                sample = self.server.sample()
            except MEASURE_ERRORS as exc:
                self.server.problem = f"{type(exc).__name__}: {exc}"
        self.marks.append((before, sample, time.perf_counter()))

    def result(self, counted_written: int, counted_read: int) -> dict[str, Any]:
        (_, s0, after0), (before1, s1, after1), (before2, s2, _) = self.marks
        publish_s, fetch_s = before1 - after0, before2 - after1
        out: dict[str, Any] = {"publish_s": publish_s, "fetch_s": fetch_s,
                               "update_s": publish_s + fetch_s,
                               "counted_written": counted_written, "counted_read": counted_read}
        if s0 is not None and s1 is not None and s2 is not None:
            publish, fetch = s1.minus(s0), s2.minus(s1)
            out.update(measured=True, publish_bytes=publish, fetch_bytes=fetch,
                       written=publish["written"] + fetch["written"],
                       read=publish["read"] + fetch["read"],
                       wire_in=publish["wire_in"] + fetch["wire_in"],
                       wire_out=publish["wire_out"] + fetch["wire_out"])
        else:
            out.update(measured=False, written=counted_written, read=counted_read)
        return out


# ---------------------------------------------------------------- files

def list_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if p.is_file() and p.name != MANIFEST_NAME)


def tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def sha256_file(path: Path) -> tuple[int, str]:
    """Sequential SHA-256 in 4 MiB blocks, how the old path hashed: the project's own
    file_digest, which is unchanged."""
    return file_digest(path)


def copy_hashing(src: Path, dst: Path) -> tuple[int, str]:
    """Read, hash and write in one loop, 4 MiB blocks, fsync: the old copy_verified."""
    digest, size = hashlib.sha256(), 0
    fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            while block := os.read(fd, BLOCK):
                digest.update(block)
                size += len(block)
                view = memoryview(block)
                while view:
                    view = view[os.write(out, view):]
            os.fsync(out)
        finally:
            os.close(out)
    finally:
        os.close(fd)
    return size, digest.hexdigest()


def on_all(nodes: list[Node], work: Callable[[Node], Any]) -> list[Any]:
    """`work` on every node at once (a thread each: coordinator/storage/verified.py in_parallel);
    the first failure is raised once every node has ended."""
    done = in_parallel({f"{n.index:04d}": functools.partial(work, n) for n in nodes},
                       threads=len(nodes))
    return [done[f"{n.index:04d}"] for n in nodes]


def remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def remove_shared(nodes: list[Node], rel: str) -> None:
    """The share's `rel` (a mode's files, measured) removed, each node's cached pages of
    it dropped first through its own mount (POSIX_FADV_DONTNEED).  A file removed
    through one sshfs mount stays cached in the others until memory runs short: on a
    cluster each node's cache is its own machine's, here the three share 24 GB, where
    those stale gigabytes evicted (c)'s parents (fincore: 0.00 of some nodes'
    parents as (c) began)."""
    for node in nodes:
        base = node.share / rel
        # A mount's listing is cached (30 s, as NFS's): a name it shows may be gone
        # (a temporary directory renamed since), so what vanished is skipped.
        files = [Path(d) / f for d, _, names in os.walk(base) for f in names] \
            if base.is_dir() else [base]
        for path in files:
            try:
                fd = os.open(path, os.O_RDONLY)
            except (FileNotFoundError, NotADirectoryError):
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    remove(nodes[0].share / rel)


# ---------------------------------------------------------------- the modes

def legacy_mode(model: Any, model_dir: Path, it: int, nodes: list[Node],
                meter: Meter) -> dict[str, Any]:
    """(a) full, before issue 34 (the code at 2732151^, rebuilt here)."""
    final = nodes[0].share / "a" / f"iter-{it}"
    final.parent.mkdir(parents=True, exist_ok=True)
    meter.mark()
    tmp = tmp_sibling(final)
    write_model_files(model, None, tmp, carry_files_from=model_dir, dtype=DTYPE)
    hashed = {rel: sha256_file(tmp / rel) for rel in list_files(tmp)}  # read back
    manifest = seal_directory(tmp, final, iteration=it, hashed=hashed)
    meter.mark()
    size = sum(e.size for e in manifest.files.values())

    def fetch(node: Node) -> Path:
        src = node.share / "a" / f"iter-{it}"
        seen = read_manifest(src)
        if set(list_files(src)) != seen.files.keys():
            raise RuntimeError(f"{src}: its files differ from its manifest")
        for name, entry in sorted(seen.files.items()):  # verify on the share: read 1
            if sha256_file(src / name) != (entry.size, entry.sha256):
                raise RuntimeError(f"{src / name} differs from its manifest")
        dest = node.local / "a" / f"iter-{it}-{seen.digest}"
        tmp = node.local / "a" / f".{dest.name}.tmp"
        tmp.mkdir(parents=True)
        for name, entry in sorted(seen.files.items()):  # copy, hashing again: read 2
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            if copy_hashing(src / name, tmp / name) != (entry.size, entry.sha256):
                raise RuntimeError(f"{src / name} changed while copied")
        (tmp / MANIFEST_NAME).write_bytes(seen.to_bytes())
        fsync_tree(tmp)
        os.rename(tmp, dest)
        return dest

    on_all(nodes, fetch)
    meter.mark()
    return meter.result(size, size + 2 * size * len(nodes))


def current_mode(model: Any, model_dir: Path, it: int, nodes: list[Node],
                 meter: Meter) -> tuple[dict[str, Any], list[Path]]:
    """(b) full, now: the project's publish_checkpoint and copy_to_local_cache."""
    final = nodes[0].share / "checkpoints" / f"iter-{it}"
    final.parent.mkdir(parents=True, exist_ok=True)
    meter.mark()
    manifest = publish_checkpoint(model, None, final, iteration=it,
                                  carry_files_from=model_dir, dtype=DTYPE)
    meter.mark()
    copies = on_all(nodes, lambda node: copy_to_local_cache(
        node.share / "checkpoints" / f"iter-{it}", node.local / "cache"))
    meter.mark()
    size = sum(e.size for e in manifest.files.values())
    return meter.result(size, size * len(nodes)), copies


def delta_mode(model: Any, model_dir: Path, it: int, nodes: list[Node],
               meter: Meter) -> tuple[dict[str, Any], list[Path]]:
    """(c) delta: iteration 1 full (the base), each later one a delta of the one before
    (publish_checkpoint with delta_parent and the publisher's kept files on node 0's
    disk); every node makes it whole in its own cache, which holds the previous one."""
    final = nodes[0].share / "c" / f"iter-{it}"
    final.parent.mkdir(parents=True, exist_ok=True)
    parent = nodes[0].share / "c" / f"iter-{it - 1}" if it > 1 else None
    cached = [cached_fraction(sorted((node.local / "c-cache").glob("iter-*/*.safetensors")))
              for node in nodes] + [cached_fraction(sorted((nodes[0].local / "c-last").glob(
                  "*.safetensors")))]
    meter.mark()
    manifest = publish_checkpoint(model, None, final, iteration=it, carry_files_from=model_dir,
                                  dtype=DTYPE, delta_parent=parent,
                                  last_published=nodes[0].local / "c-last")
    meter.mark()
    copies = on_all(nodes, lambda node: copy_to_local_cache(
        node.share / "c" / f"iter-{it}", node.local / "c-cache", advance=True))
    meter.mark()
    if it > 1 and manifest.delta is None:
        raise RuntimeError(f"iteration {it} was published full, not as a delta")
    size = sum(e.size for e in manifest.files.values())
    return {**meter.result(size, size * len(nodes)), "parent_cached": cached}, copies


def cached_fraction(files: list[Path]) -> float | None:
    """The share of `files`' pages in the page cache (mincore through util-linux's
    fincore), or None when there are none or fincore cannot say."""
    if not files or shutil.which("fincore") is None:
        return None
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "-o", "RES,SIZE",
                          *map(str, files)], capture_output=True, text=True)
    if out.returncode != 0:
        return None
    pairs = [tuple(map(int, line.split())) for line in out.stdout.splitlines() if line.strip()]
    total = sum(size for _, size in pairs)
    return min(1.0, sum(res for res, _ in pairs) / total) if total else None  # whole pages


def floor_mode(source: Path, it: int, nodes: list[Node], meter: Meter,
               tag: str = "d") -> dict[str, Any]:
    """(d) /bin/cp of the checkpoint's files each way, on the same mounts."""
    name = f"iter-{it}"
    (nodes[0].share / tag).mkdir(parents=True, exist_ok=True)
    for node in nodes:
        (node.local / tag).mkdir(parents=True, exist_ok=True)
    meter.mark()
    subprocess.run(["/bin/cp", "-r", str(source), str(nodes[0].share / tag / name)], check=True)
    meter.mark()
    procs = [subprocess.Popen(["/bin/cp", "-r", str(node.share / tag / name),
                               str(node.local / tag / name)]) for node in nodes]
    codes = [p.wait() for p in procs]
    meter.mark()
    if any(codes):
        raise RuntimeError(f"cp failed: exit codes {codes}")
    size = tree_bytes(source)
    for node in nodes:
        if tree_bytes(node.local / tag / name) != size:
            raise RuntimeError(f"node {node.index}: cp copied a different number of bytes")
    return meter.result(size, size * len(nodes))


# ---------------------------------------------------------------- what changed

def changed(old_dir: Path, new_dir: Path) -> dict[str, Any]:
    """bf16 elements and tensors that differ between two checkpoints, and delta estimates."""
    import torch
    from safetensors.torch import load_file

    def tensors(d: Path) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in sorted(d.glob("*.safetensors")):
            out.update(load_file(str(f)))
        return out

    old, new = tensors(old_dir), tensors(new_dir)
    if old.keys() != new.keys():
        raise RuntimeError(f"{old_dir} and {new_dir} hold different tensors")
    elements = diff = tensors_changed = model_bytes = xor_zlib = blocks = blocks_touched = 0
    for key in sorted(new):
        a, b = old[key], new[key]
        if a.dtype != b.dtype or a.shape != b.shape:
            raise RuntimeError(f"{key}: dtype or shape differs")
        bits = torch.int16 if a.element_size() == 2 else torch.int32
        xor = torch.bitwise_xor(a.contiguous().view(bits), b.contiguous().view(bits))
        n = int(torch.count_nonzero(xor))
        # 4 KiB blocks of the tensor's bytes with a changed element: what a node that
        # holds a whole copy must rewrite, whatever the delta's encoding.
        per_block = PAGE // a.element_size()
        flat = xor.flatten()
        full = flat.numel() // per_block * per_block
        blocks += -(-flat.numel() // per_block)
        blocks_touched += int(torch.count_nonzero(flat[:full].reshape(-1, per_block).any(1)))
        blocks_touched += int(bool(flat[full:].any())) if full < flat.numel() else 0
        elements += a.numel()
        diff += n
        tensors_changed += n > 0
        model_bytes += a.numel() * a.element_size()
        xor_zlib += len(zlib.compress(xor.numpy().tobytes(), 1))
    return {"elements": elements, "changed_elements": diff,
            "changed_fraction": diff / elements,
            "tensors": len(new), "tensors_changed": tensors_changed,
            "weight_bytes": model_bytes,
            "blocks_touched_fraction": blocks_touched / max(blocks, 1),
            "sparse_delta_bytes": diff * 6,  # int32 index + bf16 value per changed element
            "xor_zlib1_bytes": xor_zlib}


# ---------------------------------------------------------------- the run

def train_step(model: Any, optimizer: Any, vocab: int, generator: Any) -> float:
    import torch

    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=generator)
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def sshd_port(fs: Any) -> int:
    config = (fs.base / "keys" / "sshd_config").read_text()
    match = re.search(r"^Port (\d+)$", config, re.M)
    if match is None:
        raise RuntimeError("no Port in the fixture's sshd_config")
    return int(match.group(1))


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from rollout.hf.weights import ResidentModel
    from tests.support.netfs import NetFs

    hf_logging.disable_progress_bar()  # one per checkpoint written: noise in the table
    result: dict[str, Any] = {"quick": args.quick, "iterations": [],
                              "load_start": os.getloadavg()}
    if args.model is not None:
        model_dir = args.model
        result["model"] = str(model_dir)
    else:
        overrides = dict(num_hidden_layers=4, vocab_size=32768) if args.quick else {}
        spec = preset("qwen2", "0.5b", **overrides)
        model_dir = root / "model"
        started = time.perf_counter()
        create_model(model_dir, spec)
        result["model"] = f"qwen2 0.5b{' ' + str(overrides) if overrides else ''}"
        result["build_s"] = time.perf_counter() - started
        result["parameters"] = spec.parameters()
    result["model_bytes"] = tree_bytes(model_dir)
    print(f"model {result['model']}: {result['model_bytes'] / MB:.0f} MB on disk",
          flush=True)

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    vocab = int(model.config.vocab_size)

    # The rollout engine of node 1, resident across iterations (phase 12 reloads it).
    engine = ResidentModel(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16),
                           device=torch.device("cpu"), torch=torch)

    with NetFs(root / "fs", mounts=3) as fs:
        (fs.mounts[0] / "run").mkdir()
        nodes = [Node(i, mount / "run", root / f"node{i}") for i, mount in enumerate(fs.mounts)]
        node_tmp = nodes[0].local / "tmp"
        node_tmp.mkdir()
        tempfile.tempdir = str(node_tmp)  # publish_checkpoint stages on node 0's disk
        assert fs._sshd is not None
        server = ServerIo(fs._sshd.pid, sshd_port(fs))
        if server.problem:
            print(f"server bytes cannot be measured ({server.problem}): counting them from "
                  "what each mode reads and writes", flush=True)
        previous_weights = model_dir
        for it in range(1, args.iterations + 1):
            row: dict[str, Any] = {"iteration": it, "load": os.getloadavg()}
            t = time.perf_counter()
            row["loss"] = train_step(model, optimizer, vocab, generator)
            row["train_s"] = time.perf_counter() - t
            modes: dict[str, Any] = {}
            os.sync()  # before each mode: none pays for the writeback of the one before
            modes["a"] = legacy_mode(model, model_dir, it, nodes, Meter(server))
            remove_shared(nodes, "a")
            for node in nodes:
                remove(node.local / "a")
            os.sync()
            modes["b"], copies = current_mode(model, model_dir, it, nodes, Meter(server))
            for copy in copies[1:]:  # node 0's stays: the next iteration's `changed`
                remove(copy)
            remove_shared(nodes, f"checkpoints/iter-{it}")
            os.sync()
            modes["c"], c_copies = delta_mode(model, model_dir, it, nodes, Meter(server))
            # The floor of the bytes the delta moves: cp of its checkpoint each way.
            delta_src = nodes[0].local / "src-c" / f"iter-{it}"
            delta_src.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run(["/bin/cp", "-r", str(nodes[0].share / "c" / f"iter-{it}"),
                            str(delta_src)], check=True)
            os.sync()
            modes["cd"] = floor_mode(delta_src, it, nodes, Meter(server), tag="cd")
            remove(delta_src)
            remove_shared(nodes, "cd")
            for node in nodes:
                remove(node.local / "cd")
            source = nodes[0].local / "src" / f"iter-{it}"
            t = time.perf_counter()
            write_model_files(model, None, source, carry_files_from=model_dir, dtype=DTYPE)
            row["serialize_s"] = time.perf_counter() - t  # not part of the floor
            os.sync()
            modes["d"] = floor_mode(source, it, nodes, Meter(server))
            remove(source)
            remove_shared(nodes, "d")
            for node in nodes:
                remove(node.local / "d")
            row["modes"] = modes
            t = time.perf_counter()
            engine.reload(c_copies[1])
            row["reload_s"] = time.perf_counter() - t
            row["changed"] = changed(previous_weights, copies[0])
            row["changed_since"] = "built model" if it == 1 else f"iteration {it - 1}"
            row["load_end"] = os.getloadavg()
            result["iterations"].append(row)
            print_iteration(row, flush=True)
            # Disk: the previous iteration's (b) copy on node 0 goes (this one is the
            # next `changed`'s), and any (c) copy not advanced.
            for node in nodes:
                for cache in ("cache", "c-cache"):
                    for old in (node.local / cache).glob(f"iter-{it - 1}-*"):
                        remove(old)
            # (c)'s chain: iteration 1 is its base; later links go once superseded.
            if it > 2:
                remove_shared(nodes, f"c/iter-{it - 1}")
            previous_weights = copies[0]
        result["server_bytes"] = "measured at the sshd (rchar/wchar and TCP counters)" \
            if server.problem is None else f"counted from file sizes: {server.problem}"
    result["load_end"] = os.getloadavg()
    return result


def print_iteration(row: dict[str, Any], *, flush: bool = False) -> None:
    floor = row["modes"]["d"]["update_s"]
    print(f"\niteration {row['iteration']}: train step {row['train_s']:.1f} s (loss "
          f"{row['loss']:.3f}), bf16 serialization {row['serialize_s']:.1f} s, load "
          f"{row['load'][0]:.1f}-{row['load_end'][0]:.1f}; engine reload from node 1's copy "
          f"{row['reload_s']:.2f} s")
    print(f"  {'mode':<26}{'publish s':>10}{'fetch s':>9}{'update s':>10}{'MB written':>12}"
          f"{'MB read':>9}{'update/floor':>14}")
    for key, label in (("a", "(a) full, before issue 34"), ("b", "(b) full, now"),
                       ("c", "(c) delta"), ("cd", "    floor of (c): cp"),
                       ("d", "(d) floor: cp")):
        m = row["modes"][key]
        star = "" if m["measured"] else " (counted)"
        own = row["modes"]["cd"]["update_s"] if key in ("c", "cd") else floor  # its own floor
        print(f"  {label:<26}{m['publish_s']:>10.2f}{m['fetch_s']:>9.2f}{m['update_s']:>10.2f}"
              f"{m['written'] / MB:>12.1f}{m['read'] / MB:>9.1f}"
              f"{ratio(m['update_s'], own):>14.2f}{star}")
    c = row["changed"]
    print(f"  changed since {row['changed_since']}: {c['changed_fraction']:.4f} of bf16 elements"
          f" ({c['tensors_changed']}/{c['tensors']} tensors), {c['blocks_touched_fraction']:.4f}"
          f" of 4 KiB blocks; delta estimates: sparse "
          f"{c['sparse_delta_bytes'] / c['weight_bytes']:.3f}, xor+zlib "
          f"{c['xor_zlib1_bytes'] / c['weight_bytes']:.3f} of the weights")
    cached = ", ".join("-" if f is None else f"{f:.2f}" for f in row["modes"]["c"]["parent_cached"])
    print(f"  (c)'s parent in the page cache as it began (nodes 0-2, then the publisher's "
          f"kept files): {cached}", flush=flush)


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    rows = result["iterations"]
    later = rows[1:] or rows

    def median(key: str, field_: str) -> float | None:
        values = [r["modes"][key][field_] for r in later if field_ in r["modes"][key]]
        return statistics.median(values) if values else None

    def over_floor(key: str) -> float | None:
        floor = "cd" if key in ("c", "cd") else "d"  # the floor of the bytes each mode moves
        values = [ratio(r["modes"][key]["update_s"], r["modes"][floor]["update_s"])
                  for r in later if "update_s" in r["modes"][key]]
        return statistics.median(values) if values else None

    model_bytes = statistics.median(r["modes"]["d"]["counted_written"] for r in rows)
    summary: dict[str, Any] = {"iterations_used": [r["iteration"] for r in later]}
    for key in ("a", "b", "c", "cd", "d"):
        summary[key] = {
            "update_s": median(key, "update_s"), "publish_s": median(key, "publish_s"),
            "fetch_s": median(key, "fetch_s"), "update_over_floor": over_floor(key),
            "written_per_model": median(key, "written") / model_bytes,  # type: ignore[operator]
            "read_per_model": median(key, "read") / model_bytes,  # type: ignore[operator]
        }
    summary["engine_reload_s"] = statistics.median(r["reload_s"] for r in later)
    summary["changed_fraction"] = [r["changed"]["changed_fraction"] for r in rows]
    summary["blocks_touched_fraction"] = [r["changed"]["blocks_touched_fraction"] for r in rows]
    summary["parent_cached"] = [r["modes"]["c"]["parent_cached"] for r in later]
    summary["checkpoint_bytes"] = model_bytes
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="4 layers and a 32768-token vocabulary (~180 MB of bf16)")
    ap.add_argument("--model", type=Path, help="an existing model directory (bf16 safetensors)")
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--json", type=Path, help="write the result here too")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="where the share and the nodes' disks go (default: TMPDIR)")
    args = ap.parse_args()
    if args.iterations < 5:
        ap.error("--iterations: at least 5")
    started = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="weight-sync-bench-", dir=args.workdir))
    try:
        result = run(args, root)
    finally:
        tempfile.tempdir = None
        shutil.rmtree(root, ignore_errors=True)
    result["wall_s"] = time.perf_counter() - started
    summary = result["summary"] = summarize(result)
    print("\nsummary (median over iterations after the first)")
    print(json.dumps(summary, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    a, b, c = summary["a"], summary["b"], summary["c"]
    print(f"server bytes: {result['server_bytes']}")
    print(f"full before issue 34 (a): update/floor {a['update_over_floor']:.2f}, reads "
          f"{a['read_per_model']:.2f} x the checkpoint through the server; full now (b): "
          f"update/floor {b['update_over_floor']:.2f}, reads {b['read_per_model']:.2f} x; "
          f"(a)/(b) update time {a['update_s'] / b['update_s']:.2f}x; engine reload from the "
          f"node's copy {summary['engine_reload_s']:.2f} s; wall {result['wall_s']:.0f} s")
    touched = statistics.median(summary["blocks_touched_fraction"][1:] or [float("nan")])
    seen = [f for row in summary["parent_cached"] for f in row if f is not None]
    print(f"delta (c): {touched:.4f} of the 4 KiB blocks of a copy held a changed element "
          "(what a node holding a whole copy rewrites, whatever the encoding); its parent's "
          "pages in the page cache as it began: "
          f"{'unknown' if not seen else f'{min(seen):.2f}-{max(seen):.2f}'}")
    delta = f"{c['written_per_model']:.3f}, delta update/floor {c['update_over_floor']:.2f}"
    print(f"weight sync: delta bytes/model {delta}, full update/floor "
          f"{b['update_over_floor']:.2f}")


if __name__ == "__main__":
    main()
