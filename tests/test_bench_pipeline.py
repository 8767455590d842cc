"""`microddp bench pipeline`: the bubble read off a recorded timeline, activation memory measured
with saved-tensor hooks, and a real run on 2 ranks in sleep mode whose records keep the
schedule's structure. No timing is asserted: the bubble is checked where it is structural
(the idle share of spans we construct, the order of the recorded actions), and against theory
only with a tolerance wide enough for a loaded machine (see the test)."""

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from microddp import pipeline
from microddp.bench.pipeline_report import measured_timeline
from microddp.pipeline.activations import ActivationMeter, hold
from microddp.pipeline.runtime import window
from microddp.pipeline.sleep import Sleeping
from microddp.trace import report as trace_report


def test_bubble_of_a_recorded_timeline_is_the_idle_share_from_first_to_last_compute():
    # rank 0 works 10..20 and 30..40, rank 1 works 20..40: window 10..40 on 2 ranks = 60,
    # busy 20 + 20 = 40, idle 1/3
    spans = [[("F", 0, 0, 10.0, 20.0), ("B", 0, 0, 30.0, 40.0)], [("F", 1, 0, 20.0, 40.0)]]
    t = measured_timeline(spans, 2)
    assert t.makespan == 30.0
    assert t.bubble == pytest.approx(1 / 3)
    assert t.spans[1][0][2] == pipeline.Action(1, "F", 0, 1, 0)
    # a timeline with the plan's own times has the plan's bubble
    schedule = pipeline.build("1f1b", 3, 5)
    plan = pipeline.simulate(schedule)
    recorded = [[(a.kind, a.stage, a.mb, 7 + s, 7 + e) for s, e, a in rank] for rank in plan.spans]
    assert measured_timeline(recorded, 3).bubble == pytest.approx(plan.bubble)


def test_activation_meter_counts_saved_storages_once_and_frees_them_after_backward():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(4, 8, requires_grad=True)
    meter = ActivationMeter(exclude=model.parameters())
    with meter:
        out = model(x)
    # saved: x for the first Linear (4x8 floats), the ReLU's output, which both the ReLU and
    # the second Linear save (one storage, counted once); the weights are left out
    assert meter.live == meter.peak == 2 * 4 * 8 * 4
    out.sum().backward(retain_graph=True)
    assert meter.live == 2 * 4 * 8 * 4  # a retained graph keeps them (zero-bubble's I)
    del out
    assert meter.live == 0 and meter.peak == 256
    with meter:
        model(x).sum().backward()  # a graph freed by its backward frees its activations
    assert meter.live == 0


def test_activation_meter_counts_a_held_message_buffer_until_it_is_freed():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    meter = ActivationMeter(exclude=model.parameters())
    hold(torch.empty(100))  # outside a meter: nothing to count in
    with meter:
        buf = torch.empty(4, 8)
        hold(buf)  # a posted receive's buffer, before any forward reads it
        assert (meter.live, meter.live_saved) == (4 * 8 * 4, 0)
        out = model(buf.requires_grad_())  # the Linear saves the buffer: one storage, once
        assert (meter.live, meter.live_saved) == (2 * 4 * 8 * 4, 2 * 4 * 8 * 4)
        out.sum().backward()
        assert (meter.live, meter.live_saved) == (4 * 8 * 4, 0)  # the buffer is still held
        del out, buf  # the graph's AccumulateGrad holds its leaf, the buffer, as long as it lives
        assert meter.live == 0
    assert (meter.peak, meter.peak_saved) == (2 * 4 * 8 * 4, 2 * 4 * 8 * 4)


def test_sleeping_stage_computes_the_same_numbers_and_splits_backward_into_input_and_weights():
    torch.manual_seed(0)
    stage = pipeline.split_model(pipeline_model(), 2)[1]
    slow = Sleeping(stage, 0.0)
    x = torch.randn(3, 8, requires_grad=True)
    torch.testing.assert_close(slow(x), stage(x), rtol=0, atol=0)
    out = slow(x)
    (gx,) = torch.autograd.grad(out.sum(), x, retain_graph=True)  # I: the input's gradient
    assert slow.weight_clock.grad is None  # I never ran the weights' half
    torch.autograd.backward(out.sum(), inputs=list(slow.parameters()))  # W
    assert slow.weight_clock.grad is not None and x.grad is None


def pipeline_model():
    import microddp as mdp

    return mdp.FullMLP(8, 4)


def _bench(tmp_path, *args):
    out = tmp_path / "pp"
    done = subprocess.run([sys.executable, "-m", "microddp", "bench", "pipeline", *args,
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return out, done.stdout


def test_sleep_mode_run_keeps_each_schedules_structure_and_1f1b_holds_less(tmp_path):
    p, m = 2, 4
    out, stdout = _bench(tmp_path, "--stages", str(p), "--microbatches", str(m), "--compute",
                         "sleep", "--sleep-ms", "3", "--repeats", "3", "--warmup", "1",
                         "--depth", "8", "--dim", "32")
    assert "compute mode: sleep: each block sleeps 3 ms forward, 6 ms backward" in stdout
    result = json.loads((out / "pipeline.json").read_text())
    assert result["config"]["compute"] == "sleep"
    for name in pipeline.BUILDERS:
        r = result[name]
        schedule = pipeline.build(name, p, m)
        assert r["bubble_theory"] == pytest.approx(pipeline.theory_bubble(schedule), abs=1e-4)
        assert len(r["peak_activation_bytes"]) == p and min(r["peak_activation_bytes"]) > 0
        assert (out / r["timeline_png"]).stat().st_size > 0
        # The measured bubble is a timing; on an idle machine it lands within a few points of
        # theory (2 ranks, 3 ms blocks: the docs' table). Here, under any load, it can only be
        # held to what a schedule cannot fake: some idle time, and less than half the step.
        assert 0 < r["bubble_measured"] < 0.5, (name, r)
    # GPipe saves all m micro-batches' activations on every rank; 1F1B at most p - r on rank
    # r: structure, so measured bytes follow it exactly (equal micro-batches of 16 samples)
    gp, ofob = result["gpipe"]["peak_saved_bytes"], result["1f1b"]["peak_saved_bytes"]
    assert ofob[0] == pytest.approx(gp[0] * p / m, rel=0.02)
    assert ofob[1] == pytest.approx(gp[1] * 1 / m, rel=0.02)
    # Beside them a rank holds message buffers: at most its window of posted receives, the
    # gradient received that its B has not used yet, and sends not yet waited for (at most
    # the step's m across a boundary): the total is at least the saved bytes and at most that much more;
    # rank 0 holds its gradients' receive buffers at its peak (a received activation, on the
    # others, is the input autograd saves: no more bytes)
    message = 16 * 32 * 4  # one micro-batch's activation or gradient, dim 32
    for name in ("gpipe", "1f1b"):
        total, saved = result[name]["peak_activation_bytes"], result[name]["peak_saved_bytes"]
        assert total[0] > saved[0], name
        schedule = pipeline.build(name, p, m)
        for r in range(p):
            bound = saved[r] + (window(schedule, r) + 1 + m) * message
            assert saved[r] <= total[r] <= bound, (name, r)
    assert all(o < g for o, g in zip(result["1f1b"]["peak_activation_bytes"],
                                     result["gpipe"]["peak_activation_bytes"], strict=True))
    # the recorded timeline is the schedule's: each rank ran its compute actions in its order
    by_rank = trace_report.load(out / "trace.json")
    for name in pipeline.BUILDERS:
        schedule = pipeline.build(name, p, m)
        for rank, spans in by_rank.items():
            first = sorted((s for s in spans if s.args["schedule"] == name and s.step == 0),
                           key=lambda s: s.start)
            planned = [f"{name} {a.kind}{a.mb}" for a in schedule.actions[rank]
                       if a.kind in ("F", "B", "I", "W")]
            assert [s.name for s in first] == planned
    assert set(result["versus_torch"]) == {"gpipe", "1f1b", "interleaved", "zero-bubble", "zbv"}
    assert all(v["shaped_ratio"] > 0 and v["shaped_ms"] > 0 and v["torch_ms"] > 0
               for v in result["versus_torch"].values())
    assert all(v["ratio"] > 0 for n, v in result["versus_torch"].items() if n != "zbv")
    assert "its torch-shaped class" in stdout


BAD = [
    (["--stages", "1"], "--stages must be at least 2, got 1"),
    (["--microbatches", "0"], "--microbatches must be at least 1, got 0"),
    (["--schedules", "fast"], "unknown schedule(s) fast"),
    (["--schedules", "gpipe", "gpipe"], "--schedules gives gpipe more than once"),
    (["--stages", "4", "--depth", "6"], "cannot cut a FullMLP of depth 6 into 8 stages"),
    (["--batch", "3", "--microbatches", "4"], "cannot cut a batch of 3 samples into 4"),
    (["--sleep-ms", "0"], "--sleep-ms must be a positive, finite number"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    from microddp import commands as cli

    assert cli.main(["bench", "pipeline", *args]) == 2
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert len(lines) == 1 and message in lines[0], err
