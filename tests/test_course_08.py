"""Chapter 8's scripts run as a learner runs them and print what the chapter promises: naive
model parallelism never has two ranks computing at once, the grids are the schedules' own,
every schedule ends with one process's parameters, and the hybrid's replicas talk once a
step."""

import re
from pathlib import Path

import pytest

from microddp import pipeline
from script_runner import output, run_script

ROOT = Path(__file__).resolve().parents[1]
CHAPTER = ROOT / "course" / "08_pipeline"


def run(script: str, *args: str) -> str:
    return output(CHAPTER / script, *args)


@pytest.mark.parametrize("n", [2, 3])
def test_naive_model_parallelism_runs_one_rank_at_a_time(n):
    out = run("naive_model_parallel.py", "-n", str(n))
    assert "time two ranks or more computed at once: 0.0% of the step" in out
    rows = re.findall(r"^rank (\d) \|([FB.]+)\|$", out, re.M)
    assert [int(r) for r, _ in rows] == list(range(n))
    assert all("F" in row and "B" in row for _, row in rows)


def test_schedules_side_by_side_print_their_grids_and_bubbles():
    out = run("schedules.py", "-n", "2", "-m", "2", "4")
    for m in (2, 4):
        for name in pipeline.BUILDERS:
            schedule = pipeline.build(name, 2, m)
            paper, theory = pipeline.simulate(schedule).bubble, pipeline.theory_bubble(schedule)
            head = f"{name}, p=2, m={m}: bubble on paper {paper:.3f}, theory {theory:.3f}"
            assert f"{head}\n{pipeline.grid(schedule)}\n" in out
        for name in ("gpipe", "1f1b"):
            measured = re.search(rf"^{name}\s+m={m}: bubble measured (\S+)  theory "
                                 rf"\(p-1\)/\(m\+p-1\) = {1 / (m + 1):.3f}$", out, re.M)
            assert 0 <= float(measured.group(1)) < 1  # a timing: printed, never compared


@pytest.mark.parametrize("args", [(), ("-n", "3", "-m", "2")])
def test_every_schedule_ends_with_one_process_parameters(args):
    rows = re.findall(r"^(\S+)\s+(\S+)\s+(True|False)\s+(True|False)$", run("exact.py", *args),
                      re.M)
    assert [r[0] for r in rows] == list(pipeline.BUILDERS)
    assert all(float(diff) <= 1e-6 and layers == same == "True" for _, diff, layers, same in rows)


def test_too_many_ranks_is_one_line_and_exit_2():
    done = run_script(CHAPTER / "naive_model_parallel.py", "-n", "9", fresh=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr


@pytest.mark.parametrize("args, ranks", [((), [(0, 0), (0, 1), (1, 0), (1, 1)]),
                                         (("--dp", "3", "--pp", "1", "-m", "3"),
                                          [(0, 0), (1, 0), (2, 0)])])
def test_hybrid_averages_once_per_step_and_ends_with_one_process_parameters(args, ranks):
    out = run("hybrid.py", *args)
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\S+)$", out, re.M)
    assert [(int(r[1]), int(r[2])) for r in rows] == ranks
    # 3 steps, each stage's gradients fit one bucket: one all-reduce per step, not one per
    # micro-batch
    assert all(int(r[3]) == 3 and float(r[4]) <= 1e-6 for r in rows)
    assert "every layer trained: True; within 1e-6 of one process: True" in out
def test_bubble_over_m_prints_theory_beside_the_measured_bubbles_and_draws_them(tmp_path):
    png = tmp_path / "bubble.png"
    out = run("bubble_over_m.py", "-n", "2", "-m", "1", "2", "4", "--png", str(png))
    rows = re.findall(r"^\s+(\d+)\s+(\S+)\s+(\S+)\s+(\S+)$", out, re.M)
    assert [int(m) for m, *_ in rows] == [1, 2, 4]
    for m, theory, gpipe, ofob in rows:
        assert theory == f"{1 / (int(m) + 1):.3f}"
        assert all(0 <= float(b) < 1 for b in (gpipe, ofob))  # timings: printed, not compared
    assert png.stat().st_size > 0 and f"wrote {png}" in out
