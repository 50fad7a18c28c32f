from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from coordinator.errors import MalformedRecordError
from rollout.tensor_files import load_tensors


class Planted:
    """Unpickling this creates the marker file: code run by torch.load."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (self.marker, "w"))


def test_plain_tensors_load_and_the_file_named_is_not_read(tmp_path: Path) -> None:
    buffer = io.BytesIO()
    torch.save({"x": torch.arange(3), "names": ["a"]}, buffer)
    buffer.seek(0)
    loaded = load_tensors(tmp_path / "never-opened.pt", buffer, mmap=False)
    assert loaded["x"].tolist() == [0, 1, 2] and loaded["names"] == ["a"]


def test_code_and_garbage_are_refused_naming_the_file(tmp_path: Path) -> None:
    marker, path = tmp_path / "code-ran", tmp_path / "chunk-000000.pt"
    torch.save({"x": Planted(marker)}, path)
    with pytest.raises(MalformedRecordError) as info:
        load_tensors(path, str(path), mmap=True)
    assert not marker.exists()
    assert info.value.path == path
    assert str(info.value).startswith(
        f"{path}: was refused by torch.load(weights_only=True): UnpicklingError: ")
    with pytest.raises(MalformedRecordError, match=r"^\S*chunk-000000\.pt: was refused by torch"):
        load_tensors(path, io.BytesIO(b"not a torch file"), mmap=False)
