"""The run directory as a careless or hostile writer leaves it.

Each case plants real files (FIFOs, symlinks, out-of-range or truncated
records, forged payloads) in a real run directory, runs the real command or
daemon, and checks four things: the exit code, a message naming the path or
value, a time bound (nothing hangs), and that a sentinel tree outside the
run directory, which every planted symlink points into, is unchanged.

Bullets of issue 8 covered elsewhere: two masters at once
(test_one_master.py), ENOSPC and EROFS (test_storage_faults.py), the real
loop on network mounts and torn reads there (tests/integration/
test_rl_netfs.py, test_netfs.py), the training port (tests/trainer/
test_rendezvous.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.records.records import Claim, Heartbeat, Journal, Manifest, NodeState
from tests.support.cluster import write_config

RUN_ID = "0123456789ab"
CLI_TIMEOUT_S = 30.0  # a record read retries for at most read_retry_s (5 s), then reports


# ---------------------------------------------------------------- fixtures


@pytest.fixture
def sentinel(tmp_path: Path) -> Iterator[Path]:
    """A tree outside the run directory that no command may change."""
    root = tmp_path / "outside"
    (root / "iterations-target" / "phase-05").mkdir(parents=True)
    (root / "iterations-target" / "phase-05" / "arrive-1.json").write_text("keep me")
    (root / "secret.txt").write_text("do not touch")
    (root / "logs").mkdir()
    (root / "logs" / "hf_server.log").write_text("not a log of ours")
    before = _snapshot(root)
    yield root
    assert _snapshot(root) == before, "something outside the run directory changed"


def _snapshot(root: Path) -> dict[str, tuple[int, str]]:
    out = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""
        out[str(path.relative_to(root))] = (stat.S_IMODE(st.st_mode), digest)
    return out


def manifest(**changes: object) -> Manifest:
    base: dict[str, object] = dict(
        run_id=RUN_ID, generation=0, num_nodes=2, weights=(1.0, 1.0),
        config={"run": {"actions": "scripted"}, "scripted": {}}, config_hash="h",
        created=0.0)
    base.update(changes)
    return Manifest(**base)  # type: ignore[arg-type]


def heartbeat(rank: int = 1, **changes: object) -> Heartbeat:
    base: dict[str, object] = dict(
        run_id=RUN_ID, generation=0, rank=rank, token=f"t{rank}", host="h", pid=4242,
        counter=1, state=NodeState.FAILED, iteration=0, phase=3, waiting_for="",
        arrived=None, released=None, session=None, resume_iteration=0, abort=None,
        error=None, wall_time=time.time())
    base.update(changes)
    return Heartbeat(**base)  # type: ignore[arg-type]


def plant(run: Path, rel: str, body: dict | bytes | str) -> Path:
    path = run / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(body, dict):
        body = json.dumps(body)
    path.write_bytes(body if isinstance(body, bytes) else body.encode())
    return path


def a_run(tmp_path: Path) -> Path:
    """A plausible run directory: run.json and a finished rank 1."""
    run = tmp_path / "run"
    plant(run, "run.json", manifest().to_json())
    plant(run, "ranks/1/heartbeat.json", heartbeat().to_json())
    return run


def cli(*args: str, cwd: Path | None = None, umask: int | None = None,
        timeout: float = CLI_TIMEOUT_S) -> tuple[int, str, float]:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "coordinator_cli", *args], capture_output=True, text=True,
        timeout=timeout, cwd=cwd,
        preexec_fn=(lambda: os.umask(umask)) if umask is not None else None)
    return done.returncode, done.stdout + done.stderr, time.monotonic() - started


# ------------------------------------------- FIFOs, devices and symlinks as records


@pytest.mark.parametrize("command", ["status", "recover", "master", "worker"])
def test_a_fifo_as_run_json_is_named_and_nothing_hangs(
    tmp_path: Path, sentinel: Path, command: str
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / "run.json")
    args = {"status": ["status", "--run-dir", str(run)],
            "recover": ["recover", "--run-dir", str(run), "--iteration", "0"],
            "master": ["run", "--master", "--actions", "scripted", "--run-dir", str(run)],
            "worker": ["run", "--worker", "1", "--run-dir", str(run)]}[command]
    code, out, took = cli(*args)
    assert code == 7, out
    assert f"{run}/run.json: is a FIFO, not a regular file" in out
    assert took < 15.0


def test_a_fifo_heartbeat_and_a_heartbeat_symlinked_to_dev_zero_are_named_by_status(
    tmp_path: Path, sentinel: Path
) -> None:
    run = a_run(tmp_path)
    (run / "ranks/1/heartbeat.json").unlink()
    os.mkfifo(run / "ranks/1/heartbeat.json")
    plant(run, "ranks/0/x", "")
    (run / "ranks/0/heartbeat.json").symlink_to("/dev/zero")
    code, out, took = cli("status", "--run-dir", str(run))
    assert code == 7, out
    assert f"{run}/ranks/1/heartbeat.json: is a FIFO, not a regular file" in out
    assert f"{run}/ranks/0/heartbeat.json: ranks/0/heartbeat.json is a symlink" in out
    assert took < 15.0


def test_recover_names_a_fifo_heartbeat(tmp_path: Path, sentinel: Path) -> None:
    run = a_run(tmp_path)
    (run / "ranks/1/heartbeat.json").unlink()
    os.mkfifo(run / "ranks/1/heartbeat.json")
    code, out, took = cli("recover", "--run-dir", str(run), "--iteration", "0")
    assert code == 7 and f"{run}/ranks/1/heartbeat.json: is a FIFO" in out, out
    assert took < 15.0


def test_a_directory_where_a_record_belongs_is_named(tmp_path: Path, sentinel: Path) -> None:
    run = a_run(tmp_path)
    (run / "ranks/0/heartbeat.json").mkdir(parents=True)
    code, out, _ = cli("status", "--run-dir", str(run))
    assert code == 7 and f"{run}/ranks/0/heartbeat.json: is a directory" in out, out


def test_an_oversized_record_is_refused_without_reading_it(tmp_path: Path, sentinel: Path) -> None:
    run = a_run(tmp_path)
    with open(run / "ranks/1/heartbeat.json", "wb") as f:
        f.truncate(64 << 20)  # sparse: 64 MiB claimed, nothing stored
    code, out, took = cli("status", "--run-dir", str(run))
    assert code == 7 and "over the 4194304-byte limit" in out, out
    assert took < 15.0


# ------------------------------------------------- contents that would become paths


def test_a_run_id_that_is_a_path_cannot_move_the_run_outside(
    tmp_path: Path, sentinel: Path
) -> None:
    run = tmp_path / "run"
    body = manifest().to_json() | {"run_id": "../../outside/x"}
    plant(run, "run.json", body)
    plant(run, "ranks/1/heartbeat.json", heartbeat().to_json())
    code, out, _ = cli("run", "--master", "--num-nodes", "2", "--actions", "scripted",
                       "--new-run", "--run-dir", str(run))
    assert code == 7, out
    assert f"{run}/run.json: run_id '../../outside/x' is not 8-64 lowercase hex digits" in out
    assert (run / "ranks/1/heartbeat.json").exists()  # nothing was archived


def test_recover_refuses_a_symlinked_iteration_directory_and_deletes_nothing_outside(
    tmp_path: Path, sentinel: Path
) -> None:
    run = a_run(tmp_path)
    plant(run, "iterations/000000/phase-05/arrive-1.json", "{}")
    (run / "iterations/000001").symlink_to(sentinel / "iterations-target")
    plant(run, "ranks/1/journal.json", Journal(run_id=RUN_ID, rank=1, completed_iteration=0,
                                               iteration=1, done=()).to_json())
    code, out, _ = cli("recover", "--run-dir", str(run), "--iteration", "0")
    assert code == 7, out
    assert f"{run}/iterations/000001: iterations/000001 is a symlink" in out
    assert (run / "iterations/000000/phase-05/arrive-1.json").exists()  # refused before removing


def test_a_release_naming_a_model_outside_the_run_directory_is_refused(
    tmp_path: Path, sentinel: Path
) -> None:
    from coordinator.errors import UnsafeFileError
    from coordinator.machine.actions import StepContext, resolve_config
    from coordinator.machine.runtime import Runtime
    from coordinator.records.phases import Phase
    from rl.actions import build

    run = tmp_path / "run"
    run.mkdir()
    actions = build(resolve_config({"run": {"actions": "rl"}}), rank=1, num_nodes=2, run_dir=run)
    try:
        for forged in ("../outside", str(sentinel), "checkpoints/../../outside"):
            ctx = StepContext(rank=1, num_nodes=2, iteration=3, phase=Phase.RESTART_ENGINE,
                              run_dir=run, run_id=RUN_ID, config=actions.loop.config,
                              weights=(1.0, 1.0), host="h", address="127.0.0.1",
                              runtime=Runtime(), releases={11: {"checkpoint": forged}})
            with pytest.raises(UnsafeFileError, match=r"iterations/000003/phase-11/release\.json:"
                               r" the model it names .* must be a plain relative path"):
                actions.run(Phase.RESTART_ENGINE, ctx)
    finally:
        actions.close()


def test_a_symlinked_or_fifo_child_log_is_never_appended_to(
    tmp_path: Path, sentinel: Path
) -> None:
    from coordinator.errors import UnsafeFileError
    from coordinator.storage import beneath
    from rollout.engines.process import ManagedProcess

    run = tmp_path / "run"
    (run / "ranks/1/logs").mkdir(parents=True)
    (run / "ranks/1/logs/hf_server.log").symlink_to(sentinel / "logs/hf_server.log")
    os.mkfifo(run / "ranks/1/logs/train.log")
    (run / "ranks/2").symlink_to(sentinel / "logs")
    beneath.confine(run)
    try:
        started = time.monotonic()
        for name, problem in (("ranks/1/logs/hf_server.log", "is a symlink"),
                              ("ranks/1/logs/train.log", "is a FIFO"),
                              ("ranks/2/hf_server.log", "ranks/2 is a symlink")):
            with pytest.raises(UnsafeFileError, match=problem) as info:
                ManagedProcess(["true"], log_path=run / name, env={})
            assert str(run / name) in str(info.value)
        assert time.monotonic() - started < 5.0
    finally:
        beneath.release(run)


# ------------------------------------------------------------------ recover's window


def _fake_live_rank(run: Path, rank: int, skew_s: float) -> subprocess.Popen[bytes]:
    """A daemon stand-in on a host whose clock is `skew_s` behind: its heartbeat
    advances every 0.2 s, its wall_time lags."""
    hb = heartbeat(rank=rank, state=NodeState.WAITING).to_json()
    code = (
        "import json, sys, time\n"
        "from pathlib import Path\n"
        "from coordinator.storage.fsio import publish_bytes\n"
        f"hb = json.loads({json.dumps(json.dumps(hb))})\n"
        "n = 0\n"
        "while True:\n"
        "    n += 1\n"
        f"    hb['counter'] = n; hb['wall_time'] = time.time() - {skew_s}\n"
        f"    publish_bytes(Path({str(run / f'ranks/{rank}/heartbeat.json')!r}),"
        " json.dumps(hb).encode())\n"
        "    time.sleep(0.2)\n")
    return subprocess.Popen([sys.executable, "-c", code])


@pytest.mark.parametrize("window", ["0", "-1"])
def test_recover_refuses_a_window_that_is_not_positive(
    tmp_path: Path, sentinel: Path, window: str
) -> None:
    run = a_run(tmp_path)
    code, out, _ = cli("recover", "--run-dir", str(run), "--iteration", "0",
                       f"--window={window}")
    assert code == 2 and f"--window {window} must be above 0" in out, out


def test_recover_sees_a_live_rank_whose_clock_is_100_s_behind(
    tmp_path: Path, sentinel: Path
) -> None:
    run = a_run(tmp_path)
    record = plant(run, "iterations/000000/phase-03/arrive-1.json", "{}")
    live = _fake_live_rank(run, 1, skew_s=100.0)
    try:
        time.sleep(0.5)
        code, out, _ = cli("recover", "--run-dir", str(run), "--iteration", "0")
    finally:
        live.kill()
        live.wait()
    assert code == 2, out
    assert "refusing to recover while daemons still heartbeat: rank 1" in out
    assert record.exists()


# ------------------------------------------------------------- fields out of range


@pytest.mark.parametrize(("rel", "body", "problem"), [
    ("ranks/1/heartbeat.json", heartbeat().to_json() | {"iteration": 10**12},
     "iteration 1000000000000 is outside 0..999999"),
    ("ranks/1/journal.json", {"schema": "coordinator/journal", "version": 1, "run_id": RUN_ID,
                              "rank": 1, "completed_iteration": 10**12, "iteration": 0,
                              "done": []},
     "completed_iteration 1000000000000 is outside -1..999999"),
    ("ranks/1/heartbeat.json", heartbeat().to_json() | {"released": [-1, 99]},
     "released [-1, 99]: iteration -1 is outside 0..999999"),
])
def test_recover_names_a_record_whose_fields_are_out_of_range_at_once(
    tmp_path: Path, sentinel: Path, rel: str, body: dict, problem: str
) -> None:
    run = a_run(tmp_path)
    plant(run, rel, body)
    code, out, took = cli("recover", "--run-dir", str(run), "--iteration", "0")
    assert code == 7 and f"{run}/{rel}: {problem}" in out, out
    assert took < 15.0


@pytest.mark.parametrize(("rel", "body", "problem"), [
    ("run.json", manifest().to_bytes()[:40], "not valid JSON"),
    ("ranks/1/heartbeat.json", heartbeat().to_json() | {"released": [-1, 99]},
     "released [-1, 99]"),
    ("ranks/0/claim.json", Claim(run_id=RUN_ID, generation=0, rank=0, token="t", host="h",
                                 address="127.0.0.1", probe_port=None, pid=1,
                                 started=0.0).to_json() | {"pid": -1},
     "pid -1 is not a process id"),
])
def test_status_names_a_truncated_or_out_of_range_record(
    tmp_path: Path, sentinel: Path, rel: str, body: dict | bytes, problem: str
) -> None:
    run = a_run(tmp_path)
    plant(run, rel, body)
    code, out, _ = cli("status", "--run-dir", str(run))
    assert code == 7 and f"{run}/{rel}: " in out and problem in out, out
    if rel == "run.json":
        code, out, _ = cli("recover", "--run-dir", str(run), "--iteration", "0")
        assert code == 7 and f"{run}/run.json: not valid JSON" in out, out


# ------------------------------------------------------------- modes and node-local keys


def test_under_umask_000_every_directory_is_0755_and_every_file_0644(
    tmp_path: Path, sentinel: Path
) -> None:
    config = write_config(tmp_path / "c.toml", iterations=1)
    run = tmp_path / "deep" / "run"
    procs = []
    for rank in range(2):
        who = ["--master", "--num-nodes", "2", "--config", str(config)] if rank == 0 else \
            ["--worker", "1"]
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "coordinator_cli", "run", "--run-dir", str(run), *who],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=lambda: os.umask(0)))
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    wrong = {str(p): oct(stat.S_IMODE(p.stat().st_mode)) for p in
             [tmp_path / "deep", run, *run.rglob("*")]
             if stat.S_IMODE(p.stat().st_mode) != (0o755 if p.is_dir() else 0o644)}
    assert wrong == {}


def test_run_json_never_carries_node_local_keys_and_workers_use_their_own(
    tmp_path: Path, sentinel: Path
) -> None:
    from coordinator.machine.runplan import node_config

    config = tmp_path / "rl.toml"
    config.write_text(
        '[engine]\napi_key = "s3cret-key"\nextra_args = ["--evil"]\n'
        'env = [["LD_PRELOAD", "/tmp/x.so"]]\nvllm_executable = "/tmp/pwn"\n'
        '[torchrun]\nextra_args = ["--no-python"]\n'
        '[checkpoint]\nlocal_cache = "/etc"\n')
    run = tmp_path / "run"
    master = subprocess.Popen(
        [sys.executable, "-m", "coordinator_cli", "run", "--master", "--num-nodes", "2",
         "--config", str(config), "--run-dir", str(run)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (run / "run.json").exists():
            assert time.monotonic() < deadline and master.poll() is None
            time.sleep(0.05)
        text = (run / "run.json").read_text()
    finally:
        master.kill()
        master.wait()
    for value in ("s3cret-key", "--evil", "LD_PRELOAD", "/tmp/pwn", "--no-python", "/etc"):
        assert value not in text
    recorded = json.loads(text)["config"]
    # A worker's own settings, never the master's: here, none given.
    mine = node_config(recorded, {}).sections
    assert mine["engine"]["api_key"] is None and mine["engine"]["extra_args"] == []
    assert mine["checkpoint"]["local_cache"] == ""
    # Forged node-local keys in run.json are ignored too.
    forged = json.loads(text)["config"] | {"engine": {"vllm_executable": "/tmp/pwn"}}
    assert node_config(forged, {}).sections["engine"]["vllm_executable"] == "vllm"
    assert node_config(forged, {"engine": {"vllm_executable": "/opt/vllm"}}).sections[
        "engine"]["vllm_executable"] == "/opt/vllm"


# ------------------------------------------------------------- bad values: exit 2


@pytest.mark.parametrize(("args", "message"), [
    (["--num-nodes", "1000000"], "--num-nodes 1000000 is above 4096"),
    (["--set", "run=1", "--set", "run.seed=2"],
     "--set 'run.seed=2' puts a key under 'run', which another --set already gave the value 1"),
    (["--node-ip", "10.123.45.67"], "--node-ip 10.123.45.67 is not an IPv4 address of this host"),
])
def test_bad_values_exit_2_before_anything_is_written(
    tmp_path: Path, sentinel: Path, args: list[str], message: str
) -> None:
    run = tmp_path / "run"
    code, out, _ = cli("run", "--master", "--actions", "scripted", "--run-dir", str(run), *args)
    assert code == 2 and message in out, out
    assert "Traceback" not in out
    assert not (run / "run.json").exists()


def test_a_non_utf8_config_and_an_empty_log_path_exit_2(tmp_path: Path, sentinel: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_bytes(b"[run]\nseed = 1 # caf\xe9\n")
    code, out, _ = cli("run", "--master", "--config", str(config), "--run-dir",
                       str(tmp_path / "run"))
    assert code == 2 and f"--config {config} is not UTF-8 text (byte 20 is 0xe9)" in out, out
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    code, out, _ = cli("run", "--master", "--actions", "scripted", "--run-dir", "", cwd=cwd)
    assert code == 2 and "--run-dir '' is empty" in out, out
    assert list(cwd.iterdir()) == []  # nothing went into the current directory


# ------------------------------------------------------------- a live claim of another run


def test_a_live_claim_of_another_run_is_never_taken_over(
    tmp_path: Path, sentinel: Path
) -> None:
    """A claim is taken over only when its holder is provably dead, whatever its
    run id: a master starting a new run in a directory where a daemon of another
    run still heartbeats as rank 0 exits 2 naming it."""
    run = tmp_path / "run"
    plant(run, "ranks/0/claim.json", Claim(
        run_id=RUN_ID, generation=0, rank=0, token="t0", host="elsewhere",
        address="10.0.0.9", probe_port=None, pid=4242, started=0.0).to_json())
    live = _fake_live_rank(run, 0, skew_s=0.0)
    try:
        time.sleep(0.5)
        code, out, took = cli("run", "--master", "--num-nodes", "2", "--actions", "scripted",
                              "--run-dir", str(run))
    finally:
        live.kill()
        live.wait()
    assert code == 2, out
    assert "already held by pid 4242 on host elsewhere" in out
    assert took < 20.0


# ------------------------------------------------------------- inert text in status


def test_status_shows_record_text_as_plain_text(tmp_path: Path, sentinel: Path) -> None:
    run = a_run(tmp_path)
    plant(run, "ranks/1/heartbeat.json",
          heartbeat(error="\x1b[2J\x1b]0;pwned\x07[bold red]boom[/bold red]").to_json())
    code, out, _ = cli("status", "--run-dir", str(run))
    assert code == 0, out
    assert "\x1b" not in out and "\x07" not in out
    assert "\\x1b[2J" in out and "[bold red]boom[/bold red]" in out
