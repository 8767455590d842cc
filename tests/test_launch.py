"""`microddp run`: torchrun's environment, prefixed output, restarts, and bad input (stopping
every process on a failure is in test_launch_stops.py)."""

import subprocess
import sys

import pytest

from launch_helpers import DEADLINE, microddp, write


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
    from microddp.launch.procs import AgentStore, worker_env

    agent = AgentStore(store=None, addr="127.0.0.1", port=1234, secret="s" * 32, secure_port=1235)
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
        (["run", "-n", "2", "tests"], "'tests' is a folder; give the path to a .py file"),
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
    from microddp.launch.procs import AgentStore

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
        import os, sys, time
        attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
        open(os.path.join(sys.argv[1], f"attempt{attempt}-{os.environ['RANK']}"), "w").close()
        if os.environ["RANK"] == "1":
            # Rank 0 has written its file first: the launcher stops the others as soon as one
            # fails, and on a busy machine it once stopped rank 0 before it got there.
            deadline = time.monotonic() + 60
            while not os.path.exists(os.path.join(sys.argv[1], f"attempt{attempt}-0")):
                assert time.monotonic() < deadline
                time.sleep(0.05)
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
    assert "microddp run -n 2 -m microddp.commands.hello" in out.stdout  # an example that runs
    for command in ("doctor", "hello", "run"):
        assert command in microddp("--help").stdout
    out = microddp("run", "-n", "2", "-m", "json.tool", "--help")
    assert out.returncode == 0 and "[rank 1] usage:" in out.stdout


def test_microddp_workers_run_unchanged_under_torchrun():
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "microddp.commands.hello"], capture_output=True, text=True, timeout=DEADLINE)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("all_reduce(sum of ranks) = 1 (expected 1)") == 2
    assert "RANK=1 WORLD_SIZE=2 LOCAL_RANK=1" in out.stdout


def test_a_backend_used_unregistered_gets_the_line_that_registers_it(tmp_path, monkeypatch):
    """dist.init_process_group("microddp") without `import microddp.backend`, where torch's
    autoload of installed backends is off (an installed microddp registers it through its
    `torch.backends` entry point otherwise: tests/test_backend_autoload.py): torch's own error
    ("Unknown backend type microddp") says nothing about the cure."""
    monkeypatch.setenv("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    script = write(tmp_path, "noimport.py", """
        import torch.distributed as dist
        dist.init_process_group("microddp")
    """)
    out = microddp("run", "-n", "2", script)
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        'microddp run: the "microddp" backend is registered by `import microddp.backend`: add '
        'that line before dist.init_process_group("microddp")'), out.stderr
