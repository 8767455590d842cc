"""`microddp status RUN` on a planted hang: each rank's step, open collective, and who is waited for."""

import subprocess
import sys
import time

import torch
import torch.distributed as dist

from microddp import monitor
from microddp.commands import status as view
from microddp.monitor import live


def save_checkpoint(folder):
    """Rank 1 is late: it looks at the job from outside while rank 0 waits in all_reduce #2."""
    end = time.monotonic() + 30
    while time.monotonic() < end:
        st = view.read(folder).get(0)
        if st and st["in"] and st["in"]["seq"] == 2 and time.time() - st["in"]["since"] > 1.5:
            break
        time.sleep(0.1)
    out = subprocess.run([sys.executable, "-m", "microddp", "status", folder],
                         capture_output=True, text=True, timeout=60)
    return out.stdout + out.stderr


def _planted(world, folder):
    monitor.set_run_dir(folder)
    monitor.enable(timeout=20)  # far beyond the planted wait: no hang report
    t = torch.ones(4)
    monitor.set_step(1)
    dist.all_reduce(t)
    monitor.set_step(2)
    seen = save_checkpoint(folder) if world.rank == 1 else None
    dist.all_reduce(t)  # rank 0 waits here for rank 1
    return seen, t


def test_status_names_the_rank_the_others_wait_for(tmp_path):
    import microddp as mdp

    res = mdp.spawn(_planted, 2, args=(str(tmp_path),), timeout=90)
    assert torch.equal(res[0][1], torch.full((4,), 4.0))  # the job went on afterwards
    text = res[1][0]
    lines = text.splitlines()
    assert lines[0].startswith(f"microddp status {tmp_path}: 2 ranks")
    row0 = next(line for line in lines if line.startswith("0 "))
    row1 = next(line for line in lines if line.startswith("1 "))
    assert row0.split()[1:4] == ["2", "all_reduce", "#2"]
    took = float(row0.split()[4])
    assert took >= 1.0, text
    assert "all_reduce #1" in row0 and "_planted at test_monitor_status.py" in row0
    assert row1.split()[1:3] == ["2", "-"]
    assert "save_checkpoint at test_monitor_status.py" in row1
    assert "waited for: rank 1: not in all_reduce #2, where rank 0 waits" in lines
    assert not any(line.startswith("waited for: rank 0") for line in lines)


def _st(rank, step, seq=None, since=None, written=100.0):
    return {"rank": rank, "world_size": 3, "step": step, "time": written, "where": "f at x.py:1",
            "in": None if seq is None else {"op": "all_reduce", "seq": seq, "group": "world",
                                             "since": since},
            "last": {"op": "all_reduce", "seq": 1, "group": "world", "ms": 0.5}}


def test_waited_for_rules():
    assert view.FOLDER == live.FOLDER
    now = 100.0
    # everyone in the same collective, briefly or long: nobody is singled out
    same = {r: _st(r, 3, 2, 95.0) for r in range(3)}
    assert view.waited_for(same, now) == {}
    # rank 2 is one collective behind: it is the one waited for
    behind = {0: _st(0, 3, 2, 95.0), 1: _st(1, 3, 2, 96.0), 2: _st(2, 2, 1, 99.8)}
    assert view.waited_for(behind, now) == {2: "not in all_reduce #2, where rank 0 waits"}
    # a file not rewritten for a while: that rank's watchdog is gone
    stale = {0: _st(0, 3), 1: _st(1, 3, written=80.0)}
    assert view.waited_for(stale, now) == {1: "no news for 20 s (exited, frozen or killed)"}
    text = view.render("RUN", {0: _st(0, 3, 2, 95.0), 1: _st(1, 3, 2, 99.5)}, now)
    assert text.splitlines()[-1] == "waited for: rank 2: no status file (not started, or no monitor)"
