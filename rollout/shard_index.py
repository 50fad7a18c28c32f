"""The shards a sharded safetensors checkpoint's index names.

`model.safetensors.index.json` maps each tensor to the file holding it
(`weight_map`).  A checkpoint may come from the shared run directory, which
others can write, so a name there opens nothing but a shard beside the index:
never `../..`, an absolute path, a subdirectory, a hidden temporary file, or
anything not `.safetensors` (a FIFO named there would block a read for ever).
The trainer's sharded load (trainer/sharded_load.py) and the hf engine's
(rollout/hf/weights.py) both ask here.
"""

from __future__ import annotations

from pathlib import Path


def shard_file(index: Path, name: object) -> str:
    """`name`, a shard named by the index at `index`, when it is a plain
    `.safetensors` file name beside it; ValueError naming the index otherwise."""
    if not isinstance(name, str) or not name.endswith(".safetensors") or \
            name.startswith(".") or "/" in name or "\\" in name or "\0" in name:
        raise ValueError(f"{index}: weight_map names {name!r}, not a .safetensors file "
                         "beside it")
    return name
