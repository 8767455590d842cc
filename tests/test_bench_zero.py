"""`microddp bench zero` on 2 ranks: what each contender holds, measured from live tensors,
is what its stage shards (times are printed and never asserted)."""

import json
import subprocess
import sys

import pytest

from microddp import commands as cli
from microddp.bench import zero as bench_zero


def test_memory_per_rank_of_each_contender_is_what_it_shards(tmp_path):
    n, out = 2, tmp_path / "z"
    done = subprocess.run([sys.executable, "-m", "microddp", "bench", "zero", "--ranks", str(n),
                           "--dim", "32", "--depth", "2", "--repeats", "2", "--warmup", "1",
                           "--no-peak", "--out", str(out)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "zero1/torch-zero1: step time" in done.stdout
    doc = json.loads((out / "zero.json").read_text())
    assert (out / "zero.png").stat().st_size > 0
    (res,) = doc["results"]
    assert res["ranks"] == n and set(res["contenders"]) == set(bench_zero.CONTENDERS)
    p = doc["config"]["params"] * 4  # fp32 bytes of the whole model

    def ranks(name, key):
        return [m[key] for m in res["contenders"][name]["memory_per_rank"]]

    assert ranks("dp", "params") == [p] * n and ranks("dp", "grads") == [p] * n
    assert ranks("dp", "optimizer_state") == [pytest.approx(2 * p, rel=0.01)] * n
    for name in ("zero1", "zero2", "zero3", "torch-zero1", "fsdp2", "zero-optimizer",
                 "fully-shard"):
        state = ranks(name, "optimizer_state")
        # sharded: the ranks' states add up to one copy; every rank holds less than DP's
        assert sum(state) == pytest.approx(2 * p, rel=0.02), name
        assert max(state) < 2 * p, name
    for stage in ("zero2", "zero3"):
        assert ranks(stage, "grads") == [pytest.approx(p / n, rel=0.02)] * n
    for name in ("zero3", "fsdp2", "fully-shard"):
        assert sum(ranks(name, "params")) == pytest.approx(p, rel=0.02), name
    assert ranks("fully-shard", "grads") == [pytest.approx(p / n, rel=0.02)] * n
    for name in ("torch-zero1", "zero-optimizer"):
        assert ranks(name, "grads") == [p] * n  # ZeRO-1 keeps full gradients
    assert set(res["versus_torch"]) == {"zero1/torch-zero1", "zero3/fsdp2",
                                        "zero-optimizer/torch-zero1", "fully-shard/fsdp2"}
    assert all("peak_rss_growth_per_rank" not in row for row in res["contenders"].values())


@pytest.mark.slow  # each contender again, alone in fresh ranks
def test_peak_memory_is_measured_per_rank_for_each_contender(tmp_path):
    out = tmp_path / "p"
    done = subprocess.run([sys.executable, "-m", "microddp", "bench", "zero", "--ranks", "2",
                           "--contenders", "zero-optimizer", "torch-zero1", "--dim", "256",
                           "--depth", "4", "--repeats", "2", "--warmup", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    (res,) = json.loads((out / "zero.json").read_text())["results"]
    for name, row in res["contenders"].items():
        peaks = row["peak_rss_growth_per_rank"]
        # at least the model's parameters (256 x 256 x 4 layers, fp32) were built and held
        assert len(peaks) == 2 and all(b >= 4 * 256 * 256 * 4 for b in peaks), (name, peaks)


BAD = [
    (["--ranks", "1"], "--ranks must be at least 2, got 1"),
    (["--contenders", "zero4"], "unknown contender(s) zero4"),
    (["--contenders", "dp", "dp"], "--contenders gives dp more than once"),
    (["--repeats", "0"], "--repeats must be at least 1, got 0"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    assert cli.main(["bench", "zero", *args]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and message in lines[0], lines


def test_the_a_a_control_is_compared_with_torch_zero1_when_asked_for():
    names = ["zero1", "torch-zero1", bench_zero.CONTROL]
    mem = {k: 8 for k in bench_zero.KEYS}
    ranks = [{"times": {n: [0.01, 0.02, 0.03] for n in names},
              "memory": {n: mem for n in names}} for _ in range(2)]
    res = bench_zero.summarize(2, ranks, names)
    assert set(res["versus_torch"]) == {"zero1/torch-zero1",
                                        f"{bench_zero.CONTROL}/torch-zero1"}
    text = bench_zero.table([res], 10)
    assert f"    2 {bench_zero.CONTROL} " in text  # its name fits its column
    assert f"{bench_zero.CONTROL}/torch-zero1: step time" in text
