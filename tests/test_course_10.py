"""Chapter 10's scripts run as a learner runs them and print what the chapter claims: S=0 has
staleness 0 and one update per global batch, async one update per gradient, SSP histograms
never pass their bound, backup workers use N-b gradients per step and drop the late ones."""

import re
from pathlib import Path

import pytest

from script_runner import output

ROOT = Path(__file__).resolve().parents[1]
CHAPTER = ROOT / "course" / "10_async"


def run(script: str, *args: str) -> str:
    return output(CHAPTER / script, *args)


def test_sync_vs_async_table():
    out = run("sync_vs_async.py")
    rows = re.findall(r"^(S=0|async)\s+(none|rank 2 x4)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)$",
                      out, re.M)
    assert [(m, s) for m, s, *_ in rows] == [("S=0", "none"), ("async", "none"),
                                             ("S=0", "rank 2 x4"), ("async", "rank 2 x4")]
    for mode, _, updates, _, acc, stale in rows:
        assert int(updates) == (150 if mode == "S=0" else 300)
        # 2 workers: an async gradient is about 1 version old on average (the other worker
        # pushes once while it computes), whatever their speeds; the first ones are fresher
        if mode == "S=0":
            assert float(stale) == 0.0
        else:
            assert 0.9 <= float(stale) <= 1.0
        assert 0.5 < float(acc) <= 1.0
    assert len(re.findall(r"^async / sync samples/s, .*: \d+\.\d\d$", out, re.M)) == 2


@pytest.mark.slow  # the chapter's staleness runs end to end (tests/test_ps_train.py proves the bound in the default set)
def test_staleness_histograms_stay_within_their_bound():
    out = run("staleness.py")
    for bound in (1, 3):
        assert int(re.search(rf"^S={bound}: max staleness (\d+)", out, re.M).group(1)) <= bound
    blocks = re.split(r"^(?=\S)", out, flags=re.M)
    for block in (b for b in blocks if "max staleness" in b):
        counts = [int(c) for c in re.findall(r"^\s+\d+ \| #+\s+(\d+)$", block, re.M)]
        # Every applied gradient counted once. The run stops at the first update that reaches
        # 300; an update applies every gradient it holds, so under SSP the last one may take
        # one more than needed (2 workers: at most 1 more).
        assert 300 <= sum(counts) <= 301
    assert "async + staleness-aware lr: max staleness" in out


@pytest.mark.slow  # the chapter's backup-worker run end to end (tests/test_ps_train.py proves the rule in the default set)
def test_backup_workers_use_n_minus_b_and_drop_the_late_ones():
    out = run("backup_workers.py")
    rows = {int(b): (used, int(updates), int(dropped)) for b, used, updates, dropped in
            re.findall(r"^\s+(\d)\s+([\d,]+)\s+(\d+)\s+(\d+)\s+\d+\s+[\d.]+$", out, re.M)}
    assert rows[0] == ("3", 150, 0)
    used, updates, dropped = rows[1]
    assert used == "2" and updates == 225 and dropped > 0  # 450 gradients, 2 per update
