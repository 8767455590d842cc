"""`microddp bench allreduce` end to end, on a few small sizes: its table, JSON and plot."""

import json
import re

import pytest

from microddp import commands as cli
from microddp.bench.allreduce import (
    DEFAULT_SIZES,
    back_to_back,
    calibration_point,
    parse_size,
    per_call_times,
)
from microddp.bench.allreduce_report import describe, table
from microddp.collectives.cost import CostModel
from microddp.collectives.ring import ring_segments


def test_bench_allreduce_end_to_end(tmp_path, capsys):
    sizes = ["1K", "4K", "16K", "64K", "256K", "512K", "1M"]
    code = cli.main(["bench", "allreduce", "-n", "2", "--sizes", ",".join(sizes),
                     "--algorithms", "ring,tree,naive", "--repeats", "4", "--min-repeats", "2",
                     "--warmup", "1", "--control", "--timeout", "240", "--out", str(tmp_path)])
    assert code == 0
    out = capsys.readouterr().out
    assert out.startswith("fitted:", out.index("\n") + 1)
    # One gloo row per size, each ratio 1.00 against itself; the ring's row has a prediction.
    assert len(re.findall(r"^\s+[\d.]+ [KM]iB\s+gloo\s+[\d.]+ms\s+[\d.]+ms\s+1\.00$", out,
                          re.M)) == 7
    ring = re.findall(r"^\s+ring\s+([\d.]+)ms\s+([\d.]+)ms\s+([\d.]+)ms\s+([+-]\d+)%\s+"
                      r"([\d.]+)\s+([\d.]+)-([\d.]+)$", out, re.M)
    assert len(ring) == 7 and all(float(m) > 0 and float(p) > 0 for m, _, p, *_ in ring)
    assert all(0 < float(lo) <= float(hi) for *_, lo, hi in ring), ring
    doc = json.loads((tmp_path / "allreduce_2ranks.json").read_text())
    cal = doc["calibration"]
    assert len(cal["step_s"]) == len(cal["add_s"]) == 7
    assert cal["alpha"] >= 0 and cal["beta"] >= 0 and cal["gamma"] >= 0
    # The printed predictions are the fitted model's, second line included when there is one.
    model = CostModel(cal["alpha"], cal["beta"], cal["gamma"],
                      tuple(cal["small"]) if cal["small"] else None)
    for i, row in enumerate(doc["rows"]):
        n = row["bytes"]
        assert row["ring_predicted_s"] == pytest.approx(
            model.predict("ring_all_reduce", n, 2, segments=ring_segments(n, 2)), rel=1e-12)
        assert row["ring_vs_gloo"] == pytest.approx(row["ring_s"] / row["gloo_s"], rel=1e-9)
        # The model's error is printed against the mean (time adds up; medians do not).
        mean, pred = row["ring_mean_s"], row["ring_predicted_s"]
        assert f"{(pred - mean) / mean:+.0%}" == ring[i][3] + "%"
        assert row["gloo_mean_s"] > 0
        lo, hi = row["ring_vs_gloo_interval"]
        assert 0 < lo <= hi
        for a in ("tree", "naive"):
            assert row[f"{a}_predicted_s"] == pytest.approx(
                model.predict(f"{a}_all_reduce", n, 2), rel=1e-12)
        assert {"tree_s", "naive_s", "control_vs_gloo", "ring+check_s"} <= set(row)
        assert "ring+check_predicted_s" not in row  # the model does not count the check
    # ring+check's row: median, mean, no prediction, then its ratio and interval.
    assert len(re.findall(r"^\s+ring\+check\s+[\d.]+ms\s+[\d.]+ms\s+[\d.]+\s+[\d.]+-[\d.]+$",
                          out, re.M)) == 7
    assert (tmp_path / "allreduce_2ranks.png").stat().st_size > 0


def test_table_judges_the_model_on_the_mean_and_the_speed_on_medians():
    # Six fast calls and four slow ones: median 1 ms, trimmed mean (one dropped at each end)
    # 2.5 ms. The model (two messages of 1.5 ms each) is +20% off the mean, +200% off the median.
    times = {"ring": [1e-3] * 6 + [5e-3] * 4, "ring+check": [3e-3] * 10, "gloo": [2e-3] * 10}
    report = table([{"bytes": 4096, "times": times}], ["ring", "ring+check"],
                   CostModel(1.5e-3, 0.0, 0.0), 2)
    rec = report["records"][0]
    assert rec["ring_s"] == 1e-3 and rec["ring_mean_s"] == pytest.approx(2.5e-3)
    assert rec["ring_predicted_s"] == pytest.approx(3e-3) and rec["ring_vs_gloo"] == 0.5
    assert "ring+check_predicted_s" not in rec and rec["ring+check_vs_gloo"] == 1.5
    ring, check = (line.split() for line in report["lines"][2:4])
    assert ring[:6] == ["ring", "1.000ms", "2.500ms", "3.000ms", "+20%", "0.50"]
    assert check[:4] == ["ring+check", "3.000ms", "3.000ms", "1.50"]  # no prediction cells
    # What the check costs: the checked call against the unchecked ring, same rounds.
    assert rec["check_vs_ring"] == 3.0
    assert report["lines"][4].split()[:2] == ["check", "cost"]
    assert report["lines"][4].split()[-2] == "3.00"


def test_calibration_takes_trimmed_means_of_chains_and_adds():
    # Chains of 6 steps (4 ranks): six fast, three slow, one stalled for a second. The median
    # (3 ms) ignores the slow group, the plain mean is the stall's; the trimmed mean drops the
    # stall and one fast chain and weighs the rest: (5 * 3 + 3 * 6) / 8 ms.
    chains = [3e-3] * 6 + [6e-3] * 3 + [1.0]
    step, add = calibration_point(chains, [1e-4] * 9 + [9.0], 6)
    assert step == pytest.approx(4.125e-3 / 6) and add == pytest.approx(1e-4)


def test_default_sizes_span_1_kib_to_64_mib():
    sizes = [parse_size(s) for s in DEFAULT_SIZES.split(",")]
    assert sizes[0] == 1 << 10 and sizes[-1] == 64 << 20 and sizes == sorted(sizes)


def test_fitted_line_is_printed_for_a_person():
    one = describe(CostModel(5e-5, 1e-9, 1e-10))
    # beta and gamma are seconds per byte: what reads as GB/s is their inverse, and says so
    assert one == ("fitted: alpha 50.0 us/message, 1/beta 1.00 GB/s per link, "
                   "1/gamma 10.00 GB/s reduction")
    two = describe(CostModel(1e-4, 1e-9, 1e-10, small=(512 << 10, 2e-5, 5e-10)))
    assert two.splitlines() == [
        "fitted: messages up to 512 KiB: alpha 20.0 us/message, 1/beta 2.00 GB/s per link",
        "        larger messages: alpha 100.0 us/message, 1/beta 1.00 GB/s per link",
        "        1/gamma 10.00 GB/s reduction"]


@pytest.mark.parametrize("argv, message", [
    (["--sizes", "1001"], "multiple of 4 bytes, e.g. 1000"),
    (["--sizes", "2"], "multiple of 4 bytes, e.g. 4"),
    (["--sizes", "1K,4K,1K"], "gives 1024 bytes more than once"),
    (["--sizes", ","], "--sizes is empty"),
    (["--warmup", "-1"], "--warmup must be 0 or more"),
    (["--back-to-back", "0"], "--back-to-back must be at least 1, got 0"),
])
def test_bad_arguments_fail_before_any_rank_starts(argv, message, tmp_path, capsys):
    out = tmp_path / "never-made"
    code = cli.main(["bench", "allreduce", "--timeout", "5", "--out", str(out), *argv])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("microddp bench: error:") and message in err, err
    assert not out.exists()  # refused before the run (and before its output folder)


def test_back_to_back_makes_one_sample_of_k_calls():
    calls = []
    one = {"a": lambda: calls.append("a")}
    assert back_to_back(one, 1) is one  # the default times each call alone
    batched = back_to_back({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 3)
    batched["b"]()
    assert calls == ["b"] * 3


def test_per_call_times_divide_each_sample_by_its_calls(monkeypatch):
    import types

    from microddp import timing

    clock = [0.0]  # a fake clock: every call of a contender takes exactly 1 s (2 s for b)
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def tick(seconds):
        return lambda: clock.__setitem__(0, clock[0] + seconds)

    syncs = []
    times = per_call_times({"a": tick(1.0), "b": tick(2.0)}, 3, 1, lambda: syncs.append(1), 5)
    assert times == {"a": [1.0] * 3, "b": [2.0] * 3}
    assert len(syncs) == 2 * (3 + 1)  # one barrier per sample of 5 calls, not per call


def test_back_to_back_reports_time_per_call(tmp_path, capsys):
    code = cli.main(["bench", "allreduce", "--sizes", "4K", "--algorithms", "shm",
                     "--repeats", "3", "--min-repeats", "3", "--back-to-back", "5",
                     "--timeout", "240", "--out", str(tmp_path)])
    assert code == 0
    out = capsys.readouterr().out
    assert "5 calls in a row after each barrier, time per call" in out.splitlines()[0]
    doc = json.loads((tmp_path / "allreduce_2ranks.json").read_text())
    assert doc["back_to_back"] == 5 and doc["rows"][0]["shm_s"] > 0
    # the default call against itself without its check, timed in the same rounds
    row = doc["rows"][0]
    assert row["shm_check_vs_unchecked"] > 0 and "shm-nocheck_s" not in row
    assert len(re.findall(r"^\s+shm check\s+shm / shm without its check \(same rounds\)\s+"
                          r"[\d.]+\s+[\d.]+-[\d.]+$", out, re.M)) == 1


def test_the_shm_check_row_is_shm_against_shm_without_its_check():
    times = {"shm": [3e-3] * 10, "shm-nocheck": [2e-3] * 10, "gloo": [4e-3] * 10}
    report = table([{"bytes": 4096, "times": times}], ["shm"], CostModel(1e-3, 0.0, 0.0), 2)
    rec = report["records"][0]
    assert rec["shm_check_vs_unchecked"] == 1.5 and rec["shm_vs_gloo"] == 0.75
    assert report["lines"][-1].split()[:2] == ["shm", "check"]
    assert report["lines"][-1].split()[-2] == "1.50"
