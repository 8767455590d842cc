"""The shared-memory collectives of one group: all-reduce, reduce-scatter, all-gather, broadcast.

Layout of the group's segment (transport/shm.py): three rows of per-rank counters (`arrive`,
`reduced`, `gone`), then two sets ("parities") of n+1 slots of SLOT_BYTES each: one input slot
per rank and one result slot. Every step (a call, or one chunk of a call larger than a slot)
takes the next sequence number and uses the parity seq % 2, alternately.

All-reduce, for a chunk of m bytes:
- small (m <= SMALL_BYTES): each rank copies its input into its slot and posts `arrive`; once
  all have, each rank reduces every slot into its own tensor. One synchronisation.
- large: the same first phase; then rank r reduces only its slice (m/n) of every slot into
  the result slot, posts `reduced`, and once all have, copies the whole result slot out: each
  rank reads m of input instead of n*m, for a second synchronisation.

Both reduce the ranks' inputs in the same order, rank 0 first (((x0 + x1) + x2) + ...), so every
rank gets the same bits whichever path or chunking a size takes; on two ranks that is x0 + x1,
exactly what gloo computes.

Why two parities make one synchronisation per step enough: a rank writes its slot of parity p
at step s + 2 only after the barrier of step s + 1, which every rank reaches only after it has
finished step s, the last one that read that slot. The result slot is written after the
barrier of its own step, for the same reason.
"""

from __future__ import annotations

import os

import torch

from ..errors import MicroDDPError
from ..transport.shm import LINE_WORDS, Flags, Segment

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
    slot = int(os.environ.get("MICRODDP_SHM_SLOT_BYTES", SLOT_BYTES)) // 64 * 64
    small = int(os.environ.get("MICRODDP_SHM_SMALL_BYTES",
                               slot if size == 2 else SMALL_BYTES))
    if slot < 64 or small < 0:
        raise MicroDDPError(f"MICRODDP_SHM_SLOT_BYTES must be at least 64 and "
                            f"MICRODDP_SHM_SMALL_BYTES at least 0, got {slot} and {small}")
    return slot, small
FOLDS = {"sum": torch.add, "avg": torch.add, "product": torch.mul,
         "min": torch.minimum, "max": torch.maximum}
DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
                    torch.int16, torch.int32, torch.int64, torch.uint8})


def segment_bytes(size: int, slot: int) -> int:
    """Bytes of a group's segment: its control lines, then 2 x (ranks + 1) data slots of `slot` bytes."""
    return _control_bytes(size) + 2 * (size + 1) * slot


def _control_bytes(size: int) -> int:
    return -(-3 * size * LINE_WORDS * 8 // 4096) * 4096


def fold(op: str, parts: list[torch.Tensor], out: torch.Tensor) -> None:
    """out = op(...op(op(parts[0], parts[1]), parts[2])...): the one order every rank uses."""
    fn = FOLDS[op]
    fn(parts[0], parts[1], out=out)
    for t in parts[2:]:
        fn(out, t, out=out)


class SharedGroup:
    """One rank's side of a group's segment, and the collectives on it (synchronous)."""

    def __init__(self, segment: Segment, rank: int, size: int, pids: list[int],
                 timeout_s: float, slot: int = SLOT_BYTES, small: int = SMALL_BYTES) -> None:
        self.segment, self.rank, self.size = segment, rank, size
        self.slot, self.small, self.timeout_s = slot, small, timeout_s
        self.gone = Flags(segment, 2 * size * LINE_WORDS, rank, size, pids)
        self.arrive = Flags(segment, 0, rank, size, pids, self.gone)
        self.reduced = Flags(segment, size * LINE_WORDS, rank, size, pids, self.gone)
        base = _control_bytes(size)
        self.slots = [[segment.data[base + (p * (size + 1) + j) * slot:
                                    base + (p * (size + 1) + j + 1) * slot]
                       for j in range(size + 1)] for p in (0, 1)]
        self._typed: dict[torch.dtype, list[list[torch.Tensor]]] = {}
        self.seq = 0
        self.yielding = False  # set per call: on the lane's thread, release the GIL at once
        self.failed: str | None = None

    def views(self, dtype: torch.dtype) -> list[list[torch.Tensor]]:
        """The slots viewed as `dtype`, per call and rank (made once per dtype)."""
        v = self._typed.get(dtype)
        if v is None:
            v = self._typed[dtype] = [[s.view(dtype) for s in row] for row in self.slots]
        return v

    def _barrier(self, flags: Flags, seq: int, what: str) -> None:
        flags.post(seq)  # after this rank's writes: see the ordering note in transport/shm.py
        try:
            flags.wait(seq, self.timeout_s, what, self.yielding)
        except MicroDDPError as e:
            self.failed = str(e)
            raise

    def _next(self, dtype: torch.dtype) -> tuple[int, list[torch.Tensor]]:
        if self.failed is not None:
            raise MicroDDPError(f"this group's shared memory failed earlier, so its ranks are out "
                                f"of step; start the job again. The failure: {self.failed}")
        self.seq += 1
        return self.seq, self.views(dtype)[self.seq & 1]

    def all_reduce(self, flat: torch.Tensor, op: str) -> None:
        """`flat` reduced over the group with `op`, in place: one synchronisation for small tensors, reduce-scatter then gather for large ones, in slot-sized pieces."""
        n, r = self.size, self.rank
        cap = self.slot // flat.element_size()
        total = flat.numel()
        small = total * flat.element_size() <= self.small
        for start in range(0, total, cap):
            piece = flat if total <= cap else flat[start:start + cap]
            m = piece.numel()
            seq, slots = self._next(flat.dtype)
            slots[r][:m].copy_(piece)
            self._barrier(self.arrive, seq, "all_reduce")
            if small:
                fold(op, [s[:m] for s in slots[:n]], piece)
                continue
            a, b = m * r // n, m * (r + 1) // n
            if b > a:
                fold(op, [s[a:b] for s in slots[:n]], slots[n][a:b])
            self._barrier(self.reduced, seq, "all_reduce")
            piece.copy_(slots[n][:m])

    def reduce_scatter(self, out: torch.Tensor, inputs: list[torch.Tensor], op: str) -> None:
        """out = op over ranks of their inputs[rank]; all flat, of out's length."""
        n, r = self.size, self.rank
        k = out.numel()
        cap = max(1, self.slot // (out.element_size() * n))
        for start in range(0, k, cap):
            c = min(cap, k - start)
            seq, slots = self._next(out.dtype)
            torch.stack([t[start:start + c] for t in inputs], out=slots[r][:n * c].view(n, c))
            self._barrier(self.arrive, seq, "reduce_scatter")
            fold(op, [s[r * c:(r + 1) * c] for s in slots[:n]], out[start:start + c])

    def all_gather(self, outputs: list[torch.Tensor], flat: torch.Tensor) -> None:
        """Every rank's `flat` into `outputs`, through the slots, in pieces of at most a slot."""
        r = self.rank
        k = flat.numel()
        cap = self.slot // flat.element_size()
        for start in range(0, k, cap):
            c = min(cap, k - start)
            seq, slots = self._next(flat.dtype)
            slots[r][:c].copy_(flat[start:start + c])
            self._barrier(self.arrive, seq, "all_gather")
            for j, o in enumerate(outputs):
                o[start:start + c].copy_(slots[j][:c])

    def broadcast(self, flat: torch.Tensor, src: int) -> None:
        """Every rank's `flat` becomes group rank `src`'s."""
        k = flat.numel()
        cap = self.slot // flat.element_size()
        for start in range(0, k, cap):
            c = min(cap, k - start)
            seq, slots = self._next(flat.dtype)
            if self.rank == src:
                slots[src][:c].copy_(flat[start:start + c])
            self._barrier(self.arrive, seq, "broadcast")
            if self.rank != src:
                flat[start:start + c].copy_(slots[src][:c])

    def close(self) -> None:
        """Say this rank has left (a peer still waiting raises at once), then unmap."""
        if self.slots:
            self.gone.post(1)
            self._typed.clear()
            self.slots = []
            self.segment.close()
