"""The metadata agreement through shared memory, for a group whose ranks are all on this host.

agree.py makes every rank agree on shapes, dtypes and ops before data moves, with a butterfly
of small messages through the group's backend. On one host those are loopback TCP messages,
each handled by gloo's threads: on 2 ranks of this 2-core host the ring's default check cost
1.1-1.2x the unchecked ring's time at 1 MiB, however the header travelled (beside the data,
ahead of it, on its own connection; chapter 4 has the table), because the cost was the
messages themselves. Here no message is sent: every rank writes the very numbers the
butterfly would send (agree.encode's) into its own line of the group's segment, then posts a
counter; once every rank's counter shows this call, each rank reads every rank's numbers and
takes their maximum, which is exactly what the butterfly computes. judge() then raises the same
error on every rank, from the same numbers, as before.

Every agreement of such a group goes through here, never some through gloo: a rank that
called a ring and one that called a tree or a broadcast still meet in this mailbox and both
raise. (Only the ring's header carried beside its data, ring_carried.py, is skipped for such a
group: it would be an agreement through gloo.)

Why two sets of lines ("parities") are enough, agreement s using set s % 2: a rank writes set
p again at agreement s + 2 only after the wait of agreement s + 1, which returns only once
every rank has posted s + 1, and a rank posts s + 1 only after it has read every line of s.
So no rank's numbers for s are overwritten before every rank has read them, and no rank can
be more than one agreement ahead of another. A rank that never comes (it crashed, or called
a collective that does not agree) makes the others' wait end at the group's timeout with the
hang report, like any shared-memory wait (transport/shm.py); a 2-rank ring that sent its
first step early may be waiting in gloo for the data instead, and then ends at gloo's timeout,
in gloo's words.

The memory ordering is transport/shm.py's: numbers first, then the counter, then the bell.
"""

from __future__ import annotations

import array
from collections.abc import Callable
from typing import NamedTuple

from ..transport.shm import LINE_WORDS, Flags, Segment

# agree.py's message without its padding: SLOTS codes, then the same negated (agree.encode).
# A literal here, since agree.py imports this module; tests/test_shm_agree.py checks it.
WORDS = 20
# Beside them, not compared: where a ring sent and posted its first step early (ring_early.py),
# so that a rank refusing the call knows what to settle; zeros for every other agreement.
EXTRA = 2
STRIDE = -(-(WORDS + EXTRA) // LINE_WORDS) * LINE_WORDS  # whole cache lines per rank


def area_words(size: int) -> int:
    """Words of the segment an agreement needs: a counter line per rank, then two sets of
    per-rank numbers."""
    return size * LINE_WORDS + 2 * size * STRIDE


class Check(NamedTuple):
    """A call's agreement, made in its first synchronisation (shm_group.py): this rank's
    numbers (agree.encode's), and what raises, on every rank, when the ranks' numbers differ
    (`refuse(seq)`, seq being the agreement's sequence number: agree.read_in_memory)."""
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
        # microseconds (ring_early.py's measurement).
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
        stores its counter, then fences (transport/shm.py's `fence`, a full memory barrier),
        so a rank's post is visible to all before its own read of the other's (ring_early.py
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
        ranks (a butterfly's result, for agree.judge). `yielding`: Flags.wait's."""
        self.told.wait(seq, self.timeout_s, what, yielding)
        at = self.lines[seq & 1]
        if all(self.words[a:a + WORDS] == mine for a in at):
            return None
        rows = [self.words[a:a + WORDS].tolist() for a in at]
        return [max(column) for column in zip(*rows, strict=True)]

    def meet(self, mine: array.array, what: str, yielding: bool) -> int | None:
        """post `mine` (with zeros as EXTRA), wait for every rank's post, and compare: None
        if every rank posted these very numbers, else the agreement's sequence number (for
        `result`). A shared-memory call's first synchronisation (shm_group.py): kept to a few
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
