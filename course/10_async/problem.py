"""Chapter 10's shared problem: digits, a small MLP, a global batch of 64, and one helper that
runs a parameter-server configuration and returns the server's numbers (on rank 0).

Every script runs all its configurations inside one set of ranks (one mdp.spawn), one after
the other, so they share the same machine state and the start-up cost is paid once.
"""

from __future__ import annotations

import argparse
import math

import torch

import microddp as mdp
from microddp import ps
from microddp.data import load_dataset

GLOBAL_BATCH, LR, STEPS = 64, 0.1, 150


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return mdp.FullMLP(256, 3, n_classes=10, in_features=64)


def task() -> ps.Task:
    data = load_dataset("digits")
    return ps.Task(make_model, data.train, GLOBAL_BATCH, data.test, seed=1)


def measure(world: mdp.World, steps: int = STEPS, **kw) -> dict | None:
    """Run one configuration; rank 0 gets its numbers, the workers None."""
    torch.set_num_threads(1)  # ranks share the cores: one thread each keeps them comparable
    report = ps.run(world, task(), ps.PSConfig(steps=steps, lr=LR, **kw))
    if world.rank != ps.SERVER:
        return None
    return {"samples_per_s": report.samples_per_s, "accuracy": report.test_accuracy,
            "updates": report.updates, "histogram": report.histogram,
            "mean_staleness": sum(report.staleness) / len(report.staleness),
            "per_update": report.per_update, "discarded": report.discarded}


def world_size_from_args(doc: str, default: int = 3) -> int:
    """-n: ranks in all (one server, n-1 workers)."""
    parser = argparse.ArgumentParser(description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--nproc", type=int, default=default,
                        help=f"ranks: the server plus workers (default {default})")
    n = parser.parse_args().nproc
    if n < 2:
        parser.error("a parameter server needs at least 2 ranks (server + 1 worker)")
    return n


def name(staleness: float) -> str:
    return "async" if staleness == math.inf else f"S={staleness:g}"


def histogram_line(hist: dict[int, int], width: int = 30) -> list[str]:
    """One text bar per staleness value."""
    total = sum(hist.values())
    return [f"    {s:>2} | {'#' * max(1, round(width * c / total)):<{width}} {c}"
            for s, c in hist.items()]
