"""A frozen process in an async job (SIGSTOP: alive, silent, never exits), end to end through
`microddp train`: a frozen parameter server is detected by its workers within the timeout and
the launcher stops every rank, exit non-zero, one line naming the server; a frozen worker at
staleness 0 is dropped by the server (the healthy worker does not conclude the server is gone),
the run finishes, and the launcher stops the frozen rank."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from launch_helpers import rank_pid

SMALL = ["--hidden", "32", "--depth", "1", "--batch-size", "48", "--seed", "3", "--no-plot"]
DEADLINE_S = 180
TIMEOUT_S = 3  # --monitor-timeout: the server drops a worker silent this long


def _freeze(args, out, rank, after_s):
    """Run `microddp train ARGS`, SIGSTOP `rank` `after_s` seconds after training started;
    (exit code, output, seconds from the freeze to the end, every rank's pid)."""
    job = subprocess.Popen([sys.executable, "-m", "microddp", "train", *args],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pids = []
    try:
        deadline, frozen_at = time.monotonic() + DEADLINE_S, None
        launcher = psutil.Process(job.pid)
        while time.monotonic() < deadline and job.poll() is None and frozen_at is None:
            pids = [rank_pid(launcher, r) for r in range(3)]
            if all(pids) and (out / "metrics.jsonl").exists():  # the job's first lines
                time.sleep(after_s)
                os.kill(pids[rank], signal.SIGSTOP)
                frozen_at = time.monotonic()
            time.sleep(0.05)
        log, _ = job.communicate(timeout=DEADLINE_S)
        took = time.monotonic() - frozen_at
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
        for pid in pids:
            if pid and psutil.pid_exists(pid):
                os.kill(pid, signal.SIGKILL)
    return job.returncode, log, took, pids


@pytest.mark.slow  # a whole job and a frozen server
def test_a_frozen_server_stops_the_job_with_one_line_and_exit_non_zero(tmp_path):
    code, log, took, pids = _freeze(
        ["--strategy", "async", "--nproc", "3", *SMALL, "--epochs", "50", "--monitor-timeout",
         str(TIMEOUT_S), "--out", str(tmp_path / "run")], tmp_path / "run", rank=0, after_s=2)
    assert code != 0, log
    assert "the parameter server (rank 0) is gone while waiting for parameters" in log
    assert "microddp run: rank 1 failed (exit code 75)" in log or \
        "microddp run: rank 2 failed (exit code 75)" in log, log
    assert not any(pid and psutil.pid_exists(pid) and
                   psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids)
    # the workers wait 2T + 5 s for parameters; the rest is the launcher stopping the job
    assert took < DEADLINE_S


@pytest.mark.slow  # a whole job and a frozen worker
def test_a_frozen_worker_at_staleness_0_is_dropped_and_the_run_finishes(tmp_path):
    out = tmp_path / "run"
    code, log, _, pids = _freeze(
        ["--strategy", "async", "--nproc", "3", *SMALL, "--epochs", "8", "--straggler", "1:3",
         "--monitor-timeout", str(TIMEOUT_S), "--out", str(out)], out, rank=2, after_s=0.2)
    # frozen 0.2 s into training: one message per exchange made the 4-epoch job end within
    # 2 s on a quiet host, before the freeze the test once made at 2 s
    # frozen while computing (no gradient) or before posting its receive (the server's send
    # of parameters waits in vain): either way dropped after the worker timeout
    assert "worker rank 2 lost at step" in log and (
        f"sent no gradient for {TIMEOUT_S} s" in log
        or f"no receive posted within {TIMEOUT_S} s" in log), log
    assert "is gone" not in log, log  # the healthy worker did not give up on its server
    assert "done: test accuracy" in log
    assert "rank(s) 2 still running" in log and "stopped them" in log
    assert code == 0, log
    assert (out / "model.pt").exists()
    assert not any(pid and psutil.pid_exists(pid) and
                   psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids)
