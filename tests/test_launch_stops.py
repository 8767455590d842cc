"""`microddp run` leaves nothing behind: a failing rank, a killed or signalled launcher, a
closed output pipe or a dead parent stops every worker and the workers' own children."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from launch_helpers import DEADLINE, microddp, write

SLEEPER = """
    import os, sys, time
    rank = int(os.environ["RANK"])
    open(os.path.join(sys.argv[1], f"pid{rank}"), "w").write(str(os.getpid()))
    if rank == 1:
        time.sleep(0.5)
        {failure}
    time.sleep(600)
"""


def _alive(pid: int) -> bool:
    """Running, as /proc sees it (a zombie has finished: only its exit status is left)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _pids(tmp_path: Path, pattern: str = "pid*") -> dict[str, int]:
    return {p.name: int(p.read_text()) for p in tmp_path.glob(pattern) if p.read_text()}


def _wait_for_files(tmp_path: Path, pattern: str, n: int) -> None:
    deadline = time.monotonic() + DEADLINE
    while len(_pids(tmp_path, pattern)) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(_pids(tmp_path, pattern)) == n, sorted(p.name for p in tmp_path.iterdir())


def _assert_all_gone(tmp_path: Path, pattern: str = "pid*", within: float = 10) -> None:
    """Every process named by a pid file has ended (within a few seconds), else kill it, so that
    a failing test leaves nothing behind, and fail."""
    pids = _pids(tmp_path, pattern)
    deadline = time.monotonic() + within
    while any(_alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    survivors = {name: pid for name, pid in pids.items() if _alive(pid)}
    for pid in survivors.values():
        os.kill(pid, signal.SIGKILL)
    assert survivors == {}, f"outlived the launcher: {survivors}"


@pytest.mark.parametrize(
    "failure, code, says",
    [
        ("raise ValueError('boom from rank 1')", 1, "ValueError: boom from rank 1"),
        ("sys.exit(3)", 3, "exit code 3"),
        ("os.kill(os.getpid(), 9)", 128 + 9, "killed by SIGKILL"),
    ],
)
def test_a_failing_rank_stops_the_others(tmp_path, failure, code, says):
    script = write(tmp_path, "fail.py", SLEEPER.replace("{failure}", failure))
    out = microddp("run", "-n", "3", script, str(tmp_path))
    assert out.returncode == code
    assert "rank 1 failed" in out.stderr
    assert says in out.stderr + out.stdout
    assert len(list(tmp_path.glob("pid*"))) == 3
    _assert_all_gone(tmp_path)


def test_a_silent_rank_that_dies_is_reported_without_an_empty_list_of_lines(tmp_path):
    script = write(tmp_path, "quiet.py", """\
        import os
        if os.environ["RANK"] == "1":
            os.kill(os.getpid(), 9)
        """)
    out = microddp("run", "-n", "2", script)
    assert out.returncode == 128 + 9
    assert ("microddp run: rank 1 failed (killed by SIGKILL); stopped the other ranks. "
            "It printed nothing.") in out.stderr
    assert "Its last lines" not in out.stderr


def test_killing_the_launcher_kills_its_workers(tmp_path):
    script = write(tmp_path, "sleep.py", SLEEPER.replace("{failure}", "pass"))
    launcher = subprocess.Popen([sys.executable, "-m", "microddp", "run", "-n", "2", script,
                                 str(tmp_path)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + DEADLINE
        while len(list(tmp_path.glob("pid*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(list(tmp_path.glob("pid*"))) == 2
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=10)
        pids = [int(p.read_text()) for p in tmp_path.glob("pid*")]
        gone = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)],
                                 timeout=10)[1]
        assert gone == [], "workers survived a SIGKILLed launcher"
    finally:
        launcher.kill()


HELPERS = """
    import os, subprocess, sys, time
    rank = int(os.environ["RANK"])
    helper = subprocess.Popen(["sleep", "314"])  # a worker's own child, in its process group
    open(os.path.join(sys.argv[1], f"helper{rank}"), "w").write(str(helper.pid))
    open(os.path.join(sys.argv[1], f"pid{rank}"), "w").write(str(os.getpid()))
    print("ready", flush=True)
    if rank == 1 and sys.argv[2] == "crash":
        time.sleep(0.5)
        sys.exit(3)
    time.sleep(600)
"""


def test_a_crashed_ranks_own_children_are_stopped_too(tmp_path):
    script = write(tmp_path, "job.py", HELPERS)
    out = microddp("run", "-n", "2", script, str(tmp_path), "crash")
    assert out.returncode == 3, out.stderr
    assert len(_pids(tmp_path, "helper*")) == 2
    _assert_all_gone(tmp_path, "pid*")
    _assert_all_gone(tmp_path, "helper*")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT])
def test_a_signalled_launcher_stops_workers_and_their_children(tmp_path, sig):
    script = write(tmp_path, "job.py", HELPERS)
    launcher = subprocess.Popen([sys.executable, "-m", "microddp", "run", "-n", "2", script,
                                 str(tmp_path), "stay"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_files(tmp_path, "pid*", 2)
        launcher.send_signal(sig)
        _, err = launcher.communicate(timeout=DEADLINE)
        assert launcher.returncode == 128 + sig, err
        assert "Traceback" not in err
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        _assert_all_gone(tmp_path, "pid*")
        _assert_all_gone(tmp_path, "helper*")


def test_a_closed_output_pipe_stops_the_job_quietly(tmp_path):
    """`microddp run ... | head -2`: once the reader is gone, stop like a shell pipeline does."""
    script = write(tmp_path, "chatty.py", """
        import os, sys
        open(os.path.join(sys.argv[1], "pid" + os.environ["RANK"]), "w").write(str(os.getpid()))
        for i in range(200_000):
            print(i)
    """)
    errors = tmp_path / "stderr.txt"
    with errors.open("w") as err:
        launcher = subprocess.Popen([sys.executable, "-m", "microddp", "run", "-n", "2", script,
                                     str(tmp_path)], stdout=subprocess.PIPE, stderr=err,
                                    text=True)
    try:
        first = [launcher.stdout.readline() for _ in range(2)]
        assert all(line.startswith("[rank ") for line in first), first
        launcher.stdout.close()  # as `head -2` does after two lines
        assert launcher.wait(timeout=DEADLINE) == 141, errors.read_text()
        assert errors.read_text() == ""
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        _assert_all_gone(tmp_path, "pid*")


def test_a_worker_whose_parent_is_already_gone_exits():
    """PR_SET_PDEATHSIG set after the parent died never fires: die_with_parent checks."""
    code = ("import os\nfrom microddp.launch.procs import die_with_parent\n"
            "die_with_parent(os.getppid())\nprint('watched')\n"
            "die_with_parent(os.getppid() + 1)\nprint('orphan lives on')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=DEADLINE)
    assert (out.returncode, out.stdout) == (1, "watched\n"), out.stderr


ESCAPE = """
    import os, subprocess, sys, time
    rank, out = os.environ["RANK"], sys.argv[1]
    p = subprocess.Popen(["sleep", "300"], start_new_session=True)  # a session of its own
    open(f"{out}/setsid-{rank}", "w").write(str(p.pid))
    if os.fork() == 0:  # a daemon: fork, setsid, fork again, the middle one exits
        os.setsid()
        if os.fork() == 0:
            open(f"{out}/daemon-{rank}", "w").write(str(os.getpid()))
            os.execvp("sleep", ["sleep", "300"])
        os._exit(0)
    os.wait()
    while len(os.listdir(out)) < 4:  # both ranks' children written down
        time.sleep(0.01)
    sys.exit(3 if sys.argv[2] == "fail" and rank == "1" else 0)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc and prctl")
@pytest.mark.parametrize("end", ["ok", "fail"])
def test_children_in_their_own_session_do_not_outlive_the_job(tmp_path, end):
    """A child started with setsid (or a double-forked daemon) left the worker's process group
    and outlived `microddp run` (issue 57): the launcher now watches the process tree."""
    out = tmp_path / "pids"
    out.mkdir()
    script = write(tmp_path, "escape.py", ESCAPE)
    done = microddp("run", "-n", "2", script, str(out), end)
    assert done.returncode == (0 if end == "ok" else 3), done.stderr
    pids = [int(p.read_text()) for p in out.iterdir()]
    assert len(pids) == 4
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_running(p) for p in pids):
        time.sleep(0.1)
    left = [p for p in pids if _running(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert left == [], f"still running after the job: {left}"


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
