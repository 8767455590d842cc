"""Chapter 8, step 1: naive model parallelism. FullMLP's layers are cut into one stage per
rank; the whole batch goes forward through rank 0, then rank 1, ..., and its gradient comes
back the same way. Each rank records when it computes: only one rank works at a time.

    python course/08_pipeline/naive_model_parallel.py          # 2 ranks
    python course/08_pipeline/naive_model_parallel.py -n 4
"""

import argparse

from problem import BATCH, DEPTH, draw, timed_step

import microddp as mdp


def overlap(spans) -> float:
    """The fraction of the step during which two ranks or more were computing at once."""
    edges = sorted({t for rank in spans for _, s, e in rank for t in (s, e)})
    busy_together = sum(b - a for a, b in zip(edges, edges[1:], strict=False)
                        if sum(any(s <= a and b <= e for _, s, e in rank) for rank in spans) > 1)
    return busy_together / (edges[-1] - edges[0])


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--world-size", type=int, default=2, help=f"ranks (1..{DEPTH})")
    n = p.parse_args().world_size
    if not 1 <= n <= DEPTH:
        p.error(f"--world-size {n}: the model has {DEPTH} blocks to share, so use 1 to {DEPTH}")
    # One micro-batch: the whole batch is the only thing in flight (GPipe with m = 1).
    spans = mdp.spawn(timed_step, n, args=("gpipe", 1, 0.02), backend="gloo")
    print(f"naive model parallelism: {n} stages, one batch of {BATCH}, F = forward, "
          "B = backward")
    print(draw(spans))
    busy = [sum(e - s for _, s, e in rank) for rank in spans]
    step = max(e for rank in spans for _, _, e in rank) - min(s for rank in spans for _, s, _ in rank)
    for r, b in enumerate(busy):
        print(f"rank {r} busy {100 * b / step:.0f}% of the step")
    print(f"time two ranks or more computed at once: {100 * overlap(spans):.1f}% of the step")
