"""`microddp run`: environment, prefixed output, failure propagation, restarts, no orphans."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

DEADLINE = 60  # seconds; a launcher that fails to stop its workers fails the test, never hangs


def microddp(*args, timeout=DEADLINE, cwd=None):
    return subprocess.run([sys.executable, "-m", "microddp", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd)


def write(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_workers_get_torchrun_environment_and_prefixed_output(tmp_path):
    script = write(tmp_path, "env.py", """
        import os, sys
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")   # plain torch, as a torchrun script would
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")
        print(" ".join(os.environ[k] for k in keys), int(t.item()), sys.argv[1:])
        dist.destroy_process_group()
    """)
    out = microddp("run", "-n", "3", script, "--flag", "x")
    assert out.returncode == 0, out.stderr
    lines = sorted(out.stdout.splitlines())
    assert lines == [f"[rank {r}] {r} {r} 3 127.0.0.1 3 ['--flag', 'x']" for r in range(3)]


def test_torchrun_variables_and_one_run_id_per_job(tmp_path):
    from microddp.procs import AgentStore, worker_env

    agent = AgentStore(store=None, addr="127.0.0.1", port=1234)
    env = worker_env({}, 1, 4, agent, 0, 0, run_id="job-a")
    assert {k: env[k] for k in ("GROUP_WORLD_SIZE", "ROLE_NAME", "GROUP_RANK", "ROLE_RANK",
                                "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCHELASTIC_RUN_ID")} == {
        "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default", "GROUP_RANK": "0", "ROLE_RANK": "1",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCHELASTIC_RUN_ID": "job-a"}
    mine = worker_env({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}, 0, 1, agent, run_id="x")
    assert mine["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"  # the user's choice wins, as in torchrun

    script = write(tmp_path, "runid.py", """
        import os, sys
        restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
        print("run", os.environ["TORCHELASTIC_RUN_ID"], "restart", restart)
        if restart == "0" and os.environ["RANK"] == "1":
            sys.exit(5)
    """)
    ids = []
    for _ in range(2):
        out = microddp("run", "-n", "2", "--max-restarts", "1", script)
        assert out.returncode == 0, out.stderr
        ids.append({line.split()[3] for line in out.stdout.splitlines() if " run " in line})
    assert len(ids[0]) == 1 and len(ids[1]) == 1  # the same id in every rank and every restart
    assert ids[0] != ids[1]  # and another one for the next job


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
    code = ("import os\nfrom microddp.procs import die_with_parent\n"
            "die_with_parent(os.getppid())\nprint('watched')\n"
            "die_with_parent(os.getppid() + 1)\nprint('orphan lives on')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=DEADLINE)
    assert (out.returncode, out.stdout) == (1, "watched\n"), out.stderr


def test_max_restarts_starts_the_group_again(tmp_path):
    script = write(tmp_path, "flaky.py", """
        import os, sys
        if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1":
            sys.exit(7)
        print("attempt", os.environ["TORCHELASTIC_RESTART_COUNT"], "ok")
    """)
    out = microddp("run", "-n", "2", "--max-restarts", "1", script)
    assert out.returncode == 0, out.stderr
    assert "restart 1 of 1" in out.stderr
    assert "[rank 0] attempt 1 ok" in out.stdout and "[rank 1] attempt 1 ok" in out.stdout
    out = microddp("run", "-n", "2", "--max-restarts", "0", script)
    assert out.returncode == 7


@pytest.mark.parametrize(
    "args, says",
    [
        (["run", "-n", "2", "no/such/script.py"], "does not exist"),
        (["run", "-n", "0", "x.py"], "--nproc must be between 1"),
        (["hello", "-n", "0"], "--nproc must be between 1"),
        (["run", "--master-port", "99999", "x.py"], "--master-port must be between 0 and 65535"),
        (["run", "--master-port", "-5", "x.py"], "--master-port must be between 0 and 65535"),
        (["run", "-m", "no_such_mod"], "no module named 'no_such_mod'"),
        (["run", "-m", "no_such_pkg.sub"], "no module named 'no_such_pkg.sub'"),
        (["run", "-m", "microddp.collectives"], "'microddp.collectives' is a package"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, says):
    out = microddp(*args)
    assert out.returncode == 2
    assert says in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert "Traceback" not in out.stderr


def test_agent_store_refuses_a_port_out_of_range():
    from microddp.errors import MicroDDPError
    from microddp.procs import AgentStore

    with pytest.raises(MicroDDPError, match="port must be between 0 and 65535, got 70000"):
        AgentStore.start(70000)


def test_missing_script_names_only_the_script():
    out = microddp("run", "-n", "2")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == \
        "microddp run: error: the following arguments are required: script"


def test_a_usage_error_is_not_restarted(tmp_path):
    """Exit code 2 is a user's mistake (microddp's and argparse's code): a restart repeats it."""
    script = write(tmp_path, "usage.py", """
        import os, sys
        attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
        open(os.path.join(sys.argv[1], f"attempt{attempt}-{os.environ['RANK']}"), "w").close()
        sys.exit(2 if os.environ["RANK"] == "1" else 0)
    """)
    out = microddp("run", "-n", "2", "--max-restarts", "2", script, str(tmp_path))
    assert out.returncode == 2
    assert "restarting all" not in out.stderr
    assert "not restarting: exit code 2 is a usage error" in out.stderr
    assert sorted(p.name for p in tmp_path.glob("attempt*")) == ["attempt0-0", "attempt0-1"]


def test_taken_master_port_is_one_line_and_exit_2(tmp_path):
    import socket

    script = write(tmp_path, "ok.py", "print('never runs')\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        out = microddp("run", "-n", "2", "--master-port", str(port), script)
    assert out.returncode == 2
    assert f"port {port} on 127.0.0.1 is already in use" in out.stderr
    assert "Traceback" not in out.stderr


def test_module_mode_and_help():
    out = microddp("run", "--help")
    assert out.returncode == 0 and "torchrun --nnodes 2" in out.stdout
    assert "microddp run -n 2 train.py" in out.stdout
    for command in ("doctor", "hello", "run"):
        assert command in microddp("--help").stdout
    out = microddp("run", "-n", "2", "-m", "json.tool", "--help")
    assert out.returncode == 0 and "[rank 1] usage:" in out.stdout


def test_microddp_workers_run_unchanged_under_torchrun():
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "microddp.hello"], capture_output=True, text=True, timeout=DEADLINE)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("all_reduce(sum of ranks) = 1 (expected 1)") == 2
    assert "RANK=1 WORLD_SIZE=2 LOCAL_RANK=1" in out.stdout
