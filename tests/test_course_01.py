"""Chapter 1's scripts, `microddp hello` and `microddp doctor` run and print the right numbers."""

import os
import re
import subprocess
import sys

import pytest

TIMEOUT = 120


def run(*cmd, **env):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT,
                          env={**os.environ, **env})


def test_verify_setup_reports_backends_and_a_live_all_reduce():
    out = run(sys.executable, "course/01_first_program/verify_setup.py", "--world-size", "3")
    assert out.returncode == 0, out.stderr
    assert "backend gloo : available" in out.stdout
    assert "live all_reduce over 3 processes: [6.0, 6.0, 6.0] (expected 6 everywhere) -> OK" \
        in out.stdout


@pytest.mark.slow  # eight ranks on a few cores: a stress test, for CI's slow run
def test_hello_distributed_with_eight_processes():
    # Unbuffered, as under many launchers: each line must still arrive whole, never two ranks'
    # text on one line (print() would write text and newline separately)
    out = run(sys.executable, "course/01_first_program/hello_distributed.py", "--world-size", "8",
              PYTHONUNBUFFERED="1")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 8 * 4
    assert all(re.fullmatch(r"\[rank \d\] [^\[]+", line) for line in lines), out.stdout
    for rank in range(8):
        assert f"[rank {rank}] hello! rank {rank} of world size 8" in out.stdout
        assert f"[rank {rank}] I handle samples {rank}, {rank + 8}, {rank + 16}, ... (1 in 8)" \
            in out.stdout
        assert f"[rank {rank}] sum of all ranks = 28 (expected 28)" in out.stdout
        assert f"[rank {rank}] env: RANK=not set" in out.stdout


def test_microddp_hello_shows_the_launcher_environment():
    out = run(sys.executable, "-m", "microddp", "hello", "-n", "3")
    assert out.returncode == 0, out.stderr
    assert len([line for line in out.stdout.splitlines() if line.startswith("[rank")]) == 3 * 4
    port = re.search(r"MASTER_PORT=(\d+)", out.stdout).group(1)
    for rank in range(3):
        assert (f"[rank {rank}] environment: RANK={rank} WORLD_SIZE=3 LOCAL_RANK={rank} "
                f"MASTER_ADDR=127.0.0.1 MASTER_PORT={port}") in out.stdout
        assert f"[rank {rank}] all_reduce(sum of ranks) = 3 (expected 3)" in out.stdout
    for rank in range(3):  # three disjoint shares, not two ranks with "even" data
        assert (f"[rank {rank}] rank {rank}: I handle samples {rank}, {rank + 3}, {rank + 6}, "
                "... (1 in 3)") in out.stdout


def test_doctor_passes_on_this_machine():
    out = run(sys.executable, "-m", "microddp", "doctor")
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"ok\s+live all_reduce\s+2 ranks agree on 3", out.stdout)
    assert re.search(r"ok\s+live ring_all_reduce\s+2 ranks get all 1001 expected sums "
                     r"\(microddp's ring, over send/recv\)", out.stdout)
    assert "backends  nccl:" in out.stdout and "gloo:yes" in out.stdout
    assert "microddp can run here" in out.stdout


def test_doctor_names_what_is_wrong_with_the_ring():
    import microddp as mdp
    from microddp.launch import doctor

    world = mdp.init()  # a world of one: the expected sum is the tensor itself
    assert doctor.ring_problem(world) is None

    def off_by_one(x):
        x[7] += 1

    def broken(x):
        raise RuntimeError("Connection closed by peer\nmore detail")

    assert doctor.ring_problem(world, off_by_one) == "element 7 is 8, expected 7"
    assert doctor.ring_problem(world, broken) == "RuntimeError: Connection closed by peer"


def test_chapter_scripts_refuse_a_world_size_below_one_in_one_line():
    for script in ("verify_setup.py", "hello_distributed.py"):
        out = run(sys.executable, f"course/01_first_program/{script}", "--world-size", "0")
        assert out.returncode == 2, out.stderr
        assert "Traceback" not in out.stderr
        assert out.stderr.strip().endswith("error: --world-size must be at least 1")
