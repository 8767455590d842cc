"""Command-line argument checks the commands share (train, bench, trace), run before any rank
starts.

A bad value found inside a rank costs a rank's traceback (and a spawn); found here it is one
line naming the flag, and exit code 2.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from .errors import MicroDDPError


def at_least(low: int, **flags: int | Iterable[int]) -> None:
    """Each flag (name=value, or name=[values]) is a whole number >= low."""
    for name, value in flags.items():
        for v in value if isinstance(value, list | tuple) else [value]:
            if v < low:
                raise MicroDDPError(f"--{name.replace('_', '-')} must be at least {low}, got {v}")


def positive(name: str, value: float | None) -> None:
    """A float flag, when given, is a finite number above 0 (nan and inf pass a plain `> 0`
    or `< 0` test and then fail deep inside a rank)."""
    if value is not None and not (math.isfinite(value) and value > 0):
        raise MicroDDPError(f"--{name.replace('_', '-')} must be a positive, finite number, "
                            f"got {value}")


def distinct(name: str, values: list) -> None:
    """No value twice: a repeated engine or size would be timed twice under one label."""
    twice = list(dict.fromkeys(v for v in values if values.count(v) > 1))
    if twice:
        raise MicroDDPError(f"--{name.replace('_', '-')} gives {', '.join(map(str, twice))} "
                            "more than once; give each value once")


def engines(names: list[str]) -> None:
    """Refuse any name that is not a DDP engine, or one given twice."""
    from .dp.engine_names import ENGINES

    bad = [e for e in names if e not in ENGINES]
    if bad:
        raise MicroDDPError(f"unknown engine(s) {', '.join(bad)}; choose from {', '.join(ENGINES)}")
    distinct("engines", names)


def rank_list(name: str, text: str) -> list[int]:
    """'1-3,5' -> [1, 2, 3, 5]: ranks as a command line names them."""
    out: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, dash, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi if dash else lo)
        except ValueError:
            raise MicroDDPError(f"--{name.replace('_', '-')} {text!r}: give ranks like 1-3 or "
                                "1,2,5") from None
        out += range(first, last + 1)
    return out
