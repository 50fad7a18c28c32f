"""Node-local directories private to this user (coordinator/storage/private_dir.py): made 0700,
this user's, never through a symlink; anything else found in their place is refused
by name, and emptying one never follows a symlink."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.storage import private_dir
from coordinator.storage.private_dir import Defect, PrivateDir, PrivateDirError

UID = os.getuid()


def lstat_like(mode: int, uid: int = UID) -> os.stat_result:
    return os.stat_result((mode, 1, 1, 1, uid, 0, 0, 0, 0, 0))


@pytest.mark.parametrize(("mode", "uid", "expected"), [
    (stat.S_IFDIR | 0o700, UID, None),
    (stat.S_IFDIR | 0o755, UID, Defect.OPEN_MODE),
    (stat.S_IFDIR | 0o1777, UID, Defect.OPEN_MODE),
    (stat.S_IFDIR | 0o700, UID + 1, Defect.FOREIGN_OWNER),
    (stat.S_IFLNK | 0o777, UID, Defect.SYMLINK),
    (stat.S_IFREG | 0o700, UID, Defect.NOT_DIRECTORY),
])
def test_the_verdict_accepts_only_a_directory_of_this_user_with_mode_0700(
        mode: int, uid: int, expected: Defect | None) -> None:
    assert private_dir.defect(lstat_like(mode, uid), UID) is expected


@pytest.fixture
def umask_open() -> Iterator[None]:
    old = os.umask(0o777)  # takes every bit: the mode must still come out 0700
    try:
        yield
    finally:
        os.umask(old)


def test_every_component_is_made_0700_whatever_the_umask(tmp_path: Path,
                                                         umask_open: None) -> None:
    place = PrivateDir(tmp_path, ("coordinator-bucket-0", "digest"))
    assert private_dir.make(place) == tmp_path / "coordinator-bucket-0" / "digest"
    for path in (tmp_path / "coordinator-bucket-0", place.path):
        st = path.lstat()
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
        assert st.st_uid == UID
    assert private_dir.make(place) == place.path  # there already: accepted as it is


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A directory of this user's that a planted symlink points at."""
    path = tmp_path / "victim"
    path.mkdir()
    (path / "thesis.tex").write_text("years of work")
    return path


def test_a_symlink_a_foreign_or_an_open_directory_is_refused_naming_it(
        tmp_path: Path, victim: Path) -> None:
    base = tmp_path / "coordinator-bucket-0"
    place = PrivateDir(tmp_path, (base.name, "digest"))
    # A symlink where the base belongs, then where the digest belongs.
    base.symlink_to(victim)
    with pytest.raises(PrivateDirError, match=rf"^{base} is a symlink: .*remove it, or point "
                       r"TMPDIR \(or checkpoint.local_cache\) elsewhere"):
        private_dir.make(place)
    base.unlink()
    base.mkdir(mode=0o700)
    place.path.symlink_to(victim)
    with pytest.raises(PrivateDirError, match=rf"^{place.path} is a symlink"):
        private_dir.make(place)
    place.path.unlink()
    # Another user's directory, and one of ours that others may enter.
    base.chmod(0o777)
    with pytest.raises(PrivateDirError, match=rf"^{base} has mode 0777, not 0700: .*if it is "
                       rf"yours, `chmod 700 {base}`; otherwise remove it"):
        private_dir.make(place)
    base.chmod(0o700)
    os.chown(base, 12345, 12345)
    with pytest.raises(PrivateDirError, match=rf"^{base} belongs to uid 12345, not to this "
                       rf"user \({UID}\)") as caught:
        private_dir.make(place)
    assert caught.value.path == base and caught.value.defect is Defect.FOREIGN_OWNER
    assert caught.value.exit_code == 2
    assert sorted(p.name for p in victim.iterdir()) == ["thesis.tex"]


def test_a_missing_parent_is_named_when_only_the_last_component_may_be_made(
        tmp_path: Path) -> None:
    place = PrivateDir(tmp_path, ("coordinator-0", "run", ".locks"))
    with pytest.raises(FileNotFoundError, match="coordinator-0"):
        private_dir.make(place, parents=False)
    private_dir.make(place.parent)  # type: ignore[arg-type]
    assert private_dir.make(place, parents=False).is_dir()


def test_emptying_removes_a_symlink_inside_never_its_target(tmp_path: Path,
                                                            victim: Path) -> None:
    place = PrivateDir(tmp_path, ("coordinator-0", "run"))
    root = private_dir.make(place)
    (root / "link").symlink_to(victim)
    (root / "sub").mkdir()
    (root / "sub" / "deep").symlink_to(victim / "thesis.tex")
    with private_dir.opened(place, create=False) as fd:
        private_dir.empty(fd)
    assert list(root.iterdir()) == []
    assert (victim / "thesis.tex").read_text() == "years of work"
    assert private_dir.remove(place) and not root.parent.exists()
