from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny demo model with a manifest, random weights (no warm start: fast)."""
    from trainer.warmstart import build_initial_model as init_model

    out = tmp_path_factory.mktemp("model") / "tiny"
    init_model(out, seed=0, warmstart_steps=0)
    return out


@pytest.fixture(scope="session")
def warm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's model: warm-started, so rewards vary and training moves the weights."""
    from trainer.warmstart import build_initial_model as init_model

    out = tmp_path_factory.mktemp("model") / "warm"
    init_model(out, seed=0, warmstart_steps=65)
    return out
