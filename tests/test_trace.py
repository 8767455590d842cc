"""Overlap figures, Chrome-trace export and the single-process report, against hand counts."""

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import microddp as mdp
from microddp import trace
from microddp.trace import Span
from microddp.trace import report as trace_report

intervals = st.lists(st.tuples(st.integers(0, 40), st.integers(1, 12)).map(
    lambda t: (t[0], t[0] + t[1])), max_size=8)


def cells(ivs):
    """Brute force: the unit cells [k, k+1) covered by integer intervals."""
    return {k for a, b in ivs for k in range(a, b)}


@settings(max_examples=200, deadline=None)
@given(intervals, intervals)
def test_interval_algebra_matches_brute_force(xs, ys):
    assert trace.length(xs) == len(cells(xs))
    assert trace.intersection(xs, ys) == len(cells(xs) & cells(ys))
    assert cells(trace.subtract(xs, ys)) == cells(xs) - cells(ys)
    assert trace.length(trace.subtract(xs, ys)) == len(cells(xs) - cells(ys))


def one_step(shift=0.0, step=0):
    s = [Span("data", -1, 0, "data"), Span("forward", 0, 2), Span("backward", 2, 10),
         Span("wait comm", 8, 10, "comm_wait"),
         Span("allreduce bucket 0", 4, 9, "comm", args={"bucket": 0, "bytes": 400}),
         Span("allreduce bucket 1", 6, 10, "comm", args={"bucket": 1, "bytes": 40}),
         Span("optimizer", 10, 11, "optim")]
    return [Span(x.name, x.start + shift, x.end + shift, x.track, step, x.args) for x in s]


def test_step_stats_by_hand():
    got = trace.step_stats(one_step())
    # compute = [0,8] + [10,11] (the wait inside backward is not compute); comm = [4,10]
    assert got == {"step_s": 12, "compute_s": 9, "comm_s": 6, "hidden_comm_s": 4,
                   "exposed_comm_s": 2, "wait_s": 2, "data_s": 1, "other_s": 0,
                   "overlap_pct": pytest.approx(200 / 3)}


def test_chrome_trace_tracks_and_round_trip():
    by_rank = {0: one_step(100.0) + one_step(112.0, step=1),
               1: one_step(100.5) + one_step(113.0, step=1)}
    doc = json.loads(json.dumps(trace_report.chrome_trace(by_rank)))
    meta = {(e["pid"], e.get("tid"), e["args"].get("name")) for e in doc["traceEvents"]
            if e["ph"] == "M" and e["name"] in ("process_name", "thread_name")}
    assert meta == {(0, None, "rank 0"), (1, None, "rank 1"), (0, 0, "compute"),
                    (0, 1, "communication"), (1, 0, "compute"), (1, 1, "communication")}
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == 28 and min(e["ts"] for e in xs) == 0
    for rank in (0, 1):  # one link: communication slices never overlap on a track
        comm = sorted((e["ts"], e["ts"] + e["dur"]) for e in xs if e["pid"] == rank
                      and e["tid"] == 1)
        assert len(comm) == 4 and all(a[1] <= b[0] for a, b in zip(comm, comm[1:], strict=False))
    bucket1 = next(e for e in xs if e["pid"] == 0 and e["name"] == "allreduce bucket 1")
    assert (bucket1["ts"], bucket1["dur"], bucket1["args"]["launch_us"]) == (10e6, 1e6, 7e6)  # t0 = data at 99
    assert bucket1["args"]["bytes"] == 40
    back = trace_report.spans_from_chrome(doc)
    assert trace_report.per_step(back) == trace_report.per_step(by_rank)


def test_per_step_and_summary():
    slow = one_step() + [Span("forward", 2, 5, step=0)]  # nested forward: no double count
    rows = trace_report.per_step({0: slow, 1: one_step()})
    assert [r["step"] for r in rows] == [0] and rows[0]["compute_s"] == 9
    three = {0: one_step(0, 0) + one_step(20, 1) + [Span("x", 40, 50, step=2)]}
    rows = trace_report.per_step(three)
    s = trace_report.summarize(rows)
    assert s["steps"] == 3 and s["steps_summarized"] == 2  # the warm-up step left out
    assert s["compute_s"] == (9 + 10) / 2 and s["comm_s"] == 3
    ms = trace_report.in_ms(s)
    assert ms["compute_ms"] == 9500 and ms["overlap_pct"] == 66.7
    assert trace_report.in_ms({"overlap_pct": math.nan})["overlap_pct"] is None
    text = trace_report.format_summary(ms)
    assert "overlap 67%" in text and "compute 9500.00 ms" in text


def test_finish_in_one_process_writes_files(tmp_path):
    world = mdp.init()
    rec = trace.start()
    with trace.span("forward"):
        pass
    trace.add_span("allreduce bucket 0", rec.origin, rec.origin + 0.001, track="comm")
    trace.next_step()
    with trace.span("forward"):
        pass
    out = trace_report.finish(tmp_path, world)
    assert not trace.enabled() and out["steps"] == 2
    doc = json.loads((tmp_path / "trace.json").read_text())
    assert sorted(e["name"] for e in doc["traceEvents"] if e["ph"] == "X") == [
        "allreduce bucket 0", "forward", "forward"]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in rows] == [("trace_step", 0), ("trace_step", 1)]
    assert rows[1]["overlap_pct"] is None and rows[0]["comm_ms"] == 1.0
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _traced_run(run_dir, world, steps):
    trace.start()
    for _ in range(steps):
        with trace.span("forward"):
            pass
        trace.next_step()
    return trace_report.finish(run_dir, world)


def test_a_second_trace_replaces_the_first_ones_rows_and_keeps_the_rest(tmp_path):
    world = mdp.init()
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"kind": "epoch", "step": 9, "loss": 0.5}) + "\n")
    _traced_run(tmp_path, world, 3)
    _traced_run(tmp_path, world, 2)
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in rows] == [("epoch", 9), ("trace_step", 0),
                                                      ("trace_step", 1)]


def test_errors_are_explained(tmp_path):
    with pytest.raises(mdp.MicroDDPError, match="never started"):
        trace_report.finish(tmp_path, mdp.init())
    with pytest.raises(mdp.MicroDDPError, match="no trace at"):
        trace_report.load(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text('{"traceEvents": [')
    with pytest.raises(mdp.MicroDDPError, match="not valid JSON"):
        trace_report.load(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text("[1, 2]")
    with pytest.raises(mdp.MicroDDPError, match="not a Chrome trace"):
        trace_report.load(tmp_path / "other.json")
