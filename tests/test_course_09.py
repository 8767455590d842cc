"""Chapter 9's scripts run as a learner runs them and print what the chapter promises: 16
bytes per parameter under plain DP with Adam, each stage's memory cut to 1/N where the stage
says, the same parameters as plain DP, and a small model on which sharding saves ~nothing."""

import re
from pathlib import Path

import pytest

from script_runner import output

ROOT = Path(__file__).resolve().parents[1]
CHAPTER = ROOT / "course" / "09_zero"
ROW = re.compile(r"^(plain DP|ZeRO-\d)\s+" + r"\s+".join([r"(\S+) KiB"] * 5)
                 + r"\s+(-|\S+ \S+)$", re.M)


def run(script: str, *args: str) -> str:
    return output(CHAPTER / script, *args)


def table(out: str) -> dict[str, tuple[list[float], str]]:
    return {m[0]: ([float(v) for v in m[1:6]], m[6]) for m in ROW.findall(out)}


def test_sixteen_bytes_per_parameter_measured():
    out = run("bytes_per_param.py")
    assert re.search(r"parameters\s+\d+ bytes =  4\.00 bytes per parameter", out)
    assert re.search(r"gradients\s+\d+ bytes =  4\.00 bytes per parameter", out)
    assert re.search(r"optimizer state\s+\d+ bytes =  8\.00 bytes per parameter", out)
    assert re.search(r"total\s+16\.00 bytes per parameter", out)
    # the ZeRO paper's 7.5B parameters on 64 ranks: 120 GB per rank for plain DP
    assert "plain DP:  120.0 GB per rank" in out and "ZeRO-3  :    1.9 GB per rank" in out


@pytest.mark.slow  # the chapter's whole comparison run
@pytest.mark.parametrize("n", [2, 3])
def test_every_stage_cuts_what_it_says_and_trains_like_dp(n):
    rows = table(run("compare.py", "-n", str(n)))
    assert list(rows) == ["plain DP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
    (p, g, o, _, sent), _ = rows["plain DP"]
    assert o == pytest.approx(2 * p, rel=0.01)
    # ZeRO-1 keeps the full gradients; its averaged shard arrives beside them in backward.
    # ZeRO-1/2's shard is a view of the full parameters: no second copy of it
    expect = {"ZeRO-1": (p, g + g / n, o / n, 2), "ZeRO-2": (p, g / n, o / n, 2),
              "ZeRO-3": (p / n, g / n, o / n, 3)}
    for name, (params, grads, opt, factor) in expect.items():
        (mp, mg, mo, _, ms), same = rows[name]
        assert float(same.split()[0]) <= 1e-5 and same.endswith("True"), name
        assert (mp, mg, mo) == pytest.approx((params, grads, opt), rel=0.01), name
        assert ms == pytest.approx(sent * factor / 2, rel=0.01), name


@pytest.mark.slow  # the chapter's stage scripts end to end, one per stage (tests/test_zero_exact.py proves the stages in the default set)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_each_stage_script_matches_dp(stage):
    out = run(f"zero{stage}.py")
    assert table(out)[f"ZeRO-{stage}"][1].endswith(" True")
    ours, dp = re.search(r"parameter checksum (\S+) \(plain DP: (\S+)\)", out).groups()
    assert float(ours) == pytest.approx(float(dp), abs=1e-4)
    if stage == 2:  # the packed gradients in flight: at least one bucket's, at most all of them
        held, biggest, every, full = map(float, re.search(
            r"(\d+) buckets of .*held at once during backward\s+(\S+) KiB; largest bucket's\s+"
            r"(\S+) KiB, all buckets'\s+(\S+) KiB, the full gradient\s+(\S+) KiB", out
        ).groups()[1:])
        assert biggest <= held <= every < full


def test_on_a_small_model_sharding_saves_next_to_nothing():
    out = run("when_it_pays.py")
    rows = re.findall(r"^\s*(\d+)\s+\d+\s+(\S+) MiB\s+(\S+) MiB\s+(\S+) MiB\s+(\d+) MiB\s+"
                      r"(\S+)%\s+(\S+)x$", out, re.M)
    assert [int(r[0]) for r in rows] == [32, 256, 768]
    saved = [float(r[5]) for r in rows]
    assert saved[0] < 0.1  # the small model: a hundredth of a percent of the process
    assert saved[0] < saved[1] < saved[2]
    for _, dp, z3, *_ in rows:  # ZeRO-3 halves the model state on 2 ranks
        assert float(z3) == pytest.approx(float(dp) / 2, abs=0.01)
    assert all(r[6] == "1.50" for r in rows)  # and sends 1.5x plain DP's bytes
