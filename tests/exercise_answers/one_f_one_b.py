"""The reference answer to the 1F1B exercise: microddp's own schedule builder."""

from microddp.pipeline import BUILDERS


def one_f_one_b(p, m):
    s = BUILDERS["1f1b"](p, m)
    return [[(a.kind, a.mb) for a in s.actions[r] if a.kind in ("F", "B")] for r in range(p)]
