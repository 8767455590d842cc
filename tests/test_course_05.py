"""Chapter 5's scripts run as a learner runs them, and print the numbers the chapter promises:
every stage ends with the monolith's parameters and losses."""

import re
import sys
from pathlib import Path

import pytest

from script_runner import output, run_script

ROOT = Path(__file__).resolve().parents[1]
CHAPTER = ROOT / "course" / "05_data_parallel"


def run(script: str, *args: str) -> str:
    return output(CHAPTER / script, *args)


def numbers(out: str) -> tuple[list[float], float]:
    losses = [float(v) for v in re.findall(r"^step \d+  loss (\S+)$", out, re.M)]
    checksum = float(re.search(r"^parameter checksum (\S+)$", out, re.M).group(1))
    return losses, checksum


@pytest.fixture(scope="module")
def monolith():
    out = run("monolith.py")
    sys.path.insert(0, str(CHAPTER))
    try:  # recompute the baseline here, independently of the script's own printing
        import problem
        import torch

        from microddp.dp import ladder

        model, opt = problem.fresh_model()
        losses = [ladder.monolith_step(model, opt, problem.loss_fn, x, y)
                  for x, y in problem.batches()]
        checksum = sum(p.detach().double().sum().item() for p in model.parameters())
        assert torch.isfinite(torch.tensor(losses)).all()
    finally:
        sys.path.remove(str(CHAPTER))
    assert numbers(out) == ([float(f"{v:.6f}") for v in losses], float(f"{checksum:.10f}"))
    return numbers(out)


@pytest.mark.parametrize("script,args", [("manual.py", ()), ("naive.py", ()), ("hooks.py", ()),
                                         ("buckets.py", ()), ("overlap.py", ("-n", "3"))])
def test_each_stage_reproduces_the_monolith(monolith, script, args):
    losses, checksum = numbers(run(script, *args))
    assert losses == pytest.approx(monolith[0], abs=2e-6)
    assert checksum == pytest.approx(monolith[1], rel=1e-7)


def test_ddp_script_swaps_in_torchs_ddp_with_the_same_result_and_checkpoint(monolith):
    ours, theirs = run("ddp.py"), run("ddp.py", "--engine", "torch")
    assert numbers(ours) == numbers(theirs)
    assert numbers(ours)[0] == pytest.approx(monolith[0], abs=2e-6)
    assert numbers(ours)[1] == pytest.approx(monolith[1], rel=1e-7)
    line = "checkpoint: first key 'net.0.weight'; reloaded identically on every rank: True"
    assert line in ours and line in theirs


def test_compare_table_shows_every_stage_within_float_rounding(monolith):
    rows = re.findall(r"^(\S.*?)\s+(\d\.\d{3}e[+-]\d\d)\s+(True|False|-)$", run("compare.py"), re.M)
    assert [r[0] for r in rows] == [
        "monolith", "manual (2 replicas)", *[f"{e} (2 ranks)" for e in
                                             ("naive", "hooks", "buckets", "overlap", "microddp", "torch")]]
    assert all(float(diff) < 1e-6 for _, diff, _ in rows)
    assert [same for _, _, same in rows] == ["-", "-"] + ["True"] * 6


@pytest.mark.parametrize("script", ["naive.py", "ddp.py"])
def test_a_world_size_that_does_not_divide_the_batch_is_one_line_and_exit_2(script):
    done = run_script(CHAPTER / script, "-n", "5", fresh=True)  # the interpreter's own exit
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert ("--world-size 5: every rank takes an equal share of the global batch of 48, so the "
            "world size must divide it (1, 2, 3, 4, 6, 8, 12, 16, 24, 48)") in done.stderr
