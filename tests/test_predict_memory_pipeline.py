"""`microddp predict` beyond data parallelism: the ZeRO paper's memory model (its Fig. 1 figures
for 7.5B parameters on 64 ranks) and a pipeline step played from the schedule with costs."""

import dataclasses
import json
import re
from dataclasses import asdict

import pytest

from microddp import commands as cli
from microddp import pipeline
from microddp.pipeline.schedules import RECVS, SENDS
from microddp.predict import memory
from microddp.predict import pipeline as pp
from microddp.predict import pipeline_costs as pc
from microddp.predict.step import HARDWARE, Hardware, load_calibration, save_calibration


def test_zero_paper_figure_1_for_7_5b_parameters_on_64_ranks():
    psi, n = 7.5e9, 64
    gb = {s: memory.per_rank(psi, n, s)["total"] / 1e9 for s in memory.STAGES}
    # the paper's figures, to the digit it prints them
    assert round(gb[0], 1) == 120.0
    assert round(gb[1], 1) == 31.4
    assert round(gb[2], 1) == 16.6
    assert round(gb[3], 1) == 1.9
    one = memory.per_rank(psi, 1, 3)
    assert one["total"] == 16 * psi  # on one rank there is nothing to shard


def test_fp32_adam_split_matches_what_chapter_9_measures():
    m = memory.per_rank(1000, 4, 2, memory.FP32_ADAM)
    assert (m["params"], m["grads"], m["optimizer_state"]) == (4000, 1000, 2000)
    with pytest.raises(memory.MicroDDPError, match="stage must be 0"):
        memory.per_rank(1000, 4, 4)


def test_predict_zero_prints_figure_1(capsys):
    assert cli.main(["predict", "--zero", "--params", "7.5e9", "--world", "64"]) == 0
    out = capsys.readouterr().out
    totals = dict(re.findall(r"^(plain DP|ZeRO-\d)\s+\S+\s+\S+\s+\S+\s+(\S+)$", out, re.M))
    assert totals == {"plain DP": "120.0", "ZeRO-1": "31.4", "ZeRO-2": "16.6", "ZeRO-3": "1.9"}


INSTANT = Hardware(flops=1e30, bandwidth=1e30, latency=0.0, note="instant")


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_a_pipeline_of_sleeps_takes_m_plus_p_minus_1_slots_by_hand(name):
    # 4 blocks on 2 stages, 1 ms sleep per block: F = 2 ms, B = 4 ms per stage; no transfer
    job = pp.PipelineJob(stages=2, microbatches=3, dim=8, depth=4, batch=6, sleep_ms=1.0)
    r = pp.predict(job, name, INSTANT)
    assert r["step_s"] == pytest.approx((3 + 2 - 1) * (2e-3 + 4e-3), rel=1e-9)
    assert r["bubble"] == pytest.approx(pipeline.theory_bubble(pipeline.build(name, 2, 3)))


def test_each_message_on_the_critical_path_lengthens_the_step():
    job = pp.PipelineJob(stages=3, microbatches=4, dim=8, depth=6, batch=8, sleep_ms=1.0)
    slow_link = Hardware(flops=1e30, bandwidth=1e30, latency=1e-3, note="1 ms per message")
    base, late = pp.predict(job, "gpipe", INSTANT), pp.predict(job, "gpipe", slow_link)
    # GPipe's critical path crosses the 2 boundaries forward and back once each: 4 messages
    assert late["step_s"] - base["step_s"] == pytest.approx(4e-3, rel=1e-6)
    assert late["messages"] == 2 * 2 * 4  # 2 boundaries x (activation + gradient) x 4 mbs
    assert late["bytes_sent"] == late["messages"] * 2 * 8 * 4  # 2 samples x 8 floats


def test_predict_compare_reads_a_bench_pipeline_result(tmp_path, capsys):
    bench = {"config": {"stages": 2, "microbatches": 4, "dim": 16, "depth": 4, "batch": 8,
                        "virtual": 2, "compute": "sleep", "sleep_ms": 2.0,
                        "load_average": [1.0, 1.0, 1.0]},
             "gpipe": {"bubble_measured": 0.21, "step_ms": 40.0}}
    path = tmp_path / "pipeline.json"
    path.write_text(json.dumps(bench))
    assert cli.main(["predict", "--compare", str(path), "--hardware", "cpu-loopback"]) == 0
    out = capsys.readouterr().out
    row = re.search(r"^gpipe\s+(\S+)\s+(\S+)\s+(\S+).*\s+0\.210\s+40\.00\s+(-?\d+)%$", out, re.M)
    predicted = pp.predict(pp.from_bench(bench), "gpipe", HARDWARE["cpu-loopback"])
    assert float(row.group(3)) == pytest.approx(1e3 * predicted["step_s"], abs=0.01)
    assert int(row.group(4)) == round(100 * (1e3 * predicted["step_s"] - 40) / 40)
    path.write_text("{}")
    assert cli.main(["predict", "--compare", str(path)]) == 2
    assert "not a pipeline.json" in capsys.readouterr().err


def _costs(**kw):
    figures = dict(forward_fixed=1e-4, forward_block=2e-5, forward_weight=1e-9,
                   forward_rate=5e10, backward_fixed=2e-4, backward_block=4e-5,
                   backward_weight=3e-9, backward_rate=4e10, step_fixed=3e-4, step_block=1e-5,
                   last_forward=0.0, last_backward=0.0, tail=1.0, latency=0.0,
                   bandwidth=float("inf"), send=0.0, receive=0.0, wake=0.0, ranks=2, cores=2)
    return pc.PipelineCosts(**(figures | kw))


def test_action_fit_recovers_a_fixed_a_per_block_a_per_weight_and_a_per_flop_cost():
    truth = _costs()
    points = [(k, r, d, truth.forward(k, r, d)) for k in (2, 4, 8) for r in (4, 8, 32)
              for d in (128, 512)]
    fixed, block, weight, rate = pc.fit_actions(points)
    assert (fixed, block, weight, rate) == pytest.approx((1e-4, 2e-5, 1e-9, 5e10), rel=1e-6)
    back = [(k, r, d, truth.backward(k, r, d)) for k, r, d, _ in points]
    assert pc.fit_actions(back, 2.0) == pytest.approx((2e-4, 4e-5, 3e-9, 4e10), rel=1e-6)
    # an action that costs the same whatever its size: all fixed, no negative terms
    flat = [(k, r, d, 1e-3) for k, r, d, _ in points]
    fixed, block, weight, rate = pc.fit_actions(flat)
    assert fixed == pytest.approx(1e-3) and block == pytest.approx(0, abs=1e-12)
    assert block >= 0 and weight >= 0 and rate > 1e15  # never negative
    with pytest.raises(pc.MicroDDPError, match="at least 4"):
        pc.fit_actions(points[:3])
    with pytest.raises(pc.MicroDDPError, match="2 widths"):
        pc.fit_actions([pt for pt in points if pt[2] == 128])


def test_a_widths_own_fit_is_recovered_and_used_for_that_width_only():
    # at width 128 an action costs 30 us + k (20 us + FLOPs / 3e10) forward, its backward
    # 60 us + k (40 us + 2 FLOPs / 3e10): one width's fit recovers both, the backward with
    # its FLOPs counted twice
    points = [(k, r, 128, 3e-5 + k * (2e-5 + pc.block_flops(128, r) / 3e10))
              for k in (2, 4, 8) for r in (4, 8, 32)]
    assert pc.fit_width(points) == pytest.approx([3e-5, 2e-5, 3e10], rel=1e-6)
    back = [(k, r, d, 2 * t) for k, r, d, t in points]
    assert pc.fit_width(back, 2.0) == pytest.approx([6e-5, 4e-5, 3e10], rel=1e-6)
    with pytest.raises(pc.MicroDDPError, match="one width"):
        pc.fit_width(points + [(2, 4, 512, 1e-3)])
    with pytest.raises(pc.MicroDDPError, match="2 different block counts"):
        pc.fit_width([pt for pt in points if pt[0] == 2])
    # a calibrated width's actions come from its own fit, any other width's from the fit
    # over widths
    costs = _costs(forward_widths={"128": [3e-5, 2e-5, 3e10]},
                   backward_widths={"128": [6e-5, 4e-5, 3e10]})
    assert costs.forward(8, 8, 128) == pytest.approx(3e-5 + 8 * (2e-5 + pc.block_flops(128, 8)
                                                                 / 3e10))
    assert costs.backward(8, 8, 128) == pytest.approx(2 * costs.forward(8, 8, 128))
    assert costs.forward(8, 8, 512) == _costs().forward(8, 8, 512)
    # the median of calibration rounds takes each term of a width's fit apart
    rounds = [_costs(forward_widths={"128": [a, 2 * a, 3e10]}) for a in (1.0, 3.0, 2.0)]
    assert pc.median_costs(rounds).forward_widths == {"128": [2.0, 4.0, 3e10]}


def test_calibrated_actions_fill_the_schedule_by_hand():
    # 2 ranks, 4 blocks of width 16, batch 6 in 3 micro-batches of 2 rows: F and B per stage of
    # 2 blocks come from the fitted costs, the step adds its fixed cost once
    costs = _costs()
    job = pp.PipelineJob(stages=2, microbatches=3, dim=16, depth=4, batch=6)
    f, b = costs.forward(2, 2, 16), costs.backward(2, 2, 16)
    r = pp.predict(job, "gpipe", INSTANT, costs)
    assert r["step_s"] == pytest.approx((3 + 2 - 1) * (f + b) + costs.step(2), rel=1e-9)
    # sleeps add on top; messages cost latency + bytes / bandwidth (1 + 1 ms) and the sender
    # its isend (0.5 ms): GPipe's critical path carries one activation's and one gradient's
    # transfer, and all 6 sends (each of rank 0's delays its next F, so the next activation;
    # each of rank 1's its next B, so the next gradient)
    slow = _costs(latency=1e-3, bandwidth=2 * 16 * 4 / 1e-3, send=5e-4)
    late = pp.predict(pp.PipelineJob(2, 3, 16, 4, 6, sleep_ms=1.0), "gpipe", INSTANT, slow)
    sleeps = (3 + 2 - 1) * (2e-3 + 4e-3)
    assert late["step_s"] == pytest.approx(r["step_s"] + sleeps + 2 * 2e-3 + 6 * 5e-4, rel=1e-9)
    # ranks beyond the cores share them while they compute (rank r on core r mod cores):
    # GPipe on 4 ranks, 3 micro-batches, 1 block a stage plays in (3 + 4 - 1)(f + b) on 4
    # cores; on 1 core some rank always computes (messages cost nothing here), so the step
    # is all 4 x 3 x (f + b) of compute; 2 cores fall between. The step's fixed cost
    # (zero_grad, the optimizer) runs on all 4 ranks at once: ranks / cores times as long
    four = pp.PipelineJob(stages=4, microbatches=3, dim=16, depth=4, batch=6)
    f1, b1 = costs.forward(1, 2, 16), costs.backward(1, 2, 16)
    got = {cores: pp.predict(four, "gpipe", INSTANT, _costs(cores=cores))["step_s"]
           for cores in (4, 2, 1)}
    assert got[4] == pytest.approx(6 * (f1 + b1) + costs.step(1), rel=1e-9)
    assert got[1] == pytest.approx(12 * (f1 + b1) + 4 * costs.step(1), rel=1e-9)
    assert got[4] < got[2] - 2 * costs.step(1) + costs.step(1) < got[1]
    # a sleeping rank holds no core: all-sleep stages (the FLOPs cost nothing) on 1 core play
    # as on 4
    sleepy = _costs(forward_fixed=0.0, forward_block=0.0, forward_weight=0.0,
                    forward_rate=float("inf"), backward_fixed=0.0, backward_block=0.0,
                    backward_weight=0.0, backward_rate=float("inf"), step_fixed=0.0,
                    step_block=0.0)
    slept = pp.PipelineJob(stages=4, microbatches=3, dim=16, depth=4, batch=6, sleep_ms=1.0)
    one, all_ = (pp.predict(slept, "gpipe", INSTANT, dataclasses.replace(sleepy, cores=c))
                 for c in (1, 4))
    assert one["step_s"] == pytest.approx(all_["step_s"]) == pytest.approx(6 * 3e-3)


def test_ranks_on_one_core_share_it_while_they_compute_and_not_while_they_wait():
    # GPipe, 2 ranks, F = 1, B = 2. One micro-batch: the ranks never compute at once, so one
    # core plays as two: F0 F0 B0 B0 = 6
    one = pipeline.build("gpipe", 2, 1)
    assert pipeline.simulate(one, cores=1).makespan == pipeline.simulate(one).makespan == 6
    # Two (9 on two cores): rank 0's F1 and rank 1's F0 run at once from t = 1, each at half
    # speed, both done at 3; rank 1's F1 alone (3-4), its B0 alone (4-6); then rank 1's B1
    # and rank 0's B0 at once (6-10); rank 0's B1 alone (10-12): 12, all the compute, back
    # to back
    two = pipeline.build("gpipe", 2, 2)
    shared = pipeline.simulate(two, cores=1)
    assert shared.makespan == pytest.approx(12)
    assert [t for s, e, _ in shared.spans[1] for t in (s, e)] == \
        pytest.approx([1, 3, 3, 4, 4, 6, 6, 10])
    assert pipeline.simulate(two).makespan == 9
    # all of it a sleep (no core held): as on two cores
    asleep = pipeline.simulate(two, cores=1, idle=lambda a: {"F": 1, "B": 2}[a.kind])
    assert asleep.makespan == 9
    # as many cores as ranks: the plain play, messages' costs included
    for name in pipeline.BUILDERS:
        s = pipeline.build(name, 3, 5)
        args = (lambda a: 1 + 0.1 * a.stage + (a.kind == "B"), 0.3, 0.05, 0.02, 0.1)
        plain, cored = pipeline.simulate(s, *args), pipeline.simulate(s, *args, cores=3)
        assert cored.makespan == pytest.approx(plain.makespan)
        assert cored.spans == plain.spans


def test_the_head_and_loss_cost_the_last_stage_only_and_the_tail_stretches_compute():
    # 2 ranks, 1 micro-batch: F0 F1 B1 B0 in a row; the head's F and B land on stage 1 alone
    job = pp.PipelineJob(stages=2, microbatches=1, dim=16, depth=4, batch=2)
    base = pp.predict(job, "gpipe", INSTANT, _costs())["step_s"]
    head = pp.predict(job, "gpipe", INSTANT, _costs(last_forward=1e-3, last_backward=3e-3))
    assert head["step_s"] == pytest.approx(base + 4e-3, rel=1e-9)  # once, not per stage
    f, b = _costs().forward(2, 2, 16), _costs().backward(2, 2, 16)
    stretched = pp.predict(job, "gpipe", INSTANT, _costs(tail=1.5))["step_s"]
    assert stretched == pytest.approx(base + 0.5 * 2 * (f + b), rel=1e-9)
    # a send's and a receive's own times are measured as trimmed means, their tail included:
    # the tail does not stretch them (here 2 sends and 2 receives on the critical path)
    messages = pp.predict(job, "gpipe", INSTANT, _costs(send=1e-3, receive=2e-3))["step_s"]
    both = pp.predict(job, "gpipe", INSTANT, _costs(send=1e-3, receive=2e-3, tail=1.5))
    assert messages == pytest.approx(base + 2 * 1e-3 + 2 * 2e-3, rel=1e-9)
    assert both["step_s"] == pytest.approx(messages + 0.5 * 2 * (f + b), rel=1e-9)


def test_describe_names_the_stages_the_split_really_makes():
    # depth 11 over 2 ranks: stages of 6 and 5 blocks; interleaved (v = 2): 3, 3, 3, 2
    costs = _costs()
    line = pp.describe(pp.PipelineJob(2, 4, 16, 11, 8, virtual=2), INSTANT, costs)
    sizes = [int(k) for k in re.findall(r"for (\d+) blocks", line)]
    assert sizes == [6, 5, 3, 2]
    assert f"F {1e3 * costs.forward(5, 2, 16):.3f} ms" in line  # 2 rows: batch 8 in 4
    one = pp.describe(pp.PipelineJob(2, 4, 16, 11, 8, virtual=1), INSTANT, costs)
    assert [int(k) for k in re.findall(r"for (\d+) blocks", one)] == [6, 5]


def test_a_receive_costs_its_own_time_and_a_wake_up_where_it_waits():
    schedule = pipeline.build("gpipe", 2, 1)  # rank 0: F SEND_ACT RECV_GRAD B; rank 1: RECV F B SEND
    base = pipeline.simulate(schedule).makespan  # F + F + B + B = 6
    # every receive of this schedule waits (each message is the other rank's only work): two
    # receives, each + receive + wake
    assert pipeline.simulate(schedule, receive=0.25).makespan == pytest.approx(base + 0.5)
    assert pipeline.simulate(schedule, wake=0.5).makespan == pytest.approx(base + 1.0)
    # a receive whose message is already there pays no wake-up: in 1F1B with m = 2, rank 1
    # waits for micro-batch 0's activation (sent at t = 1: F0 starts at 1.5), but finds
    # micro-batch 1's (sent at t = 2) there after its F0 and B0: F1 follows B0 at once
    spans = pipeline.simulate(pipeline.build("1f1b", 2, 2), wake=0.5).spans[1]
    (f0, _, _), (_, b0_end, _), (f1, _, _) = spans[:3]
    assert f0 == pytest.approx(1.5) and f1 == pytest.approx(b0_end) == pytest.approx(4.5)


def test_sends_receives_and_wake_ups_are_read_from_the_interpreters_records():
    from microddp.predict import pipeline_messages as pm

    # GPipe, 2 ranks, 1 micro-batch: rank 0 sends the activation and receives the gradient,
    # rank 1 the other way round; a message is due latency 1 + 4 bytes / 4 B/s = 2 after its
    # send's end. Records: (action, start, end, wait start, wait end), as run_schedule writes
    send_act, recv_grad = (a for a in pipeline.build("gpipe", 2, 1).actions[0]
                           if a.kind in ("SEND_ACT", "RECV_GRAD"))
    recv_act, send_grad = (a for a in pipeline.build("gpipe", 2, 1).actions[1]
                           if a.kind in ("RECV_ACT", "SEND_GRAD"))
    step = [[(send_act, 10.0, 13.0, 13.0, 13.0),      # a send of 3
             (recv_grad, 30.0, 38.0, 31.0, 37.0)],    # gradient due 26 + 2 = 28: its wait
             # began at 31, after it was due: the message ran late, all 8 is its own time
            [(recv_act, 5.0, 17.0, 6.0, 16.0),        # due 13 + 2 = 15, waited from 6: a
             # wake-up of 16 - 15 = 1, its own time 12 - 10 = 2
             (send_grad, 25.0, 26.0, 26.0, 26.0)]]    # a send of 1
    sends, receives, wakes = pm.read_messages([step], 1.0, 4.0, 4)
    assert (sends, receives, wakes) == ([3.0, 1.0], [8.0, 2.0], [1.0])
    # a wait that ended before its message was due (the clocks' resolution) wakes no later
    # than due: 0, never a negative cost
    early = [step[0], [(recv_act, 5.0, 15.0, 6.0, 14.0), step[1][1]]]
    assert pm.read_messages([early], 1.0, 4.0, 4)[2] == [0.0]
    # charged: plain means, each slow call counted (interleaved's stalled sends are part of
    # what its step pays)
    assert pm.mean_costs([1.0] * 9 + [100.0], [2.0], [0.0] * 9 + [100.0]) == \
        pm.MessageCosts(10.9, 2.0, 10.0)
    assert pm.mean_costs([], [], []) == pm.MessageCosts(0.0, 0.0, 0.0)


def test_a_send_costs_its_sender_time_on_its_own_clock():
    schedule = pipeline.build("gpipe", 2, 2)
    base = pipeline.simulate(schedule).makespan
    # F = 1, B = 2: rank 0 runs F0, sends, F1, sends; rank 1's F1 waits for the second send,
    # which now leaves 2 x 0.5 later; rank 1's first gradient send delays rank 0's B0 by 0.5
    # and its own B1 by 0.5, and rank 0's B1 waits for the second gradient: +1 + 0.5 + 0.5
    assert pipeline.simulate(schedule, send=0.5).makespan == pytest.approx(base + 2.0)
    assert pipeline.simulate(schedule, send=0.0).makespan == base


def test_compare_uses_the_saved_pipeline_costs(tmp_path, capsys):
    calibration = tmp_path / "calibration.json"
    costs = _costs()
    save_calibration(Hardware(1e11, 1e9, 1e-5, cores=2), str(calibration), asdict(costs))
    hw, saved = load_calibration(str(calibration))
    assert hw.cores == 2 and pc.PipelineCosts(**saved) == costs
    bench = {"config": {"stages": 2, "microbatches": 4, "dim": 16, "depth": 4, "batch": 8,
                        "virtual": 2, "compute": "real", "sleep_ms": None,
                        "load_average": [1.0, 1.0, 1.0]},
             "gpipe": {"bubble_measured": 0.2, "step_ms": 4.0}}
    path = tmp_path / "pipeline.json"
    path.write_text(json.dumps(bench))
    assert cli.main(["predict", "--compare", str(path), "--calibration", str(calibration)]) == 0
    out = capsys.readouterr().out
    assert "this host's calibrated actions" in out
    assert "were not pinned" in out  # this benchmark's config does not say it pinned its ranks
    path.write_text(json.dumps({**bench, "config": {**bench["config"], "pinned": True}}))
    assert cli.main(["predict", "--compare", str(path), "--calibration", str(calibration)]) == 0
    out = capsys.readouterr().out
    assert "not pinned" not in out
    predicted = pp.predict(pp.from_bench(bench), "gpipe", hw, costs)["step_s"]
    row = re.search(r"^gpipe\s+\S+\s+\S+\s+(\S+)", out, re.M)
    assert float(row.group(1)) == pytest.approx(1e3 * predicted, abs=0.01)
    # an older calibration without pipeline costs: said, and FLOPs alone
    save_calibration(Hardware(1e11, 1e9, 1e-5, cores=2), str(calibration))
    assert cli.main(["predict", "--compare", str(path), "--calibration", str(calibration)]) == 0
    assert "has no pipeline costs" in capsys.readouterr().out
    # costs written by another version (a field renamed): one line, exit 2, not a traceback
    save_calibration(Hardware(1e11, 1e9, 1e-5, cores=2), str(calibration),
                     {**asdict(costs), "renamed": 1.0})
    assert cli.main(["predict", "--compare", str(path), "--calibration", str(calibration)]) == 2
    assert "run `microddp predict --calibrate` again" in capsys.readouterr().err


def test_the_pipeline_measurement_runs_and_fits_positive_costs():
    # the real thing, briefly (two ranks, one timed round per point): what --calibrate saves
    costs = pc.measure(1, microbatches=2, repeats=1)
    assert (costs.ranks, costs.cores) == (2, 1)  # a pipeline needs two ranks, even on one core
    assert costs.forward(4, 8, 128) > 0 and costs.backward(4, 8, 128) > 0
    assert costs.message(2**16) > 0 and costs.send > 0
    assert costs.receive >= 0 and costs.wake >= 0 and costs.tail > 0
    assert costs.last_forward >= 0 and costs.last_backward >= 0
    # each schedule's own message costs, at each calibrated width; other widths: the pooled
    assert set(costs.schedule_messages) == set(pipeline.BUILDERS)
    for name, widths in costs.schedule_messages.items():
        assert set(widths) == {str(d) for d in pc.DIMS}, name
        send, receive, wake = widths["128"]
        assert send > 0 and receive >= 0 and wake >= 0, name
        assert costs.messages(name, 128) == (send, receive, wake)
        assert costs.messages(name, 64) == (costs.send, costs.receive, costs.wake)


def test_each_schedule_pays_its_own_message_costs_and_rounds_take_their_median():
    own = {"interleaved": {"16": [5e-4, 1e-4, 2e-4]}}
    costs = _costs(send=1e-5, schedule_messages=own)
    assert costs.messages("interleaved", 16) == (5e-4, 1e-4, 2e-4)
    assert costs.messages("gpipe", 16) == costs.messages("interleaved", 32) == (1e-5, 0.0, 0.0)
    # predicted with them: interleaved's messages cost its own, GPipe's the pooled
    job = pp.PipelineJob(stages=2, microbatches=4, dim=16, depth=4, batch=8)
    for name in ("interleaved", "gpipe"):
        schedule = pipeline.build(name, 2, 4)
        cost = pp._calibrated_cost(job, pipeline.blocks_per_stage(4, schedule.stages), costs,
                                   2.0, 0.0)
        play = pipeline.simulate(schedule, cost, costs.message(2 * 16 * 4),
                                 *costs.messages(name, 16), cores=2)
        got = pp.predict(job, name, INSTANT, costs)["step_s"]
        assert got == pytest.approx(play.makespan + costs.step(2), rel=1e-9), name
    # rounds: each figure's median, a schedule's message costs term by term
    rounds = [_costs(schedule_messages={"1f1b": {"16": [a, 2 * a, 3 * a]}}) for a in (1, 5, 2)]
    assert pc.median_costs(rounds).schedule_messages == {"1f1b": {"16": [2, 4, 6]}}


def test_stalls_are_a_means_excess_over_its_trimmed_mean():
    from microddp.predict import pipeline_messages as pm

    # nine calls of 1 and one stalled call of 100: mean 10.9, trimmed mean (one cut at each
    # end) 1, so 9.9 of the mean is stall; calls all alike have none; no calls, none
    assert pm.stall_costs([1.0] * 9 + [100.0], [2.0] * 4) == pytest.approx((9.9, 0.0))
    assert pm.stall_costs([], []) == (0.0, 0.0)


def test_every_ranks_stalls_add_to_the_step_and_the_typical_calls_play_in_it():
    # GPipe on 2 ranks, 1 micro-batch: rank 0 F, SEND_ACT, RECV_GRAD, B; rank 1 RECV_ACT, F,
    # B, SEND_GRAD: two messages, each one send and one receive. Means 3 ms (send) and 2 ms
    # (receive), of which 1 ms and 0.5 ms are stalls: the play charges 2 ms a send and 1.5 a
    # receive, on the critical path all four; the step then adds both messages' stalls,
    # 2 x (1 + 0.5), the sender's and the receiver's alike, one after the other
    job = pp.PipelineJob(stages=2, microbatches=1, dim=16, depth=2, batch=2)
    means = {"gpipe": {"16": [3e-3, 2e-3, 0.0]}}
    plain = pp.predict(job, "gpipe", INSTANT, _costs(schedule_messages=means))["step_s"]
    split = pp.predict(job, "gpipe", INSTANT, _costs(
        schedule_messages=means, schedule_stalls={"gpipe": {"16": [1e-3, 5e-4]}}))["step_s"]
    compute = pp.predict(job, "gpipe", INSTANT, _costs())["step_s"]
    assert plain == pytest.approx(compute + 2 * (3e-3 + 2e-3), rel=1e-9)
    assert split == pytest.approx(compute + 2 * (2e-3 + 1.5e-3) + 2 * (1e-3 + 5e-4), rel=1e-9)
    # here every call is on the critical path, so the total is the same; where a rank has
    # slack (interleaving's both ranks busy at once), spreading a stall over the calls lets
    # the other rank absorb it, and adding it up does not: the 4-micro-batch interleaved
    # step is longer with the stall added up than with the same mean spread
    job = pp.PipelineJob(stages=2, microbatches=4, dim=16, depth=4, batch=8)
    means = {"interleaved": {"16": [3e-3, 2e-3, 0.0]}}
    spread = pp.predict(job, "interleaved", INSTANT, _costs(schedule_messages=means))
    added = pp.predict(job, "interleaved", INSTANT, _costs(
        schedule_messages=means, schedule_stalls={"interleaved": {"16": [1e-3, 5e-4]}}))
    assert added["step_s"] > spread["step_s"]
    # exactly: the typical calls (2 ms, 1.5 ms) played, then every message's stalls, each
    # send's 1 ms and each receive's 0.5 ms, once
    typical = pp.predict(job, "interleaved", INSTANT, _costs(
        schedule_messages={"interleaved": {"16": [2e-3, 1.5e-3, 0.0]}}))["step_s"]
    kinds = [a.kind for program in pipeline.build("interleaved", 2, 4).actions for a in program]
    sends, receives = sum(k in SENDS for k in kinds), sum(k in RECVS for k in kinds)
    assert sends == receives > 0
    assert added["step_s"] == pytest.approx(typical + sends * 1e-3 + receives * 5e-4, rel=1e-9)
    # an older calibration file has no stalls: it loads, and its means play as before
    saved = asdict(_costs(schedule_messages=means))
    del saved["schedule_stalls"]
    old = pc.PipelineCosts(**saved)
    assert old.stalls("interleaved", 16) == (0.0, 0.0)
    assert pp.predict(job, "interleaved", INSTANT, old)["step_s"] == spread["step_s"]


def test_interleaved_on_more_ranks_than_calibrated_pays_1f1bs_messages():
    from microddp.predict import pipeline_messages as pm

    # on 2 ranks interleaving sends activations both ways (stage 0 -> 1 from rank 0 to 1,
    # stage 1 -> 2 from rank 1 to 0); on 3 or 4 every rank sends its activations to the next
    # rank only, as GPipe, 1F1B and zero-bubble do on any number
    assert pm.both_ways(pipeline.build("interleaved", 2, 4))
    assert not any(pm.both_ways(pipeline.build("interleaved", p, 4)) for p in (3, 4))
    assert not any(pm.both_ways(pipeline.build(n, 2, 4)) for n in ("gpipe", "1f1b", "zero-bubble"))
    # so interleaved calibrated on 2 ranks and run on 4 pays 1F1B's message costs; on 2 its
    # own; calibrated on 4 (a 4-core host), its own
    four = pipeline.build("interleaved", 4, 8)
    assert pm.costs_from("interleaved", four, 2) == "1f1b"
    assert pm.costs_from("interleaved", four, 4) == "interleaved"
    assert pm.costs_from("interleaved", pipeline.build("interleaved", 2, 8), 2) == "interleaved"
    assert pm.costs_from("gpipe", pipeline.build("gpipe", 4, 8), 2) == "gpipe"
    own = {"interleaved": {"16": [5e-4, 1e-4, 2e-4]}, "1f1b": {"16": [1e-4, 2e-5, 3e-5]}}
    job = pp.PipelineJob(stages=4, microbatches=8, dim=16, depth=8, batch=16)
    got = pp.predict(job, "interleaved", INSTANT, _costs(schedule_messages=own))
    as_1f1b = pp.predict(job, "interleaved", INSTANT, _costs(
        schedule_messages={"interleaved": own["1f1b"], "1f1b": own["1f1b"]}))
    assert got["step_s"] == as_1f1b["step_s"]
    # and the prediction says so; on 2 ranks nothing is said
    assert "interleaved pays 1f1b's here" in pp.describe(job, INSTANT, _costs())
    two = pp.PipelineJob(stages=2, microbatches=8, dim=16, depth=8, batch=16)
    assert "pays" not in pp.describe(two, INSTANT, _costs())
