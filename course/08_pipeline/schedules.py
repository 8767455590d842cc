"""Chapter 8, step 2: four pipeline schedules side by side. Each is data (every rank's list of
actions), drawn as the classic rank x time grid on paper (F = 1, B = 2, I = W = 1 time unit),
then GPipe and 1F1B run for real with every stage sleeping a fixed time (backward twice
forward), and the bubble measured from the recorded timeline is compared with theory.

    python course/08_pipeline/schedules.py               # 4 ranks, 4 and 8 micro-batches
    python course/08_pipeline/schedules.py -n 3 -m 6
"""

import argparse

from problem import DEPTH, bubble, draw, timed_step

import microddp as mdp
from microddp import pipeline

COST = 0.01  # seconds a stage's forward sleeps; its backward sleeps twice that


def measure(world: mdp.World, cases: list[tuple[str, int]]) -> dict:
    return {case: timed_step(world, *case, cost=COST) for case in cases}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--world-size", type=int, default=4, help="ranks (pipeline stages)")
    p.add_argument("-m", "--microbatches", type=int, nargs="+", default=[4, 8])
    args = p.parse_args()
    n, ms = args.world_size, args.microbatches
    if not 2 <= 2 * n <= DEPTH or min(ms) < 1:
        p.error(f"-n {n} -m {ms}: use 1 to {DEPTH // 2} ranks (interleaving puts 2 stages on "
                f"each, of the model's {DEPTH} blocks) and at least 1 micro-batch")
    for m in ms:
        for name in pipeline.BUILDERS:
            schedule = pipeline.build(name, n, m)
            paper = pipeline.validate(schedule).bubble
            print(f"{name}, p={n}, m={m}: bubble on paper {paper:.3f}, "
                  f"theory {pipeline.theory_bubble(schedule):.3f}")
            print(pipeline.grid(schedule))
            print()
    cases = [(name, m) for m in ms for name in ("gpipe", "1f1b")]
    timelines = mdp.spawn(measure, n, args=(cases,), backend="gloo")
    print(f"measured on {n} ranks, each stage sleeping {COST * 1000:g} ms forward and "
          f"{2 * COST * 1000:g} ms backward:")
    for name, m in cases:
        spans = [rank[(name, m)] for rank in timelines]
        theory = (n - 1) / (m + n - 1)
        print(f"{name:6s} m={m}: bubble measured {bubble(spans):.3f}  theory (p-1)/(m+p-1) "
              f"= {theory:.3f}")
        print(draw(spans))
