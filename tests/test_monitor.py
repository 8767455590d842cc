"""Hang and desync reports: real ranks, a skipped collective, a shape mismatch."""

import re
import time

import pytest
import torch
import torch.distributed as dist

import microddp as mdp
from microddp import monitor
from microddp.monitor.log import where

STALL_S = 2.0


def save_checkpoint(seconds: float) -> None:
    time.sleep(seconds)  # LINE-SLEEP: the line rank 1 is on when rank 0 gives up


def _skip_one(world, debug):
    monitor.enable(timeout=STALL_S, debug=debug)
    t = torch.ones(4)
    dist.all_reduce(t)  # first collective: every rank takes part
    assert torch.equal(t, torch.full((4,), 2.0))
    if world.rank == 1:
        save_checkpoint(30)  # rank 1 skips the next collective
        return None
    t0 = time.monotonic()
    try:
        mdp.comms.all_reduce(t)  # LINE-STUCK
    except mdp.MicroDDPError as e:
        return str(e), time.monotonic() - t0
    return None


def _line(marker: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if f"# {marker}" in line)


@pytest.mark.parametrize("debug", [False, True])
def test_skipped_collective_names_rank_and_line(debug):
    with pytest.raises(mdp.MicroDDPError) as info:
        mdp.spawn(_fail_on_report, 2, args=(debug,), timeout=60)
    text = str(info.value)
    assert "rank 0 failed" in text
    stuck = f"rank 0 is in all_reduce #2 (float32[4] sum) called from _skip_one at test_monitor.py:{_line('LINE-STUCK')}"
    assert stuck in text
    sleeping = f"rank 1 is in save_checkpoint at test_monitor.py:{_line('LINE-SLEEP')}"
    assert sleeping in text and "last collective all_reduce #1" in text
    took = float(re.search(r"gave up after ([0-9.]+) s", text).group(1))
    assert took < STALL_S + 6  # the report came from the monitor, not the 60 s process timeout


def _fail_on_report(world, debug):
    out = _skip_one(world, debug)
    if out is not None:
        text, took = out
        raise RuntimeError(f"{text}\ngave up after {took:.1f} s")


def _mismatch(world):
    monitor.enable(timeout=STALL_S, debug=True)
    t = torch.ones(3 + world.rank)  # rank 1 sends a longer tensor
    try:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)  # LINE-MISMATCH
    except mdp.MicroDDPError as e:
        return str(e)
    return "no error"


def test_shape_mismatch_reported_on_every_rank():
    texts = mdp.spawn(_mismatch, 2, timeout=60)
    line = _line("LINE-MISMATCH")
    for text in texts:
        assert "collective #1 differs across ranks" in text
        assert f"rank 0: all_reduce (float32[3] sum) called from _mismatch at test_monitor.py:{line}" in text
        assert f"rank 1: all_reduce (float32[4] sum) called from _mismatch at test_monitor.py:{line}" in text


def _logged(world):
    mon = monitor.enable(timeout=30, debug=True)
    t = torch.arange(6.0).reshape(2, 3) * (world.rank + 1)
    ref = t.clone()
    mdp.comms.all_reduce(t, op="max")
    out = [torch.empty(2, 3) for _ in range(world.world_size)]
    dist.all_gather(out, t)
    h = mdp.comms.broadcast(t, src=1, async_op=True)
    h.wait()
    entries = [(e.seq, e.op, e.shape, e.detail, e.done is not None) for e in mon.log.recent]
    monitor.disable()
    assert dist.all_reduce.__name__ == "all_reduce" and not hasattr(dist.all_reduce,
                                                                     "__microddp_original__")
    return entries, t, ref


def test_log_records_collectives_and_results_match_torch():
    res = mdp.spawn(_logged, 2, timeout=60)
    for entries, t, _ in res:
        assert entries == [(1, "all_reduce", "float32[2,3]", "max", True),
                           (2, "all_gather", "float32[2,3]", "", True),
                           (3, "broadcast", "float32[2,3]", "src=1", True)]
        # wrapped collectives compute exactly what torch's own do
        assert torch.equal(t, torch.maximum(res[0][2], res[1][2]))


def test_where_names_this_line():
    import sys
    here = where(sys._getframe())  # LINE-WHERE
    assert here == f"test_where_names_this_line at test_monitor.py:{_line('LINE-WHERE')}"


def test_enable_in_a_world_of_one_is_a_no_op():
    assert monitor.enable(timeout=1) is None
    assert monitor.active() is None


def test_bad_settings_are_named():
    with pytest.raises(mdp.MicroDDPError, match="monitor timeout must be positive"):
        monitor._seconds(0)
    with pytest.raises(mdp.MicroDDPError, match="at least 1 step, got 0"):
        monitor.DriftCheck(torch.nn.Linear(1, 1), every=0)


def _leave_early(world):
    monitor.enable(timeout=STALL_S)
    t = torch.ones(2)
    mdp.comms.all_reduce(t)
    if world.rank == 1:
        return "left"  # rank 1 exits: nobody is left on its side to answer
    mdp.comms.all_reduce(t)  # LINE-ALONE


def test_rank_that_exited_is_named_as_silent():
    with pytest.raises(mdp.MicroDDPError) as info:
        mdp.spawn(_leave_early, 2, timeout=60)
    text = str(info.value)
    assert (f"rank 0 is in all_reduce #2 (float32[2] sum) called from _leave_early at "
            f"test_monitor.py:{_line('LINE-ALONE')}") in text
    assert "rank 1 did not answer (exited, crashed, or frozen outside Python)" in text


def _ddp_hang(world):
    from microddp.model import FullMLP

    monitor.enable(timeout=STALL_S)
    torch.manual_seed(0)
    model = mdp.DDP(FullMLP(16, 2))
    for step in range(3):
        if step == 2 and world.rank == 1:
            save_checkpoint(30)  # rank 1 never runs this step's backward
        model(torch.randn(4, 16)).sum().backward()  # LINE-BACKWARD


def test_hang_inside_ddp_backward_names_the_users_line():
    with pytest.raises(mdp.MicroDDPError) as info:
        mdp.spawn(_ddp_hang, 2, timeout=60)
    text = str(info.value)
    assert re.search(r"rank 0 is in all_reduce #\d+ \(float32\[\d+\] sum\) called from \w+ at "
                     r"\w+\.py:\d+, under _ddp_hang at test_monitor\.py:"
                     + str(_line("LINE-BACKWARD")) + "\n", text), text
    assert f"rank 1 is in save_checkpoint at test_monitor.py:{_line('LINE-SLEEP')}" in text


def _future_hang(world):
    from microddp.dp.comm_hooks import sum_future

    monitor.enable(timeout=STALL_S)
    t = torch.ones(3)
    sum_future(t).wait()
    if world.rank == 1:
        save_checkpoint(30)
    sum_future(t).wait()  # LINE-FUTURE: a wait on a future, which Python cannot interrupt


def test_stall_python_cannot_interrupt_is_reported_then_ended(capfd):
    # The watchdog thread reports, then ends the stuck rank (as PyTorch's NCCL watchdog does)
    # instead of leaving it for the 60 s process-group timeout.
    with pytest.raises(mdp.MicroDDPError, match=r"rank 0 died \(exit code 1\)"):
        mdp.spawn(_future_hang, 2, timeout=60)
    err = capfd.readouterr().err
    assert ("[rank 0] microddp hang report: collective all_reduce #2 on rank 0 did not "
            "complete within 2 s\n  rank 0 is in all_reduce #2 (float32[3] sum) called from "
            "sum_future at comm_hooks.py") in err
    assert f"under _future_hang at test_monitor.py:{_line('LINE-FUTURE')}" in err
    assert f"rank 1 is in save_checkpoint at test_monitor.py:{_line('LINE-SLEEP')}" in err
    assert "ending this process (exit code 1) after the hang report" in err


def test_the_head_says_which_timeout_ran_out():
    """The monitor's own threshold: "did not complete within"; the backend's (a failed wait,
    with or without the call still known): "timed out" in its words; anything else: failed."""
    from microddp.monitor.hang import format_report
    from microddp.monitor.log import Entry

    call = Entry(4, "world", "all_reduce")
    statuses = {0: {"in": "all_reduce #4", "where": "", "last": ""}}
    gloo = "[/src/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv"
    heads = [format_report(0, stalled, statuses, 2, timeout, why).splitlines()[0]
             for stalled, timeout, why in [(call, 8.0, ""), (call, None, gloo), (None, None, gloo),
                                           (call, None, "Connection closed by peer")]]
    assert heads == [
        "microddp hang report: collective all_reduce #4 on rank 0 did not complete within 8 s",
        "microddp hang report: collective all_reduce #4 on rank 0 timed out (Timed out waiting "
        "5000ms for recv)",
        "microddp hang report: a collective on rank 0 timed out (Timed out waiting 5000ms for "
        "recv)",
        "microddp hang report: collective all_reduce #4 on rank 0 failed (Connection closed by "
        "peer)"]



def _hang_error_type(world):
    import time

    monitor.enable(timeout=STALL_S)
    t = torch.ones(2)
    mdp.comms.all_reduce(t)
    if world.rank == 1:
        time.sleep(3 * STALL_S)
    try:
        mdp.comms.all_reduce(t)
    except mdp.MicroDDPError as e:
        return type(e).__name__, e.exit_code
    return None


def test_a_hang_report_is_a_peer_error_that_a_launcher_restarts():
    """A hang report exited 2, the usage-error code, so `--max-restarts` refused to restart a
    frozen rank's job: it is a PeerError (exit code 1) now, still a MicroDDPError."""
    from microddp.errors import PeerError

    assert issubclass(PeerError, mdp.MicroDDPError) and PeerError.exit_code == 1
    assert mdp.MicroDDPError.exit_code == 2
    results = mdp.spawn(_hang_error_type, 2, timeout=60)
    assert results[0] == ("PeerError", 1), results
    assert results[1] in (("PeerError", 1), None), results  # rank 0 may be gone, or answer
