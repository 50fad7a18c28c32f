"""Phase 9's choice: keep the resident trainer group, or start a new one."""

from __future__ import annotations

from rl.trainer_group import group_to_keep


def status(group: str = "g1", through: int = 4, members: tuple[int, ...] = (0, 1, 2)) -> dict:
    return {"group": group, "members": list(members), "through": through, "pid": 1}


def test_a_group_every_member_holds_at_the_previous_iteration_is_kept() -> None:
    assert group_to_keep({r: status() for r in range(3)}, (0, 1, 2), 5) == "g1"


def test_any_member_without_it_gone_elsewhere_or_behind_means_a_new_group() -> None:
    alive = {r: status() for r in range(3)}
    assert group_to_keep({**alive, 2: None}, (0, 1, 2), 5) is None  # its trainer died
    assert group_to_keep({0: alive[0], 1: alive[1]}, (0, 1, 2), 5) is None  # no report
    assert group_to_keep({**alive, 1: status("g2")}, (0, 1, 2), 5) is None  # two groups
    # A rerun of iteration 4: the trainers already hold it.
    assert group_to_keep(alive, (0, 1, 2), 4) is None
    assert group_to_keep({**alive, 0: status(through=3)}, (0, 1, 2), 5) is None


def test_a_shrunk_or_regrown_session_starts_a_new_group() -> None:
    three = {r: status() for r in range(3)}
    # Rank 2 was left out: the others' group still counts it as a member.
    assert group_to_keep({0: three[0], 1: three[1]}, (0, 1), 5) is None
    # The group of two, after rank 2 rejoins.
    two = {r: status(members=(0, 1)) for r in (0, 1)}
    assert group_to_keep({**two, 2: None}, (0, 1, 2), 5) is None
    assert group_to_keep(two, (0, 1), 5) == "g1"


def test_a_group_whose_processes_do_not_connect_says_so_while_it_waits(
        tmp_path, monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    """A torchrun whose rendezvous waits for another node's: every CONNECT_PROGRESS_S
    (30 s; 0.2 s here) a line names how many connected, the torchrun's pid and log."""
    import secrets
    import sys
    import time

    import pytest

    from rl import trainer_group
    from rl.trainer_group import TrainerGroup

    monkeypatch.setattr(trainer_group, "CONNECT_PROGRESS_S", 0.2)
    group = TrainerGroup.spawn("g-test", (0,), [sys.executable, "-c", "import time; "
                                                 "time.sleep(60)"],
                               env={}, log_path=tmp_path / "trainer.log", pass_fds=())
    deadline = time.monotonic() + 1.5

    def check() -> None:
        if time.monotonic() > deadline:
            raise TimeoutError("the test's deadline")

    try:
        with caplog.at_level("INFO", logger="rl.trainer_group"), pytest.raises(TimeoutError):
            group.connect(f"test-{secrets.token_hex(4)}", "token", 2, check)
    finally:
        group.proc.stop(grace_s=1, kill_timeout_s=5)
    lines = [r.getMessage() for r in caplog.records if "local process(es) connected" in
             r.getMessage()]
    assert lines and lines[0].startswith("trainer g-test: 0 of 2 local process(es) connected "
                                         "after "), caplog.text
    assert f"torchrun pid {group.proc.pid}, log {tmp_path / 'trainer.log'}" in lines[0]
