"""Exercises: a chapter's key function with its body removed, and a check that says, in a
learner's words, whether the learner's version is right.

`microddp exercise start NAME` writes the starter file; `microddp exercise check NAME FILE`
runs it (on real ranks where the idea is distributed) beside the library's own version. One
file per exercise; EXERCISES lists them in course order.
"""

from __future__ import annotations

from .base import Exercise
from .hooks import EXERCISE as HOOKS
from .one_f_one_b import EXERCISE as ONE_F_ONE_B
from .ring import EXERCISE as RING
from .zero1 import EXERCISE as ZERO1

EXERCISES: dict[str, Exercise] = {e.name: e for e in (RING, HOOKS, ONE_F_ONE_B, ZERO1)}

__all__ = ["EXERCISES", "Exercise"]
