"""Issue 57: `comms.new_group` called on one rank only. torch's new_group waited inside gloo's
connection set-up on the store's own timeout (minutes), then failed in words about store
keys; now the ranks that called it get one MicroDDPError naming the rank that did not, within
the new group's timeout."""

from __future__ import annotations

import time

import torch

import microddp as mdp
from errors_helpers import message


def _one_rank_only(world) -> str:
    if world.rank == 0:
        said = message(lambda: mdp.comms.new_group([0, 1], timeout=3))
    else:
        time.sleep(10)  # never calls it
        said = "did not call"
    return said


def _every_rank(world) -> float:
    group = mdp.comms.new_group([0, 1], timeout=20)
    x = torch.ones(2)
    mdp.comms.all_reduce(x, group=group)
    return x[0].item()


def test_new_group_on_one_rank_names_the_missing_rank():
    said = mdp.spawn(_one_rank_only, 2, timeout=60)[0]
    assert said.startswith("new_group #1: rank 1 did not call new_group within 3 s; every "
                           "rank must call new_group"), said


def test_new_group_on_every_rank_still_works():
    assert mdp.spawn(_every_rank, 2, timeout=60) == [2.0, 2.0]
