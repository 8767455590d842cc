"""The cost model against hand calculation, and the `microddp predict` command."""

import json
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import microddp as mdp
from microddp import commands as cli
from microddp.model import FullMLP
from microddp.predict import step as predict
from microddp.predict.calibrate import fit_alpha_beta

HW = predict.Hardware(flops=1e12, bandwidth=1e9, latency=1e-5)


def test_allreduce_formulas_by_hand():
    n = 1e6
    assert predict.allreduce_time(n, 4, HW, "ring") == pytest.approx(6 * (1e-5 + 2.5e5 / 1e9))
    # recursive doubling on 5 ranks: 2 full exchanges among 4, plus a fold in and a fold out
    assert predict.allreduce_time(n, 5, HW, "tree") == pytest.approx((2 + 2) * (1e-5 + 1e-3))
    assert predict.allreduce_time(n, 4, HW, "naive") == pytest.approx(6 * (1e-5 + 1e-3))
    assert predict.allreduce_time(n, 1, HW, "ring") == 0.0
    with pytest.raises(predict.MicroDDPError, match="unknown algorithm 'star'"):
        predict.allreduce_time(n, 2, HW, "star")


def test_fullmlp_parameter_count_matches_the_model():
    for dim, depth in ((8, 0), (16, 3), (512, 8)):
        m = predict.fullmlp(dim, depth)
        assert m.params == sum(p.numel() for p in FullMLP(dim, depth).parameters())
        assert m.flops_per_sample == 6 * m.params


def test_step_with_buckets_by_hand():
    # 2.5e6 params x 4 B = 10 MB -> 4 buckets of 2.5 MB at bucket_mb = 10 MB / 4 / 2**20
    model = predict.Model(params=2.5e6, flops_per_sample=6e6)
    r = predict.predict(model, HW, 2, 1000, bucket_mb=2.5e6 / 2**20)
    compute = 6e9 / 1e12  # 6 ms: forward 2 ms, backward 4 ms
    per = 2 * (1e-5 + 1.25e6 / 1e9)  # ring, 2 ranks, 2.5 MB
    assert r["buckets"] == 4 and r["compute_s"] == pytest.approx(compute)
    assert r["comm_s"] == pytest.approx(4 * per)
    # buckets ready at 3, 4, 5, 6 ms; each takes 2.52 ms on the link, one after another
    end = 3e-3
    for i in range(4):
        end = max(end, 3e-3 + 1e-3 * i) + per
    assert r["exposed_overlap_s"] == pytest.approx(end - 6e-3)
    assert r["step_s"] == pytest.approx(compute + end - 6e-3)
    no = predict.predict(model, HW, 2, 1000, bucket_mb=2.5e6 / 2**20, overlap=False)
    assert no["step_s"] == pytest.approx(compute + 4 * per)
    assert r["comm_comp_ratio"] == pytest.approx(4 * per / compute)


@settings(max_examples=100, deadline=None)
@given(st.floats(1e5, 1e10), st.integers(1, 4096), st.floats(1, 512), st.floats(0.5, 100))
def test_overlap_never_hurts_and_hides_at_most_backward(params, world, batch, bucket_mb):
    model = predict.Model(params, 6 * params)
    r = predict.predict(model, HW, world, batch, bucket_mb=bucket_mb)
    assert 0 <= r["exposed_overlap_s"] <= r["exposed_no_overlap_s"] * (1 + 1e-9)
    backward = 2 * r["compute_s"] / 3
    assert r["exposed_overlap_s"] >= r["comm_s"] - backward - 1e-12
    assert 0 < r["efficiency"] <= 1


def test_scaling_speedup_and_efficiency():
    model = predict.Model(1e6, 6e6)
    weak = predict.scaling(model, HW, [1, 2, 8], 64)
    assert [r["batch"] for r in weak] == [64, 64, 64]
    assert weak[0]["speedup"] == 1 and weak[0]["efficiency"] == 1
    for r in weak:
        assert r["speedup"] == pytest.approx(r["world"] * r["compute_s"] / r["step_s"])
        assert r["efficiency"] == pytest.approx(r["speedup"] / r["world"])
    strong = predict.scaling(model, HW, [1, 4], 64, strong=True)
    assert strong[1]["batch"] == 16
    assert strong[1]["speedup"] == pytest.approx(strong[0]["step_s"] / strong[1]["step_s"])


def test_ranks_beyond_the_cores_are_bound_by_the_hosts_cpu_work():
    cpu = predict.Hardware(1e10, 1e9, 1e-5, cores=2, memory=1e10, comm_cpu=0.5)
    model = predict.Model(1e6, 6e6)
    two = predict.predict(model, cpu, 2, 10, local_ranks=2)
    four = predict.predict(model, cpu, 4, 10, local_ranks=4)
    # two ranks, two cores: each runs on its own core; no CPU bound beyond the chain
    assert two["compute_s"] == pytest.approx(6e7 / (1e10 / 2))
    assert two["cpu_bound_s"] == 0 and two["step_s"] == two["chain_s"]
    # four ranks: each computes at one core's rate when it runs, its collectives take the
    # time of the algorithm ...
    assert four["compute_s"] == pytest.approx(two["compute_s"])
    assert four["comm_s"] == pytest.approx(predict.allreduce_time(4e6, 4, cpu))
    # ... but the cores are shared: all ranks' CPU work (only the busy half of communication,
    # comm_cpu=0.5) over 2 cores
    busy = four["compute_s"] + four["copies_s"] + 0.5 * four["comm_s"]
    assert four["cpu_bound_s"] == pytest.approx(4 * busy / 2)
    assert four["step_s"] == pytest.approx(max(four["chain_s"], four["cpu_bound_s"]))
    assert four["step_s"] > four["chain_s"]  # here the host is the limit
    waiting = predict.predict(model, replace(cpu, comm_cpu=0.0), 4, 10, local_ranks=4)
    assert waiting["cpu_bound_s"] < four["cpu_bound_s"]  # waiting costs the host nothing


def test_one_rank_computes_at_its_own_rate_not_the_whole_hosts():
    # host: 1e10 FLOP/s with a rank per core; one rank alone, with both cores' threads, 6e9
    cpu = predict.Hardware(1e10, 1e9, 1e-5, cores=2, memory=1e10, rank_flops=6e9)
    model = predict.Model(1e6, 6e6)
    one = predict.predict(model, cpu, 1, 10, local_ranks=1)
    assert one["compute_s"] == pytest.approx(6e7 / 6e9)
    two = predict.predict(model, cpu, 2, 10, local_ranks=2)
    assert two["compute_s"] == pytest.approx(6e7 / (1e10 / 2))  # a core each: rank_flops unused
    # an old calibration (no rank_flops) keeps the old reading: the host's whole rate
    old = predict.predict(model, replace(cpu, rank_flops=0.0), 1, 10)
    assert old["compute_s"] == pytest.approx(6e7 / 1e10)


def _fixed_pipeline_costs(monkeypatch):
    """--calibrate also times pipeline actions in a pipeline of one rank per core, three
    rounds: tests of the rest of it replace that with fixed figures, a width's own fit
    included (test_predict_memory_pipeline.py runs it)."""
    from microddp.predict import calibrate

    costs = calibrate.PipelineCosts(
        forward_fixed=1e-4, forward_block=2e-5, forward_weight=1e-9, forward_rate=5e10,
        backward_fixed=2e-4, backward_block=4e-5, backward_weight=2e-9, backward_rate=4e10,
        step_fixed=3e-4, step_block=1e-5, last_forward=3e-5, last_backward=6e-5, tail=1.2,
        latency=1e-4, bandwidth=1e9, send=2e-5, receive=3e-5, wake=2e-4, ranks=2, cores=2,
        forward_widths={"128": [1e-5, 2e-5, 3e10]}, backward_widths={"128": [2e-5, 4e-5, 3e10]})
    monkeypatch.setattr(calibrate, "measure_pipeline", lambda *a: costs)
    return costs


def test_calibration_saves_and_uses_the_rate_of_one_rank_alone(tmp_path, monkeypatch, capsys):
    from microddp.predict import calibrate

    assert calibrate.rank_rate(64, 2, 8, repeats=3) > 0  # a real spawned rank, briefly
    monkeypatch.setattr(calibrate, "host_rates", lambda *a: (1e10, 1e10))
    monkeypatch.setattr(calibrate, "rank_rate", lambda *a: 6e9)
    monkeypatch.setattr(calibrate, "alpha_beta", lambda *a: (1e-5, 1e9, 0.5, "ring"))
    monkeypatch.setattr(calibrate, "measured_step", lambda *a: 0.01)
    costs = _fixed_pipeline_costs(monkeypatch)
    path = tmp_path / "cal.json"
    assert cli.main(["predict", "--calibrate", "--verify", "1", "--calibration", str(path),
                     "--dim", "64", "--depth", "2", "--batch", "800"]) == 0
    saved, pipeline_costs = predict.load_calibration(str(path))
    assert saved.rank_flops == 6e9 and saved.flops == 1e10
    assert calibrate.PipelineCosts(**pipeline_costs) == costs  # the median of 3 equal rounds
    row = next(line.split() for line in capsys.readouterr().out.splitlines()
               if line.split()[:1] == ["1"])
    want = predict.fullmlp(64, 2).flops_per_sample * 800 / 6e9  # one rank: its own rate
    assert float(row[1]) == pytest.approx(1e3 * want, rel=0.01)  # not 1e10: 40% less


def measure_cpu_share(world):
    from microddp.predict.calibrate import _allreduce_times

    return _allreduce_times(world, [1 << 12, 1 << 20], 5)


def test_flops_overrides_a_calibrated_hosts_one_rank_rate(tmp_path, capsys):
    path = tmp_path / "cal.json"
    predict.save_calibration(predict.Hardware(1e11, 1e9, 1e-5, cores=2, rank_flops=6e10),
                             str(path))

    def one_rank_ms(*extra):
        assert cli.main(["predict", "--hardware", "calibrated", "--calibration", str(path),
                         "--world", "1", *extra]) == 0
        out = capsys.readouterr().out
        return out, float(next(line.split()[2] for line in out.splitlines()  # compute ms
                               if line.split()[:1] == ["1"]))

    out, measured = one_rank_ms()
    assert "(6e+10 for one rank alone)" in out
    out, stated = one_rank_ms("--flops", "1e12")
    assert "one rank alone" not in out
    assert stated == pytest.approx(measured * 6e10 / 1e12, rel=0.02)


def test_calibration_measures_the_cpu_share_of_an_all_reduce():
    for times, busy, path in mdp.spawn(measure_cpu_share, 2, timeout=60):
        assert len(times) == 2 and min(times) > 0
        assert 0 < busy < 4  # CPU-seconds per second: the waits spin a while, then sleep
        assert path == "shm"  # one host: comms.all_reduce takes shared memory


def test_bucket_copies_are_three_passes_over_the_gradients():
    hw = predict.Hardware(1e12, 1e9, 1e-5, memory=2e9, cores=2)
    model = predict.Model(1e6, 6e6)  # 4 MB of gradients
    assert predict.predict(model, hw, 1, 8)["copies_s"] == 0  # no DDP, no buckets
    two = predict.predict(model, hw, 2, 8, local_ranks=2)
    assert two["copies_s"] == pytest.approx(3 * 4e6 / (2e9 / 2))
    assert two["step_s"] == pytest.approx(two["compute_s"] + two["copies_s"]
                                          + two["exposed_overlap_s"])


def test_verdict_names_the_limit():
    model = predict.MODELS["bert-large"]
    rows = predict.scaling(model, predict.HARDWARE["a100-ib"], [1, 2, 4, 8, 16], 8)
    first_bad = next(r["world"] for r in rows if r["efficiency"] < 0.5)
    text = predict.verdict(rows)
    assert text.startswith(f"data parallelism stops paying at {first_bad} ranks")
    good = predict.scaling(model, predict.HARDWARE["h100-nvlink"], [1, 8], 64)
    assert predict.verdict(good).startswith("data parallelism pays up to 8 ranks")


def test_fit_alpha_beta_recovers_a_ring():
    sizes = [1e3, 1e5, 1e6, 4e6]
    alpha, bandwidth, n = 3e-5, 2e9, 4  # beta = 1 / bandwidth seconds per byte
    times = [2 * (n - 1) * (alpha + s / n / bandwidth) for s in sizes]
    a, b = fit_alpha_beta(sizes, times, n)
    assert a == pytest.approx(alpha) and b == pytest.approx(bandwidth)


def test_cli_table_and_errors(capsys, tmp_path):
    assert cli.main(["predict", "--model", "gpt2", "--hardware", "h100-ib",
                     "--world", "1", "64", "--latency", "1e-5"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip().split(" ")[0].isdigit()]
    assert [r[0] for r in rows] == ["1", "64"]
    hw = predict.Hardware(400e12, 50e9, 1e-5, memory=3e12)
    expect = predict.scaling(predict.MODELS["gpt2"], hw, [1, 64], 32)[1]
    assert float(rows[1][6]) == pytest.approx(1e3 * expect["step_s"], abs=1e-3)
    assert "latency overridden" in out
    assert cli.main(["predict", "--hardware", "tpu"]) == 2
    assert "unknown hardware 'tpu'" in capsys.readouterr().err
    assert cli.main(["predict", "--hardware", "calibrated", "--calibration",
                     str(tmp_path / "none.json")]) == 2
    assert "run `microddp predict --calibrate` first" in capsys.readouterr().err
    (tmp_path / "c.json").write_text(json.dumps({"flops": 1e10, "bandwidth": 1e9,
                                                 "latency": 1e-4, "note": "x", "cores": 2}))
    assert cli.main(["predict", "--hardware", "calibrated", "--calibration",
                     str(tmp_path / "c.json"), "--world", "2"]) == 0
    assert cli.main(["predict", "--list"]) == 0 and "a100-nvlink" in capsys.readouterr().out


def test_cli_says_what_a_sample_is(capsys):
    """--params alone makes a sample one token; --tokens gives it a sequence's FLOPs."""
    args = ["predict", "--hardware", "h100-ib", "--world", "1", "8", "64", "512", "4096",
            "--algorithm", "tree"]
    assert cli.main([*args, "--params", "1.5e9"]) == 0
    out = capsys.readouterr().out
    assert "custom, a sample is ONE token (give --tokens for sequences), 1.5e+09 parameters, " \
           "9e+09 FLOP/sample" in out
    assert cli.main([*args, "--params", "1.5e9", "--tokens", "1024"]) == 0
    tokens = capsys.readouterr().out
    assert "custom, 1024 tokens per sample, 1.5e+09 parameters, 9.22e+12 FLOP/sample" in tokens
    assert "bandwidth 5e+10 B/s (1/beta), latency 20 us per message (alpha)" in tokens
    assert cli.main([*args, "--model", "gpt2-xl"]) == 0  # the same model, from its preset
    preset = capsys.readouterr().out
    table = [line for line in tokens.splitlines() if line.strip()[:1].isdigit()]
    assert table == [line for line in preset.splitlines() if line.strip()[:1].isdigit()]
    # what chapter 7 says of this example: 99% at 8 ranks, the tree keeps 42% at 4096
    assert table[1].split()[0] == "8" and table[1].endswith(" 99%")
    assert table[-1].split()[0] == "4096" and table[-1].endswith(" 42%")
    assert float(table[-1].split()[2]) == pytest.approx(737.280)  # 0.74 s of compute
    assert "stops paying at 4096 ranks" in tokens
    assert cli.main([*args, "--params", "1.5e9", "--flops-per-sample", "9.216e12"]) == 0
    assert "FLOPs per sample as given, 1.5e+09 parameters, 9.22e+12" in capsys.readouterr().out
    for bad, msg in ((["--model", "gpt2", "--tokens", "8"], "describe a --params model"),
                     (["--params", "1e9", "--tokens", "8", "--flops-per-sample", "1"],
                      "not both"),
                     (["--params", "1e9", "--tokens", "0"], "--tokens must be positive")):
        assert cli.main([*args, *bad]) == 2
        assert msg in capsys.readouterr().err


def test_scaling_bench_arithmetic_and_verdicts():
    from microddp.bench import scaling

    def row(mode, n, per_rank, step, compute, exposed, engine="overlap"):
        return {"mode": mode, "ranks": n, "engine": engine if n > 1 else "1 process",
                "batch_per_rank": per_rank, "step_ms": step, "samples_per_s": n * per_rank / step,
                "compute_ms": compute, "exposed_comm_ms": exposed,
                "other_ms": step - compute - exposed}

    rows = [row("strong", 1, 64, 100, 100, 0), row("strong", 2, 32, 80, 50, 30),
            row("strong", 4, 16, 200, 40, 150), row("weak", 1, 64, 100, 100, 0),
            row("weak", 2, 64, 110, 100, 10), row("weak", 4, 64, 300, 260, 40)]
    scaling.add_speedup(rows)
    assert [round(r["speedup"], 4) for r in rows] == [1, 1.25, 0.5, 1, 1.8182, 1.3333]
    assert [round(r["efficiency"], 4) for r in rows] == [1, 0.625, 0.125, 1, 0.9091, 0.3333]
    text = scaling.verdicts(rows, grad_mb=8.0, cores=2)
    assert text[0].startswith("strong, 4 ranks, overlap: DDP is not worth it (speedup 0.50, "
                              "efficiency 12%): exposed communication (150.0 ms for 8.0 MB")
    assert text[1].startswith("weak, 4 ranks, overlap: DDP is barely worth it (speedup 1.33, "
                              "efficiency 33%): compute per rank took 260.0 ms where one "
                              "process needed 100.0 ms")
    assert text[2].startswith("note: more ranks than this host's 2 cores")
    assert len(text) == 3 and len(scaling.table(rows).splitlines()) == 7
    with pytest.raises(predict.MicroDDPError, match="1-rank baseline"):
        scaling.add_speedup([row("weak", 2, 64, 1, 1, 0)])
    small = scaling.verdicts(rows, grad_mb=2208 / 2**20, cores=8)
    assert "(150.0 ms for 2.2 KB of gradients)" in small[0]


def test_scaling_bench_names_sizes_for_people():
    from microddp.bench import scaling

    assert [scaling.size_text(n) for n in (100, 2208, 8 * 2**20, 3 * 2**30)] == [
        "100 B", "2.2 KB", "8.0 MB", "3.0 GB"]
    # FullMLP(16, 2): two 16x16 layers and a 16->2 head, with biases, in float32
    assert scaling.gradient_bytes(16, 2) == (2 * 272 + 34) * 4
    assert scaling.size_text(scaling.gradient_bytes(16, 2)) == "2.3 KB"


def test_calibrate_reports_its_spread_warns_when_wide_and_then_predicts(tmp_path, monkeypatch,
                                                                       capsys):
    from microddp.predict import calibrate

    _fixed_pipeline_costs(monkeypatch)
    rates = iter([(1e10, 4e10), (3e10, 4e10), (2e10, 4e10)])  # a host whose load changed
    monkeypatch.setattr(calibrate, "host_rates", lambda *a: next(rates))
    monkeypatch.setattr(calibrate, "rank_rate", lambda *a: 6e9)
    monkeypatch.setattr(calibrate, "alpha_beta", lambda *a: (1e-5, 1e9, 0.5, "ring"))
    path = tmp_path / "cal.json"
    assert cli.main(["predict", "--calibrate", "--calibration", str(path), "--dim", "64",
                     "--depth", "2", "--world", "1", "2"]) == 0
    out = capsys.readouterr().out
    compute = next(line.split() for line in out.splitlines() if line.startswith("  compute"))
    assert compute == ["compute", "1e+10", "/", "2e+10", "/", "3e+10", "FLOP/s", "spread",
                       "3.00x"]
    assert "spread 1.00x" in next(line for line in out.splitlines() if "one rank alone" in line)
    warning = next(line for line in out.splitlines() if line.startswith("warning:"))
    assert warning.startswith("warning: compute varied by more than 1.5x between rounds")
    # ... and then the prediction, on the median figures just measured
    assert "assumed hardware: this host, measured by microddp predict --calibrate: 2e+10 FLOP/s" \
        in out
    rows = [line.split()[0] for line in out.splitlines()[-3:-1]]
    assert rows == ["1", "2"]


def test_a_steady_calibration_gives_no_warning(tmp_path, monkeypatch, capsys):
    from microddp.predict import calibrate

    _fixed_pipeline_costs(monkeypatch)
    monkeypatch.setattr(calibrate, "host_rates", lambda *a: (1e10, 4e10))
    monkeypatch.setattr(calibrate, "rank_rate", lambda *a: 6e9)
    monkeypatch.setattr(calibrate, "alpha_beta", lambda *a: (1e-5, 1e9, 0.5, "ring"))
    assert cli.main(["predict", "--calibrate", "--calibration", str(tmp_path / "c.json"),
                     "--world", "4"]) == 0
    assert "warning" not in capsys.readouterr().out


def test_calibrate_refuses_another_hardware_preset(capsys):
    assert cli.main(["predict", "--calibrate", "--hardware", "a100-ib"]) == 2
    assert "drop --hardware a100-ib" in capsys.readouterr().err


def test_across_hosts_counts_the_rounds_of_flat_and_hierarchical():
    from microddp.predict import Hardware, across_hosts

    intra, inter = Hardware(1.0, 1e9, 1e-5), Hardware(1.0, 1e8, 1e-4)
    t = across_hosts(1e6, hosts=2, local=2, intra=intra, inter=inter)
    # flat ring over 4 ranks, every one of its 6 steps on the link between hosts: n/4 a step
    assert t["flat_s"] == pytest.approx(6 * (1e-4 + 2.5e5 / 1e8))
    # reduce-scatter and all-gather of n over 2 ranks inside, 2 steps of n/2 between hosts
    assert t["hierarchical_s"] == pytest.approx(2 * (1e-5 + 5e5 / 1e9) + 2 * (1e-4 + 5e5 / 1e8))
    # one rank per host: the hierarchy is the flat ring
    one = across_hosts(1e6, hosts=4, local=1, intra=intra, inter=inter)
    assert one["flat_s"] == pytest.approx(one["hierarchical_s"])


@settings(max_examples=200, deadline=None)
@given(st.floats(1e-4, 1.0), st.floats(1e-4, 1.0), st.floats(1e-6, 1.0), st.integers(1, 300))
def test_the_buckets_closed_form_equals_playing_them_one_by_one(forward, backward, per, k):
    """predict no longer loops over buckets (--params 1e14 ran for minutes): its closed form
    must be the loop's result for every bucket count."""
    end = 0.0
    for i in range(k):
        end = max(end, forward + backward * (i + 1) / k) + per
    model = predict.Model(params=k * 2**20 / 4, flops_per_sample=3 * (forward + backward))
    hw = predict.Hardware(flops=1.0, bandwidth=1e30, latency=per / 2)  # a 2-rank ring: 2 alphas
    r = predict.predict(model, hw, 2, 1.0, bucket_mb=1.0)
    assert r["buckets"] == k
    f = r["compute_s"] / 3
    replay = 0.0
    for i in range(k):
        replay = max(replay, f + 2 * f * (i + 1) / k) + r["comm_s"] / k
    assert r["exposed_overlap_s"] == pytest.approx(max(0.0, replay - 3 * f), rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("args,message", [
    (["--params", "inf"], "--params must be positive, got inf"),
    (["--params", "nan"], "--params must be positive, got nan"),
    (["--params", "1e300"], "--params 1e+300 is beyond any model"),
    (["--bucket-mb", "0"], "--bucket-mb must be positive, got 0"),
    (["--bucket-mb", "nan"], "--bucket-mb must be positive, got nan"),
    (["--bucket-mb", "-1"], "--bucket-mb must be positive, got -1"),
    (["--local-ranks", "0"], "--local-ranks and --grad-bytes must be at least 1"),
    (["--batch", "inf"], "--batch must be positive, got inf"),
    (["--latency", "inf"], "--latency must be positive, got inf"),
])
def test_bad_numbers_are_one_line_and_exit_2(capsys, args, message):
    assert cli.main(["predict", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_huge_models_are_predicted_at_once(capsys):
    assert cli.main(["predict", "--params", "1e14", "--world", "1", "4096"]) == 0
    assert "parameters" in capsys.readouterr().out


@pytest.mark.parametrize("text,why", [('{"flops": 1e10,', "Expecting"),
                                      ('[1, 2]', "is not a calibration"),
                                      ('{"flops": -1, "bandwidth": 1e9, "latency": 1e-4}',
                                       "flops is -1"),
                                      ('{"flops": 1e10}', "missing")])
def test_a_malformed_calibration_is_one_line(capsys, tmp_path, text, why):
    (tmp_path / "c.json").write_text(text)
    assert cli.main(["predict", "--hardware", "calibrated", "--calibration",
                     str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a calibration this microddp can read" in err[0] \
        and why in err[0], err
