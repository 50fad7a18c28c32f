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
