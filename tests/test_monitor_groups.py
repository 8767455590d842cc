"""The monitor and what torch's wrappers alone would miss: calls on ranks outside a group, and
microddp's own collectives, which talk through send/recv."""

import warnings

import torch

import microddp as mdp
from microddp import monitor


def _outsider(world):
    """Rank 2 is outside group {0, 1} and calls its collectives anyway, as torch allows."""
    warnings.simplefilter("ignore")  # torch warns about each skipped call on rank 2
    g = mdp.comms.new_group([0, 1])
    mon = monitor.enable(timeout=5, debug=True)
    t = torch.full((4,), float(world.rank + 1))
    mdp.comms.all_reduce(t, group=g)
    mdp.comms.all_reduce(t)
    entries = [(e.group == "world", e.seq, e.op) for e in mon.log.recent]
    monitor.disable()
    return entries, t.tolist()


def test_a_rank_outside_the_group_is_neither_logged_nor_waited_for():
    res = mdp.spawn(_outsider, 3, timeout=60)
    for rank in (0, 1):
        assert res[rank][0] == [(False, 1, "all_reduce"), (True, 1, "all_reduce")]
        assert res[rank][1] == [9.0] * 4  # 1+2 = 3 in the group, then 3+3+3
    assert res[2] == ([(True, 1, "all_reduce")], [9.0] * 4)
