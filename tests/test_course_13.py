"""Chapter 13's scripts run as a learner runs them and print what the chapter promises: the
mesh's groups in rank order, predict's ranking with TP across hosts last, a mesh equal to one
process, and predict set beside measured step times."""

import re
from pathlib import Path

import pytest

from script_runner import output

CHAPTER = Path(__file__).resolve().parents[1] / "course" / "13_3d_parallel"


def test_layout_and_ranking():
    out = output(CHAPTER / "layout.py")
    assert "stage 0: TP groups [0 1]  [2 3]" in out and "stage 1: TP groups [4 5]  [6 7]" in out
    assert "DP groups (same stage, same TP rank): [0, 2] [1, 3] [4, 6] [5, 7]" in out
    assert "PP groups (same replica, same TP rank): [0, 4] [1, 5] [2, 6] [3, 7]" in out
    lines = [ln for ln in out.splitlines() if re.match(r"^ +\d+ x +\d+ x +\d+", ln)]
    assert len(lines) == 22
    fits = [re.findall(r"\d+", ln)[:3] for ln in lines if "does not fit" not in ln]
    assert fits[0] == ["8", "2", "4"]  # the best mesh that fits: TP 4 inside a host
    assert "best: dp 8 x pp 2 x tp 4" in out


@pytest.mark.slow  # 8 ranks; tests/test_mesh3d.py proves 1x2x2 in the default set
def test_mesh_equals_one_process():
    out = output(CHAPTER / "mesh_equals_one_process.py")
    got = re.search(r"dp 2 x pp 2 x tp 2 \(8 ranks\): max \|param diff\| (\S+), model.pt (\S+)",
                    out)
    assert got and float(got.group(1)) < 2e-6 and float(got.group(2)) < 2e-6


@pytest.mark.slow  # timing runs
def test_predict_beside_measured():
    out = output(CHAPTER / "predict_vs_measured.py", "--meshes", "1x1x2", "--steps", "6")
    assert re.search(r"calibration: one process [\d.]+ ms a step", out)
    row = re.search(r"^ +1x1x2 +([\d.]+) +([\d.]+) +([\d.]+)$", out, re.M)
    assert row and float(row.group(1)) > 0 and float(row.group(2)) > 0
