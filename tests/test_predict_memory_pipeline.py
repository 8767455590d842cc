"""`microddp predict` beyond data parallelism: the ZeRO paper's memory model (its Fig. 1 figures
for 7.5B parameters on 64 ranks) and a pipeline step played from the schedule with costs."""

import json
import re

import pytest

from microddp import commands as cli
from microddp import pipeline
from microddp.predict import memory
from microddp.predict import pipeline as pp
from microddp.predict.step import HARDWARE, Hardware


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
