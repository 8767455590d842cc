"""Issue 57: two ranks that both receive from each other (a send/recv deadlock) were silent
until gloo's timeout, with no hang report; now the report names the receive on each rank and
the peer each waits for, as it does a stalled collective."""

from __future__ import annotations

import os

import torch

import microddp as mdp
from microddp import monitor
from microddp.monitor.hang import find_report

GROUP_S, MONITOR_S = 4, 2


def _both_receive(rank: int, folder: str) -> list[str]:
    os.chdir(folder)  # the report's Flight Recorder dumps go to ./runs
    mdp.init(timeout=GROUP_S, monitor=False)
    monitor.enable(timeout=MONITOR_S)
    try:
        mdp.comms.recv(torch.zeros(4), src=1 - rank)
    except RuntimeError as e:  # the report (or gloo's words, with the report printed before)
        return find_report(str(e).splitlines()) or [str(e)]
    return ["completed"]


def test_both_ranks_receiving_is_named_by_the_hang_report(tmp_path):
    reports = mdp.spawn(_both_receive, 2, args=(str(tmp_path),), timeout=60, join=False)
    for rank, report in enumerate(reports):
        assert report[0].startswith("microddp hang report: collective recv #1 on rank "), report
        for r in (0, 1):  # each named with the peer it waits for, and the line it is on
            want = (f"  rank {r} is in recv #1 on group p2p (float32[4] src={1 - r}) called "
                    "from _both_receive at test_p2p_deadlock_report.py:")
            assert any(line.startswith(want) for line in report), (rank, report)
