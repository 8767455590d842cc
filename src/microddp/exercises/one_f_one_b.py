"""Exercise (chapter 8): the 1F1B pipeline schedule builder.

The learner writes `one_f_one_b(p, m)`: for each of p ranks (one stage each), the order in
which it runs the forward ("F") and backward ("B") of each of m micro-batches. A schedule is
data, so the check needs no messages: it plays the learner's schedule (a rank waits for the
previous stage's forward and the next stage's backward), says where it deadlocks, counts the
activations each rank holds at once (1F1B's point: at most p - rank, where GPipe holds m), and
compares the order with `microddp.pipeline`'s own 1F1B, for pipelines of 1 to 4 ranks and
micro-batch counts below, at and above the number of stages.
"""

from __future__ import annotations

from ..pipeline import BUILDERS
from .base import Exercise, Unsolved, call, load, run_checks

CASES = ((2, 4), (3, 6), (4, 4), (3, 2), (1, 3), (4, 7))
STARTER = '''\
"""Chapter 8 exercise: build the 1F1B pipeline schedule.

Check it with:  microddp exercise check 1f1b one_f_one_b.py
"""


def one_f_one_b(p: int, m: int) -> list[list[tuple[str, int]]]:
    """For each of `p` ranks (rank r holds stage r), the order in which it runs the forward
    ("F", mb) and the backward ("B", mb) of every micro-batch mb in 0..m-1.

    1F1B: rank r first runs forwards until it holds p - r micro-batches (or all m, if fewer),
    then alternates one backward and one forward while forwards remain, then runs the
    remaining backwards. Rank r's forward of mb needs rank r-1's forward of mb; its backward
    needs rank r+1's backward of mb (the last rank's, its own forward).
    Example: one_f_one_b(2, 3) == [[("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)],
                                   [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]]
    """
    raise NotImplementedError
'''


def reference(p: int, m: int) -> list[list[tuple[str, int]]]:
    """The library's 1F1B, as (kind, micro-batch) per rank."""
    s = BUILDERS["1f1b"](p, m)
    return [[(a.kind, a.mb) for a in s.actions[r] if a.kind in ("F", "B")] for r in range(p)]


def _shape(got, p: int, m: int) -> None:
    if not isinstance(got, list | tuple) or len(got) != p:
        raise Unsolved(f"one_f_one_b({p}, {m}) must return a list of {p} lists (one per "
                       f"rank), got {type(got).__name__} of length "
                       f"{len(got) if hasattr(got, '__len__') else '?'}")
    for r, order in enumerate(got):
        want = sorted([("F", mb) for mb in range(m)] + [("B", mb) for mb in range(m)])
        items = [tuple(a) for a in order]
        if sorted(items) != want:
            missing = sorted(set(want) - set(items))
            extra = [a for a in items if a not in want or items.count(a) > 1]
            detail = f"missing {missing[:3]}" if missing else f"unexpected {extra[:3]}"
            raise Unsolved(f"one_f_one_b({p}, {m}): rank {r} must run F and B of each of the "
                           f"{m} micro-batches exactly once ({detail})")


def _play(got, p: int, m: int) -> None:
    """Run the schedule without messages; Unsolved at a deadlock or a broken dependency."""
    done: set[tuple[int, str, int]] = set()
    at = [0] * p
    while any(at[r] < 2 * m for r in range(p)):
        moved = False
        for r in range(p):
            if at[r] == 2 * m:
                continue
            kind, mb = got[r][at[r]]
            if kind == "F":
                needs = (r - 1, "F", mb) if r > 0 else None
            else:
                needs = (r + 1, "B", mb) if r < p - 1 else (r, "F", mb)
            if needs is None or needs in done:
                done.add((r, kind, mb))
                at[r] += 1
                moved = True
        if not moved:
            waits = [f"rank {r} waits at {got[r][at[r]][0]}(micro-batch {got[r][at[r]][1]})"
                     for r in range(p) if at[r] < 2 * m]
            raise Unsolved(f"one_f_one_b({p}, {m}) deadlocks: {'; '.join(waits)}; a rank's "
                           "backward needs the next rank's backward of the same micro-batch "
                           "first (the last rank's, its own forward)")


def _memory(got, p: int, m: int) -> None:
    for r in range(p):
        held = peak = 0
        for kind, _ in got[r]:
            held += 1 if kind == "F" else -1
            peak = max(peak, held)
        bound = min(p - r, m)
        if peak > bound:
            gpipe = " (that is GPipe: every forward first)" if peak == m else ""
            raise Unsolved(f"one_f_one_b({p}, {m}): rank {r} holds the activations of {peak} "
                           f"micro-batches at once{gpipe}; 1F1B holds at most p - rank = "
                           f"{bound}: start backwards as soon as the warm-up forwards are done")


def check(path: str) -> list[str]:
    """What is wrong with the learner's schedule builder in `path` (nothing: solved)."""
    fn = load(path, "one_f_one_b")

    def cases() -> None:
        for p, m in CASES:
            got = call(fn, path, "one_f_one_b", p, m)
            _shape(got, p, m)
            got = [[(str(k), int(mb)) for k, mb in order] for order in got]
            _play(got, p, m)
            _memory(got, p, m)
            want = reference(p, m)
            for r in range(p):
                for i, (a, b) in enumerate(zip(got[r], want[r], strict=True)):
                    if a != b:
                        raise Unsolved(
                            f"one_f_one_b({p}, {m}): rank {r}, step {i}: yours runs "
                            f"{a[0]}(micro-batch {a[1]}), 1F1B runs {b[0]}(micro-batch {b[1]}) "
                            f"(it is valid, but not 1F1B's order: warm up with "
                            f"min(p - rank, m) forwards, then one backward, one forward)")
    return run_checks(cases)


EXERCISE = Exercise("1f1b", "8", "the 1F1B pipeline schedule builder", "one_f_one_b",
                    STARTER, check)
