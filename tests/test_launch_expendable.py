"""`microddp run --expendable RANKS`: a failing expendable rank is reported and the others go on
(a parameter server's workers); any other rank's failure still stops the job; bad lists are
refused in one line."""

import pytest

from launch_helpers import microddp, write

# Rank 1 fails at once; rank 0 finishes only after it has seen rank 1 gone, so a launcher that
# stopped everyone at rank 1's failure could not let rank 0 print "finished".
SCRIPT = """
    import os, sys, time
    rank = int(os.environ["RANK"])
    if rank == 1:
        print("rank 1 going down")
        sys.exit(3)
    time.sleep(1.5)
    print("finished")
    sys.exit(0)
"""


def test_an_expendable_rank_fails_and_the_others_finish(tmp_path):
    script = write(tmp_path, "job.py", SCRIPT)
    out = microddp("run", "-n", "3", "--expendable", "1-2", script)
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == ["[rank 0] finished", "[rank 1] rank 1 going down",
                                               "[rank 2] finished"]
    assert "rank 1 failed (exit code 3); it is expendable, so the others go on without it" \
        in out.stderr
    assert "  [rank 1] rank 1 going down" in out.stderr


def test_without_expendable_the_same_failure_stops_the_job(tmp_path):
    script = write(tmp_path, "job.py", SCRIPT)
    out = microddp("run", "-n", "3", script)
    assert out.returncode == 3
    assert "finished" not in out.stdout
    assert "rank 1 failed (exit code 3); stopped the other ranks" in out.stderr


def test_a_rank_that_is_not_expendable_still_fails_the_job(tmp_path):
    failing = write(tmp_path, "job0.py", SCRIPT.replace("sys.exit(0)", "sys.exit(4)"))
    out = microddp("run", "-n", "2", "--expendable", "1", failing)
    assert out.returncode == 4
    assert "rank 0 failed (exit code 4); stopped the other ranks" in out.stderr


@pytest.mark.parametrize("ranks,message", [
    ("0-1", "at least one rank must not be expendable"),
    ("3", "each must be a rank of 0..1"),
    ("a", "give ranks like 1-3 or 1,2,5"),
])
def test_bad_expendable_lists_are_one_line(tmp_path, ranks, message):
    script = write(tmp_path, "job.py", SCRIPT)
    out = microddp("run", "-n", "2", "--expendable", ranks, script)
    assert out.returncode == 2
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr


def test_expendable_with_several_hosts_is_one_line(tmp_path):
    """Across hosts torchrun runs the workers and stops all on a failure: refused, not ignored."""
    script = write(tmp_path, "job.py", SCRIPT)
    out = microddp("run", "-n", "2", "--nnodes", "2", "--master-addr", "10.0.0.1",
                   "--expendable", "1", script)
    assert out.returncode == 2
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and "--expendable works on one host only" in lines[0], out.stderr


def test_an_expendable_rank_exiting_75_stops_the_job(tmp_path):
    """75 (launch.run.PEER_GONE): the rank says one the job needs is gone (a frozen server never
    exits by itself): the launcher stops every rank, however long rank 0 would have slept."""
    script = write(tmp_path, "job.py", SCRIPT.replace("sys.exit(3)", "sys.exit(75)")
                   .replace("time.sleep(1.5)", "time.sleep(600)"))
    out = microddp("run", "-n", "3", "--expendable", "1-2", script)
    assert out.returncode == 75
    assert "finished" not in out.stdout
    assert "rank 1 failed (exit code 75); stopped the other ranks" in out.stderr
