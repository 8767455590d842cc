"""Issue 57: a bad MICRODDP_SHM_SLOT_BYTES / MICRODDP_SHM_SMALL_BYTES ends in one line on
every rank naming the variable and the value as written (it used to crash on "abc" with
int()'s ValueError, and report 10 as "got 0", its value after rounding to whole lines)."""

import pytest
import torch

import microddp as mdp
from microddp import MicroDDPError


def reduce_once(world):
    t = torch.full((4,), float(world.rank + 1))
    try:
        mdp.comms.all_reduce(t)
        return t.tolist()
    except MicroDDPError as e:
        return str(e)


@pytest.mark.parametrize("name,value,least", [
    ("MICRODDP_SHM_SLOT_BYTES", "abc", 64),
    ("MICRODDP_SHM_SLOT_BYTES", "10", 64),
    ("MICRODDP_SHM_SMALL_BYTES", "-1", 0),
])
def test_a_bad_shared_memory_size_is_refused_in_one_line(monkeypatch, name, value, least):
    monkeypatch.setenv(name, value)
    # every rank reads it while init sets up the world's shared memory, before any exchange
    with pytest.raises(MicroDDPError) as got:
        mdp.spawn(reduce_once, 2, timeout=60)
    first = str(got.value).splitlines()[0]
    assert first.endswith(f"failed: MicroDDPError: {name} must be a whole number of bytes, at "
                          f"least {least}, got '{value}'; unset it for the default "
                          f"({4 << 20})"), first


def test_a_good_shared_memory_size_still_reduces(monkeypatch):
    monkeypatch.setenv("MICRODDP_SHM_SLOT_BYTES", "100")  # rounded down to 64, as before
    assert mdp.spawn(reduce_once, 2, timeout=60) == [[3.0] * 4] * 2


def test_the_launcher_refuses_a_bad_shared_memory_size_before_starting_ranks(tmp_path):
    import os
    import subprocess
    import sys
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('a rank started')\n")
    env = {**os.environ, "MICRODDP_SHM_SLOT_BYTES": "abc"}
    got = subprocess.run([sys.executable, "-m", "microddp", "run", "--nproc", "2", str(script)],
                         env=env, capture_output=True, text=True, timeout=60)
    assert got.returncode == 2, got.stderr
    assert got.stderr.strip() == ("microddp run: error: MICRODDP_SHM_SLOT_BYTES must be a whole "
                                  "number of bytes, at least 64, got 'abc'; unset it for the "
                                  "default (4194304)"), got.stderr
    assert "a rank started" not in got.stdout + got.stderr
