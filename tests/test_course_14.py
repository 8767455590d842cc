"""Chapter 14's script runs as a learner runs it and prints what the chapter promises: the online
softmax merges blocks exactly; the zigzag split gives every rank the same blocks at every step of a
causal ring; ring attention equals torch's scaled_dot_product_attention; a CP GPT trains to one
process's losses and parameters; and each rank's measured activation memory is 1/CP of ring
attention's in one process and grows linearly with the sequence (one process's, which keeps the
whole score matrix, grows faster)."""

import re
from pathlib import Path

import pytest

from script_runner import output, run_script

CHAPTER = Path(__file__).resolve().parents[1] / "course" / "14_context_parallel"


def test_ring_attention_and_a_cp_gpt_equal_one_process_with_less_memory():
    out = output(CHAPTER / "ring_attention.py")
    assert float(re.search(r"whole row: max \|diff\| (\S+)", out).group(1)) < 1e-6
    assert "rank 0 holds chunks (0, 3) of 4: positions [0, 1, 2, 3, 4, 5, 18, 19, 20, 21, 22, 23]" in out
    assert "causal ring step 0: chunk blocks computed per rank [3, 3]" in out
    assert "causal ring step 1: chunk blocks computed per rank [2, 2]" in out
    rows = re.findall(r"ring attention CP 2, (causal|full) *: max \|out diff\| (\S+), "
                      r"max \|dq,dk,dv diff\| (\S+)", out)
    assert [r[0] for r in rows] == ["causal", "full"]
    assert all(float(o) < 1e-5 and float(g) < 1e-5 for _, o, g in rows)
    ref = re.search(r"one process: losses ([\d. ]+)", out).group(1).split()
    cp = re.findall(r"CP 2 rank \d: losses ([\d. ]+), max \|loss diff\| (\S+), "
                    r"max \|param diff\| after 3 steps (\S+)", out)
    assert len(cp) == 2
    for losses, ldiff, pdiff in cp:
        assert losses.split() == ref and float(ldiff) < 1e-5 and float(pdiff) < 1e-5
    padded = re.findall(r"seq 23 \(padded by 1 to divide by 4\), rank \d: max \|loss diff\| (\S+), "
                        r"max \|param diff\| (\S+)", out)
    assert len(padded) == 2 and all(float(a) < 1e-5 and float(b) < 1e-5 for a, b in padded)
    hidden = re.findall(r"ring at seq 96, rank \d: hops alone (\S+) ms, waited inside "
                        r"forward\+backward (\S+) ms: (\d+)% hidden", out)
    assert len(hidden) == 2 and all(float(a) > 0 and 0 <= int(h) <= 100 for a, _, h in hidden)
    memory = [tuple(map(int, m)) for m in re.findall(
        r"seq +\d+: one process +(\d+) KiB, ring attention alone +(\d+) KiB, "
        r"CP 2 per rank \(most\) +(\d+) KiB", out)]
    assert len(memory) == 3
    for whole, alone, most in memory:  # per rank: half of ring attention alone, within 5 %
        assert most <= 0.525 * alone and most < whole, memory
    growth = [m[2] / memory[0][2] for m in memory]  # linear in the sequence (2x, 4x), no S^2 term
    assert growth == pytest.approx([1, 2, 4], rel=0.05) and memory[2][0] > 4 * memory[0][0], memory


def test_a_cp_size_the_lengths_do_not_divide_by_is_refused():
    done = run_script(CHAPTER / "ring_attention.py", "-n", "5")
    assert done.returncode == 2 and "--nproc must be 2, 3 or 4" in done.stderr


@pytest.mark.slow  # the same proof at CP 4 as tests/test_cp_equality.py's slow cases
def test_cp_four():
    out = output(CHAPTER / "ring_attention.py", "-n", "4")
    assert "causal ring step 3: chunk blocks computed per rank [2, 2, 2, 2]" in out
    diffs = re.findall(r"max \|param diff\| after 3 steps (\S+)", out)
    assert len(diffs) == 4 and all(float(d) < 1e-5 for d in diffs)
