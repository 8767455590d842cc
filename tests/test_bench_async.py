"""`microddp bench async` runs every configuration with and without a straggler and writes what
it measured: the staleness it reports obeys each configuration's rule, the curves run from the
initial weights forward in time, and bad input is one line with exit 2."""

import json
import math
import subprocess
import sys

import pytest

from microddp.bench.sync_async_report import summarize
from microddp.commands import main

STEPS = 10


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "async"
    done = subprocess.run([sys.executable, "-m", "microddp", "bench", "async", "--steps",
                           str(STEPS), "--rounds", "1", "--bounds", "2", "--eval-every", "5",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return out, done.stdout


def test_every_configuration_with_and_without_the_straggler(bench):
    out, stdout = bench
    doc = json.loads((out / "async.json").read_text())
    names = ["sync dp", "sync dp (A/A)", "ps S=0", "ps S=0, 1 backup", "ps SSP S=2", "ps async"]
    assert sorted((r["setup"], r["straggler"]) for r in doc["summary"]) == sorted(
        (n, s) for n in names for s in (False, True))
    for r in doc["runs"]:
        hist = {int(k): v for k, v in r["histogram"].items()}
        if r["setup"] in ("ps S=0", "ps S=0, 1 backup"):
            assert set(hist) == {0}
        if r["setup"] == "ps SSP S=2":
            assert max(hist) <= 2
        if r["setup"] == "ps async":  # one gradient per update, the budget exactly
            assert r["updates"] == sum(hist.values()) == 2 * STEPS
        if r["setup"].startswith("sync dp"):
            assert r["updates"] == STEPS
        if r["setup"] == "ps S=0":
            assert r["updates"] == STEPS and hist == {0: 2 * STEPS}
        if r["setup"] == "ps S=0, 1 backup":  # each update takes the first of 2 gradients
            assert r["updates"] == sum(hist.values()) == 2 * STEPS
        times = [t for t, _, _ in r["curve"]]
        steps = [s for _, s, _ in r["curve"]]
        assert times[0] == 0 and steps[0] == 0 and times == sorted(times) and steps == sorted(steps)
        assert steps[-1] == STEPS
        assert r["samples"] > 0 and r["seconds"] > 0
    # the initial weights are the same in every run: so is their accuracy
    assert len({r["curve"][0][2] for r in doc["runs"]}) == 1
    assert (out / "async.png").read_bytes()[:4] == b"\x89PNG"
    assert "load average" in stdout and stdout.rstrip().endswith(
        f"wrote {out / 'async.json'}, {out / 'async.png'}")


def test_the_summary_is_medians_and_ratios_of_the_runs():
    def run(setup, rate, acc, straggler=False, hist=None):
        rounds[setup] = rounds.get(setup, -1) + 1
        return {"setup": setup, "straggler": straggler, "samples": rate, "seconds": 1.0,
                "round": rounds[setup],
                "updates": 4, "histogram": hist or {0: 4}, "discarded": 0,
                "curve": [(0.0, 0, 0.1), (0.5, 2, acc), (1.0, 4, acc)]}

    rounds = {}
    runs = [run("sync dp", 100, 0.9), run("sync dp", 300, 0.9), run("sync dp", 200, 0.9),
            run("ps async", 400, 0.8, hist={0: 1, 3: 3}),
            run("ps async", 500, 0.95, hist={1: 4}), run("ps async", 600, 0.85)]
    rows = summarize(runs, target=0.9)
    dp, ps = rows
    assert dp["samples_per_s"] == 200 and dp["vs_sync_dp"] == 1.0
    assert ps["samples_per_s"] == 500 and ps["vs_sync_dp"] == 2.5
    assert ps["ratio_range"] == [pytest.approx(500 / 300), 4.0]  # per round: 4, 5/3, 3
    assert ps["histogram"] == {0: 5, 1: 4, 3: 3} and ps["max_staleness"] == 3
    assert ps["mean_staleness"] == pytest.approx((4 + 9) / 12)
    assert ps["seconds_to_target"] is None  # two of its rounds never reached 90%
    assert dp["seconds_to_target"] == 0.5 and ps["test_accuracy"] == 0.85
    assert not math.isnan(ps["mean_staleness"])


@pytest.mark.parametrize("args,message", [
    (["--workers", "1"], "--workers must be at least 2"),
    (["--backup-workers", "2"], "--backup-workers 2 must be below --workers 2"),
    (["--straggler-factor", "0.5"], "--straggler-factor must be a finite number >= 1"),
    (["--bounds", "2", "2"], "--bounds gives 2 more than once"),
    (["--target", "1.5"], "--target is a test accuracy in (0, 1]"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    assert main(["bench", "async", *args]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and message in lines[0]
