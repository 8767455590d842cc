"""HolisticTraceAnalysis reads microddp's per-rank traces and agrees with microddp's own figures.

A traced run on real ranks writes RUN/hta/rank_N.json (trace/kineto.py); HTA's TraceAnalysis
loads the folder and its temporal breakdown (compute, non-compute, idle) and its
communication/computation overlap must agree with microddp's within 10% on every rank.
HTA comes with the test extra (pyproject.toml).
"""

import json
import math

import pytest

import microddp as mdp
from microddp.trace import kineto
from microddp.trace import report as trace_report
from microddp.trace.steps import _run_job


def _close(theirs: float, ours: float, what: str, rank: int) -> None:
    assert math.isclose(theirs, ours, rel_tol=0.10), f"rank {rank} {what}: HTA {theirs}, microddp {ours}"


def test_hta_agrees_with_microddps_figures(tmp_path):
    hta = pytest.importorskip("hta.trace_analysis", reason="HTA comes with the test extra: "
                              "pip install -e '.[test]'")
    kwargs = dict(engine="overlap", dim=128, depth=4, batch=32, steps=5, bucket_cap_mb=0.05)
    summary = mdp.spawn(_run_job, 2, args=(str(tmp_path), kwargs), timeout=120)[0]
    assert summary["comm_ms"] > 0
    folder = tmp_path / kineto.FOLDER
    assert sorted(p.name for p in folder.iterdir()) == ["rank_0.json", "rank_1.json"]
    doc = json.loads((folder / "rank_1.json").read_text())
    assert doc["distributedInfo"] == {"backend": "gloo", "rank": 1, "world_size": 2}
    ours = kineto.own_figures(trace_report.load(tmp_path / "trace.json"))
    # the last step too: by default HTA drops it (a profiler's last step is often cut short)
    analysis = hta.TraceAnalysis(trace_dir=str(folder), include_last_profiler_step=True)
    breakdown = analysis.get_temporal_breakdown(visualize=False).set_index("rank")
    overlap = analysis.get_comm_comp_overlap(visualize=False).set_index("rank")
    assert sorted(breakdown.index) == [0, 1]
    for rank, own in ours.items():
        row = breakdown.loc[rank]
        _close(row["compute_time(us)"], own["compute_us"], "compute", rank)
        _close(row["non_compute_time(us)"], own["exposed_comm_us"], "exposed comm", rank)
        # idle is a small difference of large numbers, and HTA rounds to whole microseconds
        assert abs(row["idle_time(us)"] - own["idle_us"]) <= max(0.10 * own["idle_us"], 100.0)
        _close(overlap.loc[rank, "comp_comm_overlap_pctg"], own["overlap_pct"], "overlap", rank)
    # and microddp's figures are those of its own summary (mean per step over ranks)
    steps = len(kineto.kept_steps(trace_report.load(tmp_path / "trace.json")))
    mean_compute_ms = sum(o["compute_us"] for o in ours.values()) / len(ours) / steps / 1e3
    assert math.isclose(mean_compute_ms, summary["compute_ms"], abs_tol=1e-3)  # ms to 3 places
