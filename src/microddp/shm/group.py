"""The shared-memory collectives of one group: all-reduce, reduce-scatter, all-gather, broadcast.

Layout of the group's segment (shm/segment.py): three rows of per-rank counters (`arrive`,
`reduced`, `gone`), the metadata agreement's counters and numbers (shm/agreement.py), then two
sets ("parities") of n+1 slots of SLOT_BYTES each: one input slot per rank and one result
slot. Every step (a call, or one chunk of a call larger than a slot) takes the next sequence
number and uses the parity seq % 2, alternately.
"""

from __future__ import annotations

import ctypes
import os
from typing import NamedTuple

import torch

from ..errors import MicroDDPError
from .agreement import Check, SharedAgreement, area_words
from .segment import LINE_WORDS, Flags, Segment

# The all-reduce's two paths, and why one synchronisation per step is enough:
#
# All-reduce, for a chunk of m bytes:
# - small (m <= SMALL_BYTES): each rank copies its input into its slot and posts `arrive`; once
#   all have, each rank reduces the others' slots into its own tensor (which still holds its
#   input: its own slot need not be read back). One synchronisation.
# - large: the same first phase; then rank r reduces only its slice (m/n) of every slot into
#   the result slot, posts `reduced`, and once all have, copies the whole result slot out: each
#   rank reads m of input instead of n*m, for a second synchronisation.
#
# Both reduce the ranks' inputs in the same order, rank 0 first (((x0 + x1) + x2) + ...), so every
# rank gets the same bits whichever path or chunking a size takes (rank 1 computes x1 + x0, the
# same bits: `fold_into`); on two ranks that is x0 + x1, exactly what gloo computes.
#
# Why two parities make one synchronisation per step enough: a rank writes its slot of parity p
# at step s + 2 only after the barrier of step s + 1, which every rank reaches only after it has
# finished step s, the last one that read that slot. The result slot is written after the
# barrier of its own step, for the same reason.

# Per rank and parity: a larger message goes in chunks of this. Each chunk costs a
# synchronisation or two, which on a busy host can cost a time slice each: against 1 MiB, 4 MiB
# took 0.32-0.77x gloo's time at 4 MiB (1 MiB: 0.95-0.96x) and 0.60-0.93x at 16 MiB (1.05-1.07x)
# in two interleaved runs each (load average 7). A 2-rank group's segment takes 24 MiB.
SLOT_BYTES = 4 << 20
# Up to this, every rank reduces all inputs (one synchronisation). On 2 ranks that moves no
# more memory than the large path (a copy in, an add of 2 inputs; against a copy in, an add
# of half of 2 inputs and a copy out), so it is used up to a whole slot there.
SMALL_BYTES = 64 << 10


def sizes(size: int) -> tuple[int, int]:
    """(slot, small) bytes for a group of `size` ranks: the defaults above, or
    MICRODDP_SHM_SLOT_BYTES and MICRODDP_SHM_SMALL_BYTES (the same on every rank; tests use
    them to cross every threshold with small tensors). A slot is whole 64-byte lines."""
    slot = _env_bytes("MICRODDP_SHM_SLOT_BYTES", SLOT_BYTES, 64) // 64 * 64
    small = _env_bytes("MICRODDP_SHM_SMALL_BYTES", slot if size == 2 else SMALL_BYTES, 0)
    return slot, small


def _env_bytes(name: str, default: int, least: int) -> int:
    """A whole number of bytes, at least `least`, from environment variable `name`; the
    value as the user wrote it in the one-line refusal (not as rounded or parsed)."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        value = None
    if value is None or value < least:
        raise MicroDDPError(f"{name} must be a whole number of bytes, at least {least}, "
                            f"got {raw!r}; unset it for the default ({default})")
    return value


# Up to this, a piece goes into its slot by memmove (ctypes): same bytes as torch's copy_,
# without its dispatch, which costs more than the copy itself at a few KiB; beyond it torch's
# copy, which may split the work among threads.
MEMMOVE_BYTES = 256 << 10
_memmove = ctypes.memmove

FOLDS = {"sum": torch.add, "avg": torch.add, "product": torch.mul,
         "min": torch.minimum, "max": torch.maximum}
IN_PLACE = {"sum": torch.Tensor.add_, "avg": torch.Tensor.add_, "product": torch.Tensor.mul_}
DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
                    torch.int16, torch.int32, torch.int64, torch.uint8})


def segment_bytes(size: int, slot: int) -> int:
    """Bytes of a group's segment: its control lines, then 2 x (ranks + 1) data slots of `slot` bytes."""
    return _control_bytes(size) + 2 * (size + 1) * slot


def _control_bytes(size: int) -> int:
    """The three rows of counters, then the metadata agreement's area (shm/agreement.py)."""
    return -(-(3 * size * LINE_WORDS + area_words(size)) * 8 // 4096) * 4096


def fold(op: str, parts: list[torch.Tensor], out: torch.Tensor) -> None:
    """out = op(...op(op(parts[0], parts[1]), parts[2])...): the one order every rank uses."""
    fn = FOLDS[op]
    fn(parts[0], parts[1], out=out)
    for t in parts[2:]:
        fn(out, t, out=out)


def fold_into(op: str, parts: list[torch.Tensor], own: torch.Tensor, rank: int) -> None:
    """`fold` of `parts` into `own`, which holds parts[rank] (this rank's input) and so need
    not be read from its slot. Ranks 0 and 1 start in place, own = op(own, parts[1 - rank]):
    x1 + x0 is x0 + x1 to the bit (IEEE addition and multiplication commute; min and max do
    not, for signed zeros, so rank 1 keeps the order x0, x1 there), and an in-place op moves
    a quarter less memory than one with a separate output (no read of the destination
    before it is written over: 0.38 against 0.55 ms for an add of 4 MiB here). A later rank
    must start from parts[0] + parts[1], so it cannot."""
    if rank > 1:
        fold(op, parts, own)
        return
    if op in IN_PLACE:  # own.add_(other): torch.add(own, other, out=own), less dispatch
        step = IN_PLACE[op]
        for t in (parts[1 - rank], *parts[2:]):
            step(own, t)
        return
    fn = FOLDS[op]
    if rank == 1 and op in ("min", "max"):
        # min and max do not commute to the bit: of +0.0 and -0.0 (equal) each returns its
        # first argument, so rank 1 keeps rank 0's order, x0 first (an output that is also
        # an input is fine for an element-wise op).
        fn(parts[0], own, out=own)
    else:
        fn(own, parts[1 - rank], out=own)
    for t in parts[2:]:
        fn(own, t, out=own)


CUTS_KEPT = 64  # (dtype, size) pairs whose slot views a group keeps (`SharedGroup.cut`)


class _Cut(NamedTuple):
    """A parity's slots cut to one call's m elements: every rank's input, the result, and
    this rank's share (slice) of each input and of the result (the large path's reduction)."""
    inputs: list[torch.Tensor]
    result: torch.Tensor
    shares: list[torch.Tensor]
    share: torch.Tensor


class SharedGroup:
    """One rank's side of a group's segment, and the collectives on it (synchronous)."""

    def __init__(self, segment: Segment, rank: int, size: int, pids: list[int],
                 timeout_s: float, slot: int = SLOT_BYTES, small: int = SMALL_BYTES) -> None:
        self.segment, self.rank, self.size = segment, rank, size
        self.slot, self.small, self.timeout_s = slot, small, timeout_s
        self.gone = Flags(segment, 2 * size * LINE_WORDS, rank, size, pids)
        self.arrive = Flags(segment, 0, rank, size, pids, self.gone)
        self.reduced = Flags(segment, size * LINE_WORDS, rank, size, pids, self.gone)
        # Every metadata agreement of the group (agreement/agree.py): no gloo message for it.
        self.agreement = SharedAgreement(segment, 3 * size * LINE_WORDS, rank, size, pids,
                                         self.gone, timeout_s)
        base = _control_bytes(size)
        self.slots = [[segment.data[base + (p * (size + 1) + j) * slot:
                                    base + (p * (size + 1) + j + 1) * slot]
                       for j in range(size + 1)] for p in (0, 1)]
        self._typed: dict[torch.dtype, list[list[torch.Tensor]]] = {}
        self._cut: dict[tuple[torch.dtype, int], tuple[_Cut, _Cut]] = {}
        self.seq = 0
        self.yielding = False  # set per call: on the lane's thread, release the GIL at once
        self.failed: str | None = None

    def views(self, dtype: torch.dtype) -> list[list[torch.Tensor]]:
        """The slots viewed as `dtype`, per call and rank (made once per dtype)."""
        v = self._typed.get(dtype)
        if v is None:
            v = self._typed[dtype] = [[s.view(dtype) for s in row] for row in self.slots]
        return v

    def cut(self, dtype: torch.dtype, m: int) -> tuple[_Cut, _Cut]:
        """The slots' first m elements as `dtype`, and this rank's share of them, per parity:
        made once per (dtype, m) and kept, since slicing a tensor costs a microsecond or two
        and a small all-reduce would otherwise cut four of them per call (DDP and training
        loops repeat the same few sizes; any other size is cut again after the cache empties)."""
        key = (dtype, m)
        got = self._cut.get(key)
        if got is None:
            if len(self._cut) >= CUTS_KEPT:
                self._cut.clear()
            n, r = self.size, self.rank
            a, b = m * r // n, m * (r + 1) // n
            got = self._cut[key] = tuple(
                _Cut([s[:m] for s in row[:n]], row[n][:m], [s[a:b] for s in row[:n]],
                     row[n][a:b]) for row in self.views(dtype))
        return got

    def _barrier(self, flags: Flags, seq: int, what: str) -> None:
        flags.post(seq)  # after this rank's writes: see the ordering note in shm/segment.py
        try:
            flags.wait(seq, self.timeout_s, what, self.yielding)
        except MicroDDPError as e:
            self.failed = str(e)
            raise

    def _meet(self, seq: int, what: str, check: Check | None) -> None:
        """A call's first synchronisation: the `arrive` barrier or, for a checked call, the
        metadata agreement itself (agreement.py), whose post follows this rank's writes as
        arrive's would: the check costs no synchronisation of its own. On a mismatch no rank
        goes on: the step is given back (a rank whose call never took one, a ring or a rank
        that refused its own arguments, is then in step with this one) and `check.refuse`
        raises the agreement's error."""
        if check is None:
            self._barrier(self.arrive, seq, what)
            return
        differs = self._differs(what, check)
        if differs is not None:
            self.seq = seq - 1
            check.refuse(differs)

    def _differs(self, what: str, check: Check) -> int | None:
        try:
            return self.agreement.meet(check.mine, what, self.yielding)
        except MicroDDPError as e:
            self.failed = str(e)
            raise

    def agree_only(self, what: str, check: Check | None) -> None:
        """A checked call with nothing to move (an empty tensor): the agreement alone."""
        differs = self._differs(what, check) if check is not None else None
        if differs is not None:
            check.refuse(differs)

    def _step(self) -> int:
        """The next step's sequence number, unless an earlier step failed."""
        if self.failed is not None:
            raise MicroDDPError(f"this group's shared memory failed earlier, so its ranks are out "
                                f"of step; start the job again. The failure: {self.failed}")
        self.seq += 1
        return self.seq

    def _next(self, dtype: torch.dtype) -> tuple[int, list[torch.Tensor]]:
        seq = self._step()
        return seq, self.views(dtype)[seq & 1]

    def all_reduce(self, flat: torch.Tensor, op: str, check: Check | None = None) -> None:
        """`flat` reduced over the group with `op`, in place: one synchronisation for small
        tensors, reduce-scatter then gather for large ones, in slot-sized pieces. `check`:
        the call's agreement, made in its first piece's synchronisation (`_meet`)."""
        cap = self.slot // flat.element_size()
        total = flat.numel()
        if total <= cap:  # one piece: no slicing (most calls)
            self._all_reduce_piece(flat, op, check)
            return
        for start in range(0, total, cap):
            self._all_reduce_piece(flat[start:start + cap], op, check if start == 0 else None)

    def _all_reduce_piece(self, piece: torch.Tensor, op: str, check: Check | None) -> None:
        # Small or large by the piece's size, not the whole tensor's: on 2 ranks every piece
        # of a tensor larger than a slot is "small" (one synchronisation, no copy out), which
        # the large path would spend a second synchronisation and a copy out on. The hot path
        # of every small all-reduce: `_meet` and `_differs` are written out here, one Python
        # frame each being a measurable part of a 4 KiB call (docs/measured/04c-shared-memory.md).
        seq = self._step()
        m = piece.numel()
        cut = self.cut(piece.dtype, m)[seq & 1]
        nbytes = m * piece.element_size()
        mine = cut.inputs[self.rank]
        if nbytes <= MEMMOVE_BYTES:  # a plain memmove: a torch copy_ dispatches first
            _memmove(mine.data_ptr(), piece.data_ptr(), nbytes)
        else:
            mine.copy_(piece)
        if check is None:
            self._barrier(self.arrive, seq, "all_reduce")
        else:
            try:
                differs = self.agreement.meet(check.mine, "all_reduce", self.yielding)
            except MicroDDPError as e:
                self.failed = str(e)
                raise
            if differs is not None:  # as in _meet: the step is given back, every rank raises
                self.seq = seq - 1
                check.refuse(differs)
        if nbytes <= self.small:
            fold_into(op, cut.inputs, piece, self.rank)
            return
        if cut.share.numel():
            fold(op, cut.shares, cut.share)
        self._barrier(self.reduced, seq, "all_reduce")
        piece.copy_(cut.result)

    def reduce_scatter(self, out: torch.Tensor, inputs: list[torch.Tensor], op: str,
                       check: Check | None = None) -> None:
        """out = op over ranks of their inputs[rank]; all flat, of out's length."""
        n, r = self.size, self.rank
        k = out.numel()
        if k == 0:
            self.agree_only("reduce_scatter", check)
        cap = max(1, self.slot // (out.element_size() * n))
        for start in range(0, k, cap):
            c = min(cap, k - start)
            seq, slots = self._next(out.dtype)
            torch.stack([t[start:start + c] for t in inputs], out=slots[r][:n * c].view(n, c))
            self._meet(seq, "reduce_scatter", check if start == 0 else None)
            fold(op, [s[r * c:(r + 1) * c] for s in slots[:n]], out[start:start + c])

    def all_gather(self, outputs: list[torch.Tensor], flat: torch.Tensor,
                   check: Check | None = None) -> None:
        """Every rank's `flat` into `outputs`, through the slots, in pieces of at most a slot."""
        r = self.rank
        k = flat.numel()
        if k == 0:
            self.agree_only("all_gather", check)
        cap = self.slot // flat.element_size()
        for start in range(0, k, cap):
            c = min(cap, k - start)
            seq, slots = self._next(flat.dtype)
            slots[r][:c].copy_(flat[start:start + c])
            self._meet(seq, "all_gather", check if start == 0 else None)
            for j, o in enumerate(outputs):
                o[start:start + c].copy_(slots[j][:c])

    def broadcast(self, flat: torch.Tensor, src: int, check: Check | None = None) -> None:
        """Every rank's `flat` becomes group rank `src`'s."""
        k = flat.numel()
        if k == 0:
            self.agree_only("broadcast", check)
        cap = self.slot // flat.element_size()
        for start in range(0, k, cap):
            c = min(cap, k - start)
            seq, slots = self._next(flat.dtype)
            if self.rank == src:
                slots[src][:c].copy_(flat[start:start + c])
            self._meet(seq, "broadcast", check if start == 0 else None)
            if self.rank != src:
                flat[start:start + c].copy_(slots[src][:c])

    def close(self) -> None:
        """Say this rank has left (a peer still waiting raises at once), then unmap."""
        if self.slots:
            self.gone.post(1)
            self._typed.clear()
            self._cut.clear()
            self.slots = []
            self.segment.close()
