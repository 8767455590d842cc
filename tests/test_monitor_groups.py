"""The monitor and what torch's wrappers alone would miss: calls on ranks outside a group, and
microddp's own collectives, which talk through send/recv."""

import warnings

import pytest
import torch

import microddp as mdp
from microddp import collectives as C
from microddp import monitor
from microddp.collectives.ring import ring

STALL_S = 2.0


def _outsider(world):
    """Rank 2 is outside group {0, 1} and calls its collectives anyway, as torch allows."""
    warnings.simplefilter("ignore")  # torch warns about each skipped call on rank 2
    g = mdp.comms.new_group([0, 1])
    mon = monitor.enable(timeout=5, debug=True)
    t = torch.full((4,), float(world.rank + 1))
    mdp.comms.all_reduce(t, group=g)
    C.ring_all_reduce(t, group=g)
    mdp.comms.all_reduce(t)
    entries = [(e.group == "world", e.seq, e.op) for e in mon.log.recent]
    monitor.disable()
    return entries, t.tolist()


def test_a_rank_outside_the_group_is_neither_logged_nor_waited_for():
    res = mdp.spawn(_outsider, 3, timeout=60)
    for rank in (0, 1):
        assert res[rank][0] == [(False, 1, "all_reduce"), (False, 2, "ring_all_reduce"),
                                (True, 1, "all_reduce")]
        assert res[rank][1] == [15.0] * 4  # 1+2 = 3, doubled in the group, then 6+6+3
    assert res[2] == ([(True, 1, "all_reduce")], [15.0] * 4)


def _ours_logged(world):
    mon = monitor.enable(timeout=30)
    t = torch.full((3,), float(world.rank + 1))
    C.ring_all_reduce(t, op="avg")
    C.tree_broadcast(t, src=1)
    out = [torch.empty(3) for _ in range(world.world_size)]
    C.ring_all_gather(out, t)
    C.ring_reduce_scatter(t, out)
    entries = [(e.seq, e.op, e.shape, e.detail, e.done is not None) for e in mon.log.recent]
    monitor.disable()
    restored = [not hasattr(f, "__microddp_original__")
                for f in (C.ring_all_reduce, ring.ring_all_reduce, C.scatter)]
    return entries, t.tolist(), restored


def test_microddps_collectives_are_logged_and_restored():
    for entries, t, restored in mdp.spawn(_ours_logged, 2, timeout=60):
        assert entries == [(1, "ring_all_reduce", "float32[3]", "avg", True),
                           (2, "tree_broadcast", "float32[3]", "src=1", True),
                           (3, "ring_all_gather", "float32[3]", "", True),
                           (4, "ring_reduce_scatter", "float32[3]", "sum", True)]
        assert t == [3.0] * 3 and restored == [True, True, True]


def _mixed(world, debug):
    monitor.enable(timeout=STALL_S, debug=debug, answer_timeout=1)
    t = torch.ones(8)
    # check=False: with it, the collectives' own agreement would see the different calls and
    # raise at once; without it they wait for messages that never come, a real hang.
    try:
        if world.rank == 0:
            C.naive_all_reduce(t, check=False)  # LINE-NAIVE
        else:
            C.tree_all_reduce(t, check=False)  # LINE-TREE
    except mdp.MicroDDPError as e:
        return str(e)
    return "no error"


def _line(marker: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if f"# {marker}" in line)


def test_ranks_in_different_algorithms_get_a_hang_report(capfd):
    # Their waits are on the process group's (60 s) timeout: the watchdog reports the stall,
    # then ends the ranks.
    with pytest.raises(mdp.MicroDDPError, match=r"rank \d died \(exit code 1\)"):
        mdp.spawn(_mixed, 2, args=(False,), timeout=60)
    err = capfd.readouterr().err
    assert ("microddp hang report: collective naive_all_reduce #1 on rank 0 did not complete "
            "within 2 s") in err or "collective tree_all_reduce #1 on rank 1" in err
    assert (f"rank 0 is in naive_all_reduce #1 (float32[8] sum) called from _mixed at "
            f"test_monitor_groups.py:{_line('LINE-NAIVE')}") in err
    assert (f"rank 1 is in tree_all_reduce #1 (float32[8] sum) called from _mixed at "
            f"test_monitor_groups.py:{_line('LINE-TREE')}") in err


def test_debug_mode_names_the_two_algorithms_before_they_run():
    for text in mdp.spawn(_mixed, 2, args=(True,), timeout=60):
        assert "collective #1 differs across ranks" in text
        assert (f"rank 0: naive_all_reduce (float32[8] sum) called from _mixed at "
                f"test_monitor_groups.py:{_line('LINE-NAIVE')}") in text
        assert (f"rank 1: tree_all_reduce (float32[8] sum) called from _mixed at "
                f"test_monitor_groups.py:{_line('LINE-TREE')}") in text
