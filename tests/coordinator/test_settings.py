"""coordinator/config/settings.py: a setting's declaration is its parse, its check and its text."""

from __future__ import annotations

import dataclasses
import enum
import re
from typing import ClassVar

import pytest

from coordinator.config.run_config import CoordinationConfig, RunConfig
from coordinator.config.settings import (
    Section,
    Setting,
    SettingError,
    from_mapping,
    from_text,
    iter_settings,
    setting,
    type_name,
)


class Mode(str, enum.Enum):
    FAST = "fast"
    SLOW = "slow"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sample(Section):
    SECTION: ClassVar[str] = "sample"

    count: int = setting(8, "Samples per prompt.", ge=2)
    fraction: float = setting(0.9, "Share of the GPU.", gt=0, le=1)
    wait_s: float = setting(5.0, "How long to wait.", unit="s", gt=0)
    mode: Mode = setting(Mode.FAST, "How to go.")
    dtype: str = setting("auto", "Computation dtype.", choices=("auto", "bfloat16"))
    pair: tuple[float, float] = setting((0.9, 0.99), "Two betas.", ge=0, lt=1)
    args: tuple[str, ...] = setting((), "Extra arguments.")
    limit: int | None = setting(None, "A limit, or none.", ge=1)


@pytest.mark.parametrize(("raw", "message"), [
    ({"count": 1}, "sample.count=1 is below 2: give a value >= 2 (Samples per prompt), "
                   "e.g. sample.count=8"),
    ({"fraction": 1.5}, "sample.fraction=1.5 is outside (0, 1]: give a value (0, 1] "
                        "(Share of the GPU), e.g. sample.fraction=0.9"),
    ({"wait_s": 0}, "sample.wait_s=0.0 is not positive: give a value > 0 s (How long to wait)"),
    ({"wait_s": float("inf")}, "sample.wait_s=inf is not a finite number"),
    ({"mode": "medium"}, "sample.mode='medium' is not one of: fast, slow"),
    ({"dtype": "fp8"}, "sample.dtype='fp8' is not one of: auto, bfloat16"),
    ({"pair": [0.9, 1.0]}, "sample.pair=(0.9, 1.0) is outside [0, 1)"),
    ({"pair": [0.9]}, "sample.pair=[0.9] must be a list of 2 values"),
    ({"count": True}, "sample.count=True must be an integer"),
    ({"count": 2.5}, "sample.count=2.5 must be an integer"),
    ({"limit": 0}, "sample.limit=0 is below 1"),
])
def test_a_value_outside_its_declaration_is_refused_with_the_value_the_rule_and_the_fix(
        raw, message) -> None:
    with pytest.raises(SettingError, match=re.escape(message)) as caught:
        from_mapping(Sample, raw, "sample")
    assert caught.value.key == f"sample.{next(iter(raw))}"


def test_construction_checks_too_and_coerces_to_the_declared_type() -> None:
    s = Sample(count=3, wait_s=2, mode="slow", pair=[0.5, 0.5], args=["--x"])  # type: ignore[arg-type]
    assert (s.wait_s, s.mode, s.pair, s.args, s.limit) == (2.0, Mode.SLOW, (0.5, 0.5), ("--x",),
                                                           None)
    assert isinstance(s.wait_s, float)
    with pytest.raises(SettingError, match=r"sample\.count=0 is below 2"):
        Sample(count=0)


def test_a_field_without_a_declaration_is_refused_at_its_first_use() -> None:
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Undeclared(Section):
        x: int = 1

    with pytest.raises(TypeError, match=r"Undeclared\.x has no declaration"):
        Undeclared()


def test_a_declaration_needs_one_line_of_help_and_a_dashed_flag() -> None:
    with pytest.raises(TypeError, match="one non-empty line"):
        Setting(help="")
    with pytest.raises(TypeError, match="--name"):
        Setting(help="x", flag="iterations")


@pytest.mark.parametrize(("key", "text", "value"), [
    ("count", "3", 3), ("fraction", "0.5", 0.5), ("mode", "slow", "slow"),
    ("dtype", "123", "123"), ("dtype", '"auto"', "auto"), ("args", "--a,--b", ["--a", "--b"]),
    ("args", '["--a,b"]', ["--a,b"]), ("limit", "none", None), ("limit", "4", 4),
])
def test_set_text_is_read_as_the_declared_type(key, text, value) -> None:
    hint = {k.split(".")[1]: h for k, _, h, _ in iter_settings(Sample, "sample")}[key]
    assert from_text(text, hint, f"sample.{key}") == value


def test_set_text_of_the_wrong_type_names_the_type_and_an_example() -> None:
    with pytest.raises(SettingError, match=re.escape(
            "--set sample.count=eight: sample.count is int; give e.g. sample.count=8")):
        from_text("eight", int, "sample.count")
    with pytest.raises(SettingError, match="is bool"):
        from_text("maybe", bool, "coordination.wakeups")


def test_type_names_are_what_the_docs_show() -> None:
    hints = {k.split(".")[1]: h for k, _, h, _ in iter_settings(Sample, "sample")}
    assert [type_name(hints[k]) for k in ("count", "mode", "pair", "args", "limit")] == [
        "int", "'fast' | 'slow'", "[float, float]", "list of str", "int or none"]


def test_coordination_and_run_are_declared_with_nested_timeouts() -> None:
    keys = [k for k, *_ in iter_settings(CoordinationConfig, "coordination")]
    assert "coordination.phase_timeouts_s.train" in keys and "coordination.lease_s" in keys
    with pytest.raises(SettingError, match=re.escape(
            "coordination.phase_timeouts_s.train=-1.0 is not positive")):
        RunConfig.from_dict({"coordination": {"phase_timeouts_s": {"train": -1}}})
