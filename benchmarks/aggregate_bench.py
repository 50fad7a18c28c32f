"""Aggregation benchmark: rank outputs -> training batch, against the disk's own speed.

    python benchmarks/aggregate_bench.py [--mb 256] [--ranks 3]   # ~80 s on 2 busy cores
    python benchmarks/aggregate_bench.py --mb 16                  # quick, ~10 s

    1. write --ranks rank directories of realistic trajectories (~--mb MiB each)
       through the real RankCheckpointWriter (chunk every --groups-per-chunk groups)
    2. raw sequential write (+fsync) and read (cache dropped) of as many bytes
    3. torch.save (+fsync) and torch.load(weights_only=True) of every chunk file
    4. aggregate_iteration in a child process: time, MiB/s of rank data, peak RSS
    5. the trainer's load_train_batch of the result
    --> a table whose last two lines are the target ratios

Caches are dropped with posix_fadvise(DONTNEED) after fsync, so reads come from
the disk where the kernel allows it.  Peak RSS growth is the child's peak RSS
while aggregating (VmHWM restarted through /proc/self/clear_refs just before;
ru_maxrss where that is refused) minus its RSS just before (torch alone is
~220 MiB); a sampler thread splits it into anonymous and file-mapped memory.
It is compared with the largest chunk file and with the largest rank's output
(all its chunk files).  Everything lives in one temporary directory under
/tmp, removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

ROOT: Final = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402
import torch  # noqa: E402

from rollout.aggregate import aggregate_iteration  # noqa: E402
from rollout.chunk_format import FinishReason, TrajectorySample  # noqa: E402
from rollout.train_batch import load_train_batch  # noqa: E402
from rollout.trajectory import RankCheckpointWriter  # noqa: E402

MIB: Final = 1 << 20
BLOCK: Final = 16 * MIB  # raw I/O block: large enough to reach the device's streaming speed
VOCAB: Final = 151_936  # Qwen2-sized vocabulary: ids need the full int32 width
FAILED_FRACTION: Final = 0.02  # engine timeouts and errors, dropped by the aggregation
TEXT_BYTES_PER_TOKEN: Final = 4  # decoded text stored beside the ids, as a real rank does
_TEXT: Final = ("the answer is 42 because 6 * 7 = 42; " * 4096)[: 64 * 1024]


@dataclass(frozen=True, kw_only=True)
class Options:
    mb: int
    ranks: int
    group_size: int
    groups_per_chunk: int
    seed: int

    def __post_init__(self) -> None:
        for name in ("mb", "ranks", "group_size", "groups_per_chunk"):
            if getattr(self, name) < 1:
                raise SystemExit(f"--{name.replace('_', '-')}={getattr(self, name)} is below 1")


# ---------------------------------------------------------------- rank data


def _group(task_id: str, n: int, gen: torch.Generator) -> list[TrajectorySample]:
    prompt = torch.randint(
        0, VOCAB, (int(torch.randint(128, 1024, (1,), generator=gen)),), generator=gen
    ).tolist()
    out = []
    for i in range(n):
        failed = float(torch.rand(1, generator=gen)) < FAILED_FRACTION
        length = 0 if failed else int(torch.randint(64, 4096, (1,), generator=gen))
        ids = torch.randint(0, VOCAB, (length,), generator=gen, dtype=torch.int32).tolist()
        # Sampled tokens mostly have log-probs near 0, a few far below.
        logprobs = (torch.rand(length, generator=gen).clamp_min(1e-6).log() * 0.3).tolist()
        text = (_TEXT * (1 + length * TEXT_BYTES_PER_TOKEN // len(_TEXT)))[
            : length * TEXT_BYTES_PER_TOKEN
        ]
        out.append(
            TrajectorySample(
                task_id=task_id,
                sample_index=i,
                prompt_token_ids=prompt,
                response_token_ids=ids,
                response_logprobs=logprobs,
                response_text=text,
                reward=0.0 if failed else float(torch.randint(0, 2, (1,), generator=gen)),
                finish_reason=FinishReason.ERROR if failed else FinishReason.STOP,
                failed=failed,
                error="timeout" if failed else "",
            )
        )
    return out


def write_ranks(root: Path, opts: Options) -> tuple[dict[int, Path], dict[int, list[str]]]:
    dirs, assignments = {}, {}
    for rank in range(opts.ranks):
        gen = torch.Generator().manual_seed(opts.seed * 1000 + rank)
        directory = root / f"rank-{rank}"
        writer = RankCheckpointWriter(directory, rank, opts.groups_per_chunk, iteration=0)
        ids: list[str] = []
        produced = 0  # bytes the samples will take on disk; chunks may still be pending
        while produced < opts.mb * MIB:
            ids.append(f"bench/train/{rank}-{len(ids)}")
            group = _group(ids[-1], opts.group_size, gen)
            writer.add_group(group)
            produced += sum(
                4 * len(s.prompt_token_ids) + (8 + TEXT_BYTES_PER_TOKEN) * len(s.response_token_ids)
                for s in group
            )
        writer.finalize()
        dirs[rank], assignments[rank] = directory, ids
    return dirs, assignments


def chunk_files(dirs: dict[int, Path]) -> list[Path]:
    return sorted(p for d in dirs.values() for p in d.glob("chunk-*.pt"))


def drop_cache(path: Path) -> None:
    """Evict a file's clean pages so the next read comes from the device."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages cannot be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- measurements


def raw_io(path: Path, nbytes: int) -> tuple[float, float]:
    """Seconds for a sequential write+fsync and a cold sequential read of nbytes."""
    block = memoryview(os.urandom(BLOCK))  # incompressible, generated once; sliced without copies
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, block[: min(left, BLOCK)])
        os.fsync(fd)
    finally:
        os.close(fd)
    write_s = time.perf_counter() - start
    read_s = cold_read(path)
    path.unlink()
    return write_s, read_s


def cold_read(path: Path) -> float:
    """Seconds to read a file sequentially after dropping it from the cache."""
    drop_cache(path)
    start = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        while os.read(fd, BLOCK):
            pass
    finally:
        os.close(fd)
    return time.perf_counter() - start


def torch_io(files: list[Path], scratch: Path) -> tuple[float, float]:
    """Seconds to torch.load(weights_only=True) every chunk cold, and to torch.save+fsync it."""
    for f in files:
        drop_cache(f)
    load_s = save_s = 0.0
    for f in files:
        start = time.perf_counter()
        obj = torch.load(f, weights_only=True)
        load_s += time.perf_counter() - start
        start = time.perf_counter()
        with scratch.open("wb") as handle:
            torch.save(obj, handle)
            handle.flush()
            os.fsync(handle.fileno())
        save_s += time.perf_counter() - start
        del obj
    scratch.unlink(missing_ok=True)
    return save_s, load_s


def _status() -> dict[str, int]:
    """The byte-valued lines of /proc/self/status (VmHWM, RssAnon, RssFile, ...)."""
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if value.strip().endswith("kB"):
                fields[key] = int(value.split()[0]) * 1024
    return fields


def _rss_split() -> tuple[int, int]:
    """(anonymous, file-mapped) resident bytes of this process."""
    f = _status()
    return f.get("RssAnon", 0), f.get("RssFile", 0) + f.get("RssShmem", 0)


def _reset_peak_rss() -> bool:
    """Restart VmHWM from the current RSS (Linux >= 4.0), so it measures what follows."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        return False
    return True


class _Sampler(threading.Thread):
    """Largest anonymous and file-mapped RSS seen, every few ms (ru_maxrss has only the sum)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.stop = threading.Event()
        self.anon = self.file = 0

    def run(self) -> None:
        while not self.stop.wait(0.005):
            anon, file = _rss_split()
            self.anon, self.file = max(self.anon, anon), max(self.file, file)


def child_main(spec: Path) -> None:
    """In a fresh process: aggregate once, print timing and memory as JSON."""
    job = json.loads(spec.read_text())
    baseline = psutil.Process().memory_info().rss
    base_anon, base_file = _rss_split()
    maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    # ru_maxrss also covers importing torch, which can peak above the
    # aggregation itself; VmHWM can be restarted here.
    hwm_reset = _reset_peak_rss()
    sampler = _Sampler()
    sampler.start()
    start = time.perf_counter()
    metrics = aggregate_iteration(
        {int(r): Path(d) for r, d in job["dirs"].items()},
        {int(r): ids for r, ids in job["assignments"].items()},
        iteration=0,
        group_size=job["group_size"],
        out_path=Path(job["out"]),
    )
    seconds = time.perf_counter() - start
    sampler.stop.set()
    sampler.join()
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if hwm_reset:
        maxrss = _status()["VmHWM"]
    elif maxrss <= maxrss_before:  # hidden below the import peak: use the sampled upper bound
        maxrss = baseline + (sampler.anon - base_anon) + (sampler.file - base_file)
    print(
        json.dumps(
            {
                "seconds": seconds,
                "baseline_rss": baseline,
                "maxrss_before": maxrss_before,
                "maxrss": maxrss,
                "anon_growth": sampler.anon - base_anon,
                "file_growth": sampler.file - base_file,
                "train_samples": metrics.num_train_samples,
                "samples": metrics.num_samples,
                "dropped_groups": metrics.num_dropped_groups,
            }
        )
    )


def aggregate_in_child(
    dirs: dict[int, Path], assignments: dict[int, list[str]], out: Path, group_size: int
) -> dict[str, Any]:
    spec = out.with_name("aggregate-job.json")  # task ids can outgrow one argv string
    spec.write_text(
        json.dumps(
            {
                "dirs": {r: str(d) for r, d in dirs.items()},
                "assignments": assignments,
                "group_size": group_size,
                "out": str(out),
            }
        )
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, __file__, "--child", str(spec)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    if done.returncode != 0:
        raise SystemExit(f"aggregation child failed ({done.returncode}):\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


# ---------------------------------------------------------------- report


def run(opts: Options, root: Path) -> list[tuple[str, str]]:
    start = time.perf_counter()
    # Generating data is many small tensor ops: on 2 busy cores, waking a
    # second OpenMP thread for each costs more than the op.  Measurements
    # below run with torch's default again.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dirs, assignments = write_ranks(root, opts)
    finally:
        torch.set_num_threads(threads)
    gen_s = time.perf_counter() - start
    files = chunk_files(dirs)
    sizes = [f.stat().st_size for f in files]
    total = sum(sizes)
    per_rank = [sum(f.stat().st_size for f in d.glob("chunk-*.pt")) for d in dirs.values()]
    mib = total / MIB

    write_s, read_s = raw_io(root / "raw.bin", total)
    save_s, load_s = torch_io(files, root / "resave.pt")
    for f in files:
        drop_cache(f)
    out = root / "batch.pt"
    child = aggregate_in_child(dirs, assignments, out, opts.group_size)
    batch_bytes = out.stat().st_size
    batch_read_s = cold_read(out)
    drop_cache(out)
    start = time.perf_counter()
    batch = load_train_batch(out)
    batch_load_s = time.perf_counter() - start

    agg_rate = mib / child["seconds"]
    read_rate = mib / read_s
    peak_growth = child["maxrss"] - child["baseline_rss"]
    batch_write_s = batch_bytes / total * write_s  # at the measured raw write speed
    io_floor_s = read_s + batch_write_s
    format_floor_s = load_s + batch_write_s
    rows = [
        (
            "rank data",
            f"{opts.ranks} ranks, {len(files)} chunk files, {mib:.0f} MiB "
            f"(largest chunk {max(sizes) / MIB:.1f} MiB, largest rank "
            f"{max(per_rank) / MIB:.0f} MiB); written in {gen_s:.1f} s",
        ),
        ("raw write + fsync", f"{write_s:.2f} s  {mib / write_s:8.0f} MiB/s"),
        ("raw read (cold)", f"{read_s:.2f} s  {read_rate:8.0f} MiB/s"),
        ("torch.save chunks + fsync", f"{save_s:.2f} s  {mib / save_s:8.0f} MiB/s"),
        ("torch.load chunks (weights_only, cold)", f"{load_s:.2f} s  {mib / load_s:8.0f} MiB/s"),
        (
            "aggregate_iteration (cold)",
            f"{child['seconds']:.2f} s  {agg_rate:8.0f} MiB/s of rank data",
        ),
        (
            "  samples kept / total, groups dropped",
            f"{child['train_samples']} / {child['samples']}, {child['dropped_groups']}",
        ),
        (
            "  batch file",
            f"{batch_bytes / MIB:.0f} MiB, {int(batch.response_lengths.sum())} response tokens",
        ),
        (
            "  raw read of the batch file (cold)",
            f"{batch_read_s:.2f} s  {batch_bytes / MIB / batch_read_s:8.0f} MiB/s",
        ),
        (
            "load_train_batch (cold)",
            f"{batch_load_s:.2f} s  {batch_bytes / MIB / batch_load_s:8.0f} MiB/s",
        ),
        (
            "aggregator RSS: baseline, peak",
            f"{child['baseline_rss'] / MIB:.0f} MiB, "
            f"{child['maxrss'] / MIB:.0f} MiB "
            f"(+{peak_growth / MIB:.0f} MiB while aggregating: "
            f"anonymous +{child['anon_growth'] / MIB:.0f}, "
            f"file-mapped +{child['file_growth'] / MIB:.0f})",
        ),
        (
            "I/O floor: raw read of rank data + raw write of batch",
            f"{io_floor_s:.2f} s  (aggregation takes {child['seconds'] / io_floor_s:.1f}x)",
        ),
        (
            "format floor: cold torch.load of chunks + raw write of batch",
            f"{format_floor_s:.2f} s  (aggregation takes {child['seconds'] / format_floor_s:.1f}x)",
        ),
        ("peak RSS growth / largest chunk file", f"{peak_growth / max(sizes):.2f}"),
        ("aggregation / raw read throughput (reading alone)", f"{agg_rate / read_rate:.2f}"),
        # Aggregation must read every rank file and write the batch: the raw
        # disk doing exactly that I/O is the throughput to compare against.
        ("aggregation / raw disk throughput for the same I/O (target >= 0.5)",
         f"{io_floor_s / child['seconds']:.2f}"),
        (
            "peak RSS growth / largest rank file (target <= 2)",
            f"{peak_growth / max(per_rank):.2f}  (rank file = all of one rank's chunk files)",
        ),
    ]
    return rows


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child_main(Path(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256, help="MiB of trajectories per rank")
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument(
        "--groups-per-chunk",
        type=int,
        default=8,
        help="RankCheckpointWriter's every_k_groups (the project default is 8)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    opts = Options(
        mb=args.mb,
        ranks=args.ranks,
        group_size=args.group_size,
        groups_per_chunk=args.groups_per_chunk,
        seed=args.seed,
    )
    root = Path(tempfile.mkdtemp(prefix="aggregate-bench-", dir="/tmp"))
    try:
        rows = run(opts, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    width = max(len(k) for k, _ in rows)
    print(f"{'measurement':<{width}}  result")
    print("-" * (width + 40))
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


if __name__ == "__main__":
    main()
