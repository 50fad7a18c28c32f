"""The training run's error, shared by the modules `python -m trainer.train` uses.

Its own module so that distributed setup, model loading and the update loop
can all raise it without importing one another.
"""

from __future__ import annotations

from trainer.config import TrainerError


class TrainError(TrainerError):
    """Training could not complete; the message names the phase and the cause."""
