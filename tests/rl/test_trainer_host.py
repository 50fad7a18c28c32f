"""The daemon's side of the resident trainer (rl/trainer_host.py) against a stand-in
that speaks the real channel: jobs, signs of life, deaths and hangs named within the
lease, a failed job, the GPU check after a job, and the save on a clean stop."""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from coordinator.config.run_config import RunConfig
from coordinator.errors import ActionError
from coordinator.machine.actions import StepContext
from coordinator.machine.runtime import Runtime
from coordinator.records.phases import Phase
from rl.config import parse_sections
from rl.trainer_host import TrainerHost, TrainerState

REPO = Path(__file__).resolve().parents[2]
FAKE = [sys.executable, "-m", "tests.support.fake_trainer"]
LEASE, BEAT = 1.5, 0.2


def context(run: Path) -> StepContext:
    return StepContext(rank=0, num_nodes=1, iteration=0, phase=Phase.TRAIN, run_dir=run,
                       run_id="0123456789ab", config=RunConfig.from_dict({}), weights=(1.0,),
                       host="node-a", address="127.0.0.1", runtime=Runtime())


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> TrainerHost:
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    h = TrainerHost(parse_sections({}), rank=0, run_dir=tmp_path, beat_s=BEAT, lease_s=LEASE)
    yield h
    h.close()


def started(host: TrainerHost, tmp_path: Path) -> StepContext:
    ctx = context(tmp_path)
    host.start(ctx, group="g-1", members=(0,), command=FAKE)
    return ctx


def test_jobs_go_to_one_process_that_stays_and_answers(host: TrainerHost,
                                                       tmp_path: Path) -> None:
    ctx = started(host, tmp_path)
    first = host.submit(ctx, tmp_path / "job-0", 0)
    second = host.submit(ctx, tmp_path / "job-1", 1)
    assert first["trainer_pid"] == second["trainer_pid"] and first["group"] == "g-1"
    status = host.status()
    assert status is not None and (status["group"], status["through"]) == ("g-1", 1)
    assert not ctx.runtime._children, "between jobs the trainer is not a child to kill"


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_process_that_dies_or_hangs_between_jobs_is_named_within_the_lease(
        host: TrainerHost, tmp_path: Path, caplog: pytest.LogCaptureFixture, how: str) -> None:
    ctx = started(host, tmp_path)
    host.submit(ctx, tmp_path / "job-0", 0)
    (pid,) = host._group.pids.values()  # type: ignore[union-attr]
    caplog.set_level(logging.ERROR, "rl.trainer_host")
    os.kill(pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    hit = time.monotonic()
    while host.state is not TrainerState.NONE and time.monotonic() - hit < LEASE + 5:
        time.sleep(0.02)
    took = time.monotonic() - hit
    assert host.state is TrainerState.NONE and took <= LEASE + 2 * BEAT + 1.0, took
    word = "lost process 0" if how == "kill" else "hung: process 0"
    assert any(f"rank 0 on node-a: the resident trainer (group g-1) {word} (pid {pid})" in r.message
               and "between training phases" in r.message for r in caplog.records), caplog.text
    assert host.status() is None

    def gone() -> bool:
        try:  # reaped between the two questions counts as gone
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    deadline = time.monotonic() + 3.0  # stopping it (SIGKILL after 0.5 s) follows the naming
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert gone()
    with pytest.raises(ActionError, match="has no trainer to train iteration 1"):
        host.submit(ctx, tmp_path / "job-1", 1)


def test_a_process_that_hangs_in_a_job_fails_it_naming_the_hang(host: TrainerHost,
                                                                 tmp_path: Path) -> None:
    ctx = started(host, tmp_path)
    (pid,) = host._group.pids.values()  # type: ignore[union-attr]
    import threading

    threading.Timer(0.3, os.kill, (pid, signal.SIGSTOP)).start()
    begun = time.monotonic()
    with pytest.raises(ActionError, match=rf"the trainer hung: process 0 \(pid {pid}\) has not "
                                          "answered .* while training iteration 0"):
        host.submit(ctx, tmp_path / "job-slow", 0)
    assert time.monotonic() - begun <= LEASE + 2 * BEAT + 2.0
    assert host.state is TrainerState.NONE


def test_a_failed_job_names_the_trainers_error_and_the_group_is_gone(
        host: TrainerHost, tmp_path: Path) -> None:
    ctx = started(host, tmp_path)
    with pytest.raises(ActionError, match="the trainer failed iteration 0: TrainError: the "
                                          "batch holds no samples"):
        host.submit(ctx, tmp_path / "job-fail", 0)
    assert host.state is TrainerState.NONE and host.status() is None


def test_a_trainer_keeping_the_gpu_after_a_job_is_stopped_with_a_warning(
        host: TrainerHost, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("FAKE_TRAINER_GPU_MIB", "9000")
    asked: list[tuple] = []

    def holders(pids: object, timeout: float, *, allowed_mib: int) -> dict[int, int]:
        asked.append((list(pids), timeout, allowed_mib))  # type: ignore[call-overload]
        return {asked[0][0][0]: 9000}

    monkeypatch.setattr("rl.trainer_host.wait_gpu_released", holders)
    ctx = started(host, tmp_path)
    host.submit(ctx, tmp_path / "job-0", 0)
    assert asked and asked[0][2] == 3072  # torchrun.offload_residual_mib
    assert host.state is TrainerState.NONE
    assert "above torchrun.offload_residual_mib=3072: stopping it" in caplog.text


def test_a_trainer_with_gpus_of_its_own_keeps_them_between_jobs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Disaggregated (no engine on the trainer's GPUs): nothing to give back."""
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.setenv("FAKE_TRAINER_GPU_MIB", "9000")
    monkeypatch.setattr("rl.trainer_host.wait_gpu_released",
                        lambda *a, **k: pytest.fail("asked a trainer to give its own GPUs back"))
    own = TrainerHost(parse_sections({}), rank=0, run_dir=tmp_path, beat_s=BEAT, lease_s=LEASE,
                      shares_gpus=False)
    try:
        ctx = started(own, tmp_path)
        own.submit(ctx, tmp_path / "job-0", 0)
        assert own.state is TrainerState.IDLE
    finally:
        own.close()


def test_a_clean_stop_saves_what_was_trained_since_the_last_save(
        host: TrainerHost, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "rl.trainer_host")
    ctx = started(host, tmp_path)
    host.submit(ctx, tmp_path / "job-0", 0)
    host.close()
    assert "on stopping, the trainer saved the state of iteration [0]" in caplog.text
    assert host.state is TrainerState.NONE


def test_the_session_moves_nothing_on_a_cpu() -> None:
    from trainer.config import TrainConfig
    from trainer.distributed import DistContext
    from trainer.session import Session

    def session(device: str, offload: str) -> Session:
        ctx = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device(device),
                          strategy="ddp")  # type: ignore[arg-type]
        return Session(ctx=ctx, config=TrainConfig(offload=offload),  # type: ignore[arg-type]
                       model=None, tokenizer=None, optimizer=None)

    assert not session("cpu", "auto").offloads and not session("cpu", "on").offloads
    assert session("cuda", "auto").offloads and not session("cuda", "off").offloads


def test_phase_9_finds_a_process_that_died_since_the_watchers_last_look(
        host: TrainerHost, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ctx = started(host, tmp_path)
    host.submit(ctx, tmp_path / "job-0", 0)
    (pid,) = host._group.pids.values()  # type: ignore[union-attr]
    caplog.set_level(logging.ERROR, "rl.trainer_host")
    os.kill(pid, signal.SIGKILL)
    asked = time.monotonic()
    assert host.status() is None
    # At once, by its closed channel or, where the process was reaped first (a loaded
    # machine), by its exit: never by waiting out the lease.
    assert time.monotonic() - asked < LEASE
    assert re.search(rf"lost process 0 \(pid {pid}\): its connection closed|exited: "
                     rf"torchrun pid {pid} killed by SIGKILL", caplog.text), caplog.text
