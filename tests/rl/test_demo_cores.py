"""The demo's simulated nodes share this machine's cores instead of each taking all."""

from __future__ import annotations

import os

import pytest

from rl.demo import core_shares, node_environments


@pytest.mark.parametrize("nodes", [1, 2, 3, 8])
def test_each_hf_node_runs_as_many_threads_as_its_share_of_the_cores(nodes: int) -> None:
    cores = sorted(os.sched_getaffinity(0))
    shares = core_shares(nodes)
    envs = node_environments("hf", vllm="", nodes=nodes)
    assert len(envs) == len(shares) == nodes
    assert [env["OMP_NUM_THREADS"] for env in envs] == [str(len(s)) for s in shares]
    assert all(share and set(share) <= set(cores) for share in shares)
    # As many threads in all as cores, or, with more nodes than cores, one per node.
    assert sum(len(s) for s in shares) == max(len(cores), nodes)
    if nodes <= len(cores):  # disjoint shares that cover the cores
        assert sorted(c for s in shares for c in s) == cores
