"""Chapter 6's scripts run as a learner runs them, and print the numbers the chapter promises."""

import re
from pathlib import Path

import pytest

from script_runner import output

COURSE = Path(__file__).resolve().parents[1] / "course" / "06_training"


def _run(name: str) -> str:
    return output(COURSE / name)


def _number(pattern: str, text: str) -> float:
    match = re.search(pattern, text)
    assert match, (pattern, text)
    return float(match.group(1))


def test_sharding():
    out = _run("sharding.py")
    assert "same order every epoch: True" in out
    assert out.count("distinct epoch orders: 3 of 3") == 2
    assert "torch pads to 12 indices" in out and "1 duplicate(s) per epoch" in out
    assert "per-rank batch sizes [[2, 2, 2], [2, 2, 1]]" in out
    assert "split 2+1, nothing seen twice" in out


def test_batch_and_lr():
    out = _run("batch_and_lr.py")
    assert _number(r"max \|difference\| = (\S+)", out) < 1e-6
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+)$", out, re.M)
    fixed, scaled = rows[:4], rows[4:]
    assert [tuple(map(float, r)) for r in fixed] == [(n, 64 / n, 64, 0.05) for n in (1, 2, 4, 8)]
    assert [tuple(map(float, r)) for r in scaled] == [(n, 32, 32 * n, 0.05 * n)
                                                      for n in (1, 2, 4, 8)]


def test_accumulate():
    out = _run("accumulate.py")
    always = _number(r"syncing every backward: (\d+)", out)
    skipped = _number(r"no_sync on the first 3: (\d+)", out)
    assert skipped >= 1 and always == 4 * skipped
    assert _number(r"every backward synced (\S+),", out) < 1e-6
    assert _number(r"with no_sync (\S+)\n", out) < 1e-6


def test_mixed_precision():
    out = _run("mixed_precision.py")
    assert "weights torch.float32, matmul output torch.bfloat16" in out
    assert "stored as float16: 0," in out and "as bfloat16: 1e-08" in out
    assert "scaled back in float32: 1e-08" in out
    acc32 = _number(r"float32 : loss \S+, test accuracy ([\d.]+)%", out)
    acc16 = _number(r"bfloat16: loss \S+, test accuracy ([\d.]+)%", out)
    assert acc32 >= 85 and acc16 >= 85 and abs(acc32 - acc16) < 5


@pytest.mark.timeout(300)
def test_checkpoint_resume():
    out = _run("checkpoint_resume.py")
    assert "on disk (written by rank 0 only): ['ckpt-00000004.pt']" in out
    assert "resumes from step 4 (steps 5-6 are redone), trains to step 12" in out
    assert "max |resumed - uninterrupted| = 0.0; bit-identical: True" in out


@pytest.mark.slow
def test_elastic_loses_a_rank_and_the_loss_goes_on():
    out = _run("elastic.py")
    ranks = [int(r) for r in re.findall(r"^\s+\d+\s+[\d.]+\s+(\d)$", out, re.M)]
    assert ranks[:4] == [4, 4, 4, 4] and set(ranks[4:]) == {3}
    assert "lost id [1] in step 9; members now [0, 2, 3]" in out
    assert "step 8: 4 ranks share the batch of 128; step 9: 3 ranks share it" in out
    assert re.search(r"resumed from the checkpoint of step 6, so steps 7-9 ran twice", out)
    assert _number(r"elastic: max \|weight - uninterrupted run's\| = (\S+)", out) < 1e-5
    assert _number(r"restart: max \|weight - uninterrupted run's\| = (\S+)", out) < 1e-5
