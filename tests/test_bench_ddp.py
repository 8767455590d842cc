"""`microddp bench ddp --floor`: the step without DDP and the least a DDP step can take, timed
beside the engines (small and few steps: what is printed, not how fast)."""

import subprocess
import sys


def _bench(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "microddp", "bench", "ddp", "--dims", "16",
                           "--depth", "2", "--batch", "4", "--repeats", "3", "--warmup", "1",
                           *flags], capture_output=True, text=True, timeout=240)


def test_floor_is_timed_beside_the_engines_and_compared_with_torch():
    out = _bench("--engines", "microddp", "torch", "--floor")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    head = next(line for line in lines if line.split()[:1] == ["dim"])
    assert head.split()[1:5] == ["microddp", "torch", "no-comm", "floor"], head
    assert "floor/torch" in head
    row = next(line for line in lines if line.split()[:1] == ["16"]).split()
    times = [float(x) for x in row[1:5]]
    assert all(t > 0 for t in times), row
    ratio = float(row[-2].rstrip("x"))  # floor/torch, then its interval
    assert abs(ratio - times[3] / times[1]) < 0.05 * ratio + 1e-3, row
    assert "no DDP step is shorter" in out.stdout


def test_floor_without_torch_is_refused_in_one_line():
    out = _bench("--engines", "microddp", "--floor")
    assert out.returncode == 2
    assert "--floor compares" in out.stderr and len(out.stderr.strip().splitlines()) == 1
