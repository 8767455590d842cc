"""Running `microddp train --elastic` with a rank lost, and checking what it did (not a test
module itself): final parameters against one process's training, every step's samples
against the sampler's global batches, no process or /dev/shm segment left behind."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import psutil
import torch

import microddp
from microddp.data import ShardedBatchSampler, load_dataset
from microddp.train import loop
from microddp.train.config import TrainConfig

# Small enough that a job is mostly its ranks' start-up; big enough to learn something.
SMALL = {"hidden": 16, "depth": 1, "batch_size": 128}
# Float32, the same samples per step; only the order in which the slices' gradient sums are
# added differs from one process's (it changes with the number of ranks). Measured differences
# are a few 1e-8; 1e-5 is ~100 ulps of these weights, while one batch skipped or taken twice
# moves them by ~1e-3.
ATOL = 1e-5
DEADLINE = 240


def flags(settings: dict) -> list[str]:
    out = []
    for k, v in settings.items():
        out += [f"--{k.replace('_', '-')}", str(v)]
    return out


def run_elastic(out: Path, n: int = 4, fault: str = "", *extra: str,
                settings: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "MICRODDP_ELASTIC_FAULT": fault}
    args = [sys.executable, "-m", "microddp", "train", "--elastic", "--nproc", str(n),
            "--out", str(out), "--no-plot", *flags({**SMALL, **(settings or {})}), *extra]
    return subprocess.run(args, capture_output=True, text=True, timeout=DEADLINE, env=env)


def reference(out: Path, **settings) -> dict[str, torch.Tensor]:
    """One process, the same seed and global batches: microddp train's ordinary loop."""
    cfg = TrainConfig(**{**SMALL, **settings, "out": str(out), "plot": False,
                         "dataset": "digits"})
    try:
        return loop.train(microddp.init(), cfg).params
    finally:
        microddp.shutdown()


def max_diff(out: Path, ref: dict[str, torch.Tensor]) -> float:
    got = torch.load(out / "model.pt")
    assert got.keys() == ref.keys()
    return max((got[k] - ref[k]).abs().max().item() for k in got)


def step_records(out: Path) -> dict[int, dict]:
    """Every completed step's record, as the reduction reported it (the newest generation's,
    if a step was completed in two: the one the survivors' state holds)."""
    best: dict[int, dict] = {}
    for path in out.glob("samples-*.jsonl"):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if r["step"] not in best or r["gen"] > best[r["step"]]["gen"]:
                best[r["step"]] = r
    return best


def check_samples(out: Path, steps: int, batch_size: int = SMALL["batch_size"]) -> None:
    """Each step used exactly its global batch, each sample once (counts all 1), and a whole
    epoch used every training sample exactly once."""
    n = len(load_dataset("digits").train)
    sampler = ShardedBatchSampler(n, batch_size, allow_empty=True)
    records = step_records(out)
    assert sorted(records) == list(range(1, steps + 1)), sorted(records)
    per_epoch: dict[int, list[int]] = {}
    for step, r in records.items():
        epoch, b = divmod(step - 1, len(sampler))
        assert r["counts"] == [1.0], (step, r["counts"])
        assert r["used"] == sorted(sampler.global_batches(epoch)[b].tolist()), step
        per_epoch.setdefault(epoch, []).extend(r["used"])
    for epoch, used in per_epoch.items():
        if len(used) == n or steps >= (epoch + 1) * len(sampler):
            assert sorted(used) == list(range(n)), epoch


def pause_s(out: Path) -> float:
    """From the injected kill (fault.json) to the next step any member completed."""
    fault = json.loads((out / "fault.json").read_text())
    after = [r["time"] for r in step_records(out).values() if r["step"] == fault["step"] + 1]
    return min(after) - fault["time"]


def membership(out: Path) -> list[dict]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "membership"]


def leftovers(out: Path) -> list[int]:
    """Processes still running with this run's folder on their command line."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(str(out) in part for part in p.info["cmdline"] or ()):
                found.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def median(values: list[float]) -> float:
    return statistics.median(values)
