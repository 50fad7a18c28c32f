"""An action kind as a third-party package might register one, that does not declare
it runs in a bucket (its actions could write files by other means than fsio): the
scripted actions under another name, with `runs_on_buckets` left False."""

from __future__ import annotations

import dataclasses

from rl import scripted

KIND = dataclasses.replace(scripted.KIND, name="plain", runs_on_buckets=False)
