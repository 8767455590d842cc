"""The metadata agreement through shared memory, for a group whose ranks are all on this host.

collectives/agreement/agree.py makes every rank agree on shapes, dtypes and ops before data
moves, with a butterfly of small messages through the group's backend; on one host those are
loopback messages handled by gloo's threads, and their cost was the check's (chapter 4).
Here no message is sent: every rank writes the very numbers the butterfly would send
(verdict.encode's) into its own line of the group's segment and posts a counter; once every
rank's counter shows this call, each reads every rank's numbers and takes their maximum,
exactly the butterfly's result, so judge() raises the same error on every rank. Every
agreement of such a group goes through here (a ring on one rank meets a tree on another).

Two sets of lines ("parities") are enough, agreement s using set s % 2: a rank writes set p
again at s + 2 only after the wait of s + 1, which returns once every rank has posted s + 1,
which a rank does only after reading every line of s. A rank that never comes ends the
others' wait at the group's timeout with the hang report (shm/segment.py). The memory
ordering is shm/segment.py's: numbers first, then the counter, then the bell.
"""

from __future__ import annotations

import array
from collections.abc import Callable
from typing import NamedTuple

from .segment import LINE_WORDS, Flags, Segment
from .verdict import SLOTS

# An agreement's message without its padding: SLOTS codes, then the same negated (verdict.encode).
WORDS = 2 * SLOTS
# Beside them, not compared: where a ring sent and posted its first step early (agreement/early.py),
# so that a rank refusing the call knows what to settle; zeros for every other agreement.
EXTRA = 2
STRIDE = -(-(WORDS + EXTRA) // LINE_WORDS) * LINE_WORDS  # whole cache lines per rank


def area_words(size: int) -> int:
    """Words of the segment an agreement needs: a counter line per rank, then two sets of
    per-rank numbers."""
    return size * LINE_WORDS + 2 * size * STRIDE


class Check(NamedTuple):
    """A call's agreement, made in its first synchronisation (group.py): this rank's
    numbers (verdict.encode's), and what raises, on every rank, when the ranks' numbers differ
    (`refuse(seq)`, seq being the agreement's sequence number: checked.read_in_memory)."""
    mine: array.array
    refuse: Callable[[int], None]


class SharedAgreement:
    """One rank's side of its group's agreements in shared memory (see the module docstring).
    `first_word`: where its area (area_words long) starts in the segment."""

    def __init__(self, segment: Segment, first_word: int, rank: int, size: int,
                 pids: list[int], gone: Flags, timeout_s: float) -> None:
        self.words, self.rank, self.size, self.timeout_s = segment.words, rank, size, timeout_s
        self.told = Flags(segment, first_word, rank, size, pids, gone)
        numbers = first_word + size * LINE_WORDS
        # Where each rank's numbers start, per parity: worked out once, since an agreement
        # sits in front of every checked collective, where each Python step costs several
        # microseconds (agreement/early.py's measurement).
        self.lines = [[numbers + (parity * size + r) * STRIDE for r in range(size)]
                      for parity in (0, 1)]
        self.others = [r for r in range(size) if r != rank]
        self.seq = 0

    def _at(self, rank: int, seq: int) -> int:
        return self.lines[seq & 1][rank]

    def post(self, mine: array.array, extra: tuple[int, int] = (0, 0)) -> int:
        """Write this rank's WORDS numbers (an int64 array) and EXTRA words for the group's
        next agreement and post them; returns its sequence number, for `result`."""
        seq = self.seq = self.seq + 1
        at, words = self.lines[seq & 1][self.rank], self.words
        words[at:at + WORDS] = mine
        words[at + WORDS], words[at + WORDS + 1] = extra
        self.told.post(seq)
        return seq

    def agrees(self, seq: int, mine: array.array) -> bool | None:
        """The common case, answered without a wait: True if every other rank has posted
        agreement `seq` with numbers equal to `mine`; None if one has not posted it yet;
        False if one posted other numbers (`result` then says what differs).

        Asked after this rank's own post, it cannot be None on both of two ranks: each post
        stores its counter, then fences (shm/segment.py's `fence`, a full memory barrier),
        so a rank's post is visible to all before its own read of the other's (agreement/early.py
        relies on it: one of the two reads the check at once)."""
        words, counters, lines = self.words, self.told.index, self.lines[seq & 1]
        for r in self.others:
            if words[counters[r]] < seq:
                return None
            if words[lines[r]:lines[r] + WORDS] != mine:
                return False
        return True

    def result(self, seq: int, mine: array.array, what: str,
               yielding: bool = False) -> list[int] | None:
        """Once every rank has posted agreement `seq`: None if every rank's numbers equal
        `mine` (compared in C, the common case), else the maximum of each number over all
        ranks (a butterfly's result, for verdict.judge). `yielding`: Flags.wait's."""
        self.told.wait(seq, self.timeout_s, what, yielding)
        at = self.lines[seq & 1]
        if all(self.words[a:a + WORDS] == mine for a in at):
            return None
        rows = [self.words[a:a + WORDS].tolist() for a in at]
        return [max(column) for column in zip(*rows, strict=True)]

    def meet(self, mine: array.array, what: str, yielding: bool) -> int | None:
        """post `mine` (with zeros as EXTRA), wait for every rank's post, and compare: None
        if every rank posted these very numbers, else the agreement's sequence number (for
        `result`). A shared-memory call's first synchronisation (group.py): kept to a few
        Python steps, as `agrees` is, since it sits in front of every default all-reduce."""
        seq = self.seq = self.seq + 1
        lines, words = self.lines[seq & 1], self.words
        at = lines[self.rank]
        words[at:at + WORDS] = mine
        words[at + WORDS] = words[at + WORDS + 1] = 0
        self.told.post(seq)
        self.told.wait(seq, self.timeout_s, what, yielding)
        for r in self.others:
            if words[lines[r]:lines[r] + WORDS] != mine:
                return seq
        return None

    def extra(self, seq: int, rank: int) -> tuple[int, int]:
        """The EXTRA words `rank` posted with agreement `seq` (read after `result`)."""
        at = self._at(rank, seq) + WORDS
        return self.words[at], self.words[at + 1]

    def combine(self, mine: array.array, what: str) -> list[int] | None:
        """post, then result: this rank's numbers against every rank's."""
        return self.result(self.post(mine), mine, what)
