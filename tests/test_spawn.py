"""microddp.launch.spawn: results by rank, a failing rank's traceback, the deadline, no survivors."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

import microddp as mdp


def _matmul(world):
    a = torch.ones(256, 256)
    return float((a @ a)[0, 0]), torch.get_num_threads()


def test_one_rank_after_the_parent_used_threads_does_not_deadlock():
    """GNU OpenMP hangs a forked child whose parent already ran a parallel region; spawn must
    pick a start method that cannot (threads per rank > 1 here on a multi-core machine)."""
    a = torch.randn(512, 512)
    a @ a
    [(value, threads)] = mdp.spawn(_matmul, 1, timeout=60)
    assert value == 256.0
    # A user's OMP_NUM_THREADS is kept (as torchrun does); else a lone rank takes every core.
    assert threads == int(os.environ.get("OMP_NUM_THREADS", max(1, os.cpu_count() or 1)))


def _fail_on_rank_one(world):
    if world.rank == 1:
        raise ValueError("rank one is unhappy")
    return world.rank


def test_a_failing_rank_raises_with_its_traceback():
    with pytest.raises(mdp.MicroDDPError, match="rank 1 failed: ValueError: rank one is unhappy"):
        mdp.spawn(_fail_on_rank_one, 2, timeout=60)


def _stuck(world):
    if world.rank == 0:
        mdp.comms.barrier()  # rank 1 never arrives
    time.sleep(600)


def test_the_deadline_names_the_stuck_rank_and_kills_it():
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(mdp.MicroDDPError, match=r"ranks \[0, 1\] did not finish within 5 s"):
        mdp.spawn(_stuck, 2, timeout=5)
    after = {p.pid for p in psutil.Process().children(recursive=True)
             if p.status() != psutil.STATUS_ZOMBIE}
    assert after - before == set()


def _speak(world):
    # One write per line: two ranks share the descriptor, and print() may split a line in two.
    os.write(1, f"out from rank {world.rank}\n".encode())
    os.write(2, f"err from rank {world.rank}\n".encode())


@pytest.mark.parametrize("method", [None, "spawn"])
def test_ranks_print_to_the_callers_stdout_and_stderr(capfd, method):
    """A forkserver started during an earlier test must not send ranks' output elsewhere."""
    mdp.spawn(_speak, 2, timeout=60, start_method=method)
    out, err = capfd.readouterr()
    # Only our lines: gloo or an earlier test may leave other output on the same descriptors.
    assert sorted(line for line in out.splitlines() if "from rank" in line) == [
        "out from rank 0", "out from rank 1"]
    assert sorted(line for line in err.splitlines() if "from rank" in line) == [
        "err from rank 0", "err from rank 1"]


def test_spawn_at_a_scripts_top_level_says_to_guard_it(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text("import microddp as mdp\n\n\ndef hello(world):\n    return world.rank\n\n\n"
                      "print(mdp.spawn(hello, 2, timeout=30))\n")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=90)
    assert run.returncode != 0
    assert 'put the call under `if __name__ == "__main__":`' in run.stderr
    assert "any error it printed is above" in run.stderr


CALLER = """
import os, sys, time
import microddp as mdp


def nap(rank, folder):
    # Written aside, then renamed: a reader never sees the file before its pid is in it.
    path = os.path.join(folder, f"rank{rank}")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)
    time.sleep(600)


if __name__ == "__main__":
    method = None if sys.argv[2] == "default" else sys.argv[2]
    mdp.spawn(nap, 2, args=(sys.argv[1],), join=False, timeout=600, start_method=method)
"""


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# "spawn" starts every rank as a fresh interpreter importing torch: the slowest way to prove the
# same lifeline, for CI's slow run.
@pytest.mark.parametrize("method", [None, pytest.param("spawn", marks=pytest.mark.slow), "fork"])
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_ranks_die_with_a_killed_caller(tmp_path, sig, method):
    """No rank outlives its caller, even one killed with SIGKILL; nor does the forkserver."""
    script = tmp_path / "caller.py"
    script.write_text(CALLER)
    caller = subprocess.Popen([sys.executable, str(script), str(tmp_path), method or "default"])
    family: list[int] = []
    try:
        deadline = time.monotonic() + 120  # two ranks start in seconds, unless the machine is busy
        while len(list(tmp_path.glob("rank?"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        ranks = [int(p.read_text()) for p in tmp_path.glob("rank?")]
        assert len(ranks) == 2
        family = [p.pid for p in psutil.Process(caller.pid).children(recursive=True)]
        assert set(ranks) <= set(family)
        caller.send_signal(sig)
        assert caller.wait(timeout=30) == -sig
        deadline = time.monotonic() + 30
        while any(_running(p) for p in family) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [p for p in family if _running(p)] == [], "outlived a killed caller"
    finally:
        if caller.poll() is None:
            caller.kill()
            caller.wait()
        for pid in family:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow  # a launcher whose every worker runs a whole job
def test_spawn_under_a_launcher_warns_that_every_worker_runs_the_whole_job(tmp_path):
    script = tmp_path / "selfspawning.py"
    script.write_text("import microddp as mdp\n\n\ndef f(world):\n    return world.rank\n\n\n"
                      "if __name__ == '__main__':\n    print(mdp.spawn(f, 2), mdp.spawn(f, 2))\n")
    out = subprocess.run([sys.executable, "-m", "microddp", "run", "-n", "2", str(script)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    warning = ("microddp.launch.spawn: warning: this process is already rank {k} of 2 started by a "
               "launcher, and starts 2 ranks of its own, so every launched rank runs the whole "
               "job; run a script that starts its own ranks (every course script does) with "
               "plain `python script.py`")
    for k in (0, 1):  # once per worker, however many times it calls spawn
        assert (out.stdout + out.stderr).count(f"[rank {k}] " + warning.format(k=k)) == 1, out.stdout
    alone = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                           timeout=120)
    assert alone.returncode == 0 and "warning" not in alone.stderr, alone.stderr


# The import sits under the guard: a rank re-imports the script's top level, which would
# import torch._dynamo in the rank itself whatever the server preloaded.
PRELOADED = """
import sys
from microddp.launch import spawn

def has_dynamo(world):
    return "torch._dynamo" in sys.modules

if __name__ == "__main__":
    {imports}
    print(spawn(has_dynamo, 2, timeout=120))
"""


@pytest.mark.parametrize("imports, expected", [("pass", "[False, False]"),
                                               ("import torch._dynamo", "[True, True]")])
def test_ranks_start_with_torch_dynamo_only_when_the_caller_has_it(tmp_path, imports, expected):
    # a fresh interpreter each: this process's forkserver already runs with what conftest loaded
    script = tmp_path / "preload.py"
    script.write_text(PRELOADED.format(imports=imports))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == expected
