"""One `fully_shard` unit: a module's parameters sharded by dim-0 chunks, gathered around its
forward and backward, their gradients reduce-scattered into the shards.

A shard is FSDP2's: rank r holds rows [r*c, (r+1)*c) of dim 0 of every parameter, c =
ceil(rows / N) (torch.chunk's cut; the last ranks may hold fewer rows, or none), as a plain
nn.Parameter of that shape, registered on the module in place of the full one. So the user's
optimizer, built over module.parameters(), steps local tensors (what FSDP2's DTensor.to_local()
holds), and `.grad` after backward is the averaged gradient of those rows.

On the wire a unit is one slot per rank: that rank's chunk of every parameter end to end,
each padded to c rows (FSDP2's layout): one all-gather brings the unit's parameters (cast to
the policy's param_dtype) and one reduce-scatter sends its gradients (in reduce_dtype, divided
by N on the way in), through the host's shared memory when every rank is on it (comm.py's
test), else through the backend. Through shared memory the reduce-scatter starts as soon as
backward has made the unit's gradients and is waited at the end of backward, so it runs while
backward computes the earlier units. The full parameters are views of one flat buffer whose
storage is emptied between uses (as params.py does for zero.Zero): tensors autograd saved in
forward are the same tensors backward finds, refilled. Refills write through `.data`, whose
version counter is its own, so autograd sees no in-place change.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .. import comms
from .comm import all_gather_slots, free_when_sent, reduce_scatter_slots


@dataclass
class _Entry:
    """One parameter of the unit: where it lives, its full shape, and its rows' cut."""

    owner: nn.Module
    name: str
    shape: torch.Size
    rows: int       # dim 0 (1 for a 0-dim parameter)
    row: int        # elements per row
    cap: int        # rows per rank's chunk: ceil(rows / N)
    offset: int     # where its chunk starts in a rank's slot
    start: int      # where it starts in the full flat buffer

    def rows_of(self, rank: int) -> int:
        """Rows rank `rank` holds (torch.chunk's cut)."""
        return max(0, min(self.rows, (rank + 1) * self.cap) - rank * self.cap)


class Unit:
    """The parameters one fully_shard call manages (those no nested call took)."""

    def __init__(self, named: list[tuple[nn.Module, str, nn.Parameter]], group, mp,
                 reshard_after_forward: bool) -> None:
        self.group, self.mp = group, mp
        self.world_size, self.rank = comms.group_size(group), comms.group_rank(group)
        self.reshard_after_forward = reshard_after_forward
        self.sync = True  # False: gradients accumulate unsharded, no reduce-scatter
        self.entries: list[_Entry] = []
        slot = start = 0
        for owner, name, p in named:
            rows = p.shape[0] if p.dim() else 1
            row = p.numel() // rows if rows else 0
            cap = -(-rows // self.world_size)
            self.entries.append(_Entry(owner, name, p.shape, rows, row, cap, slot, start))
            slot += cap * row
            start += p.numel()
        self.slot, self.numel = slot, start
        self.dtype = named[0][2].dtype
        self.param_dtype = mp.param_dtype or self.dtype
        self.reduce_dtype = mp.reduce_dtype or self.param_dtype
        self.sharded: list[nn.Parameter] = []
        for e, (_owner, _name, p) in zip(self.entries, named, strict=True):
            rows = p.detach().reshape(e.rows, e.row)
            own = rows.narrow(0, min(e.rows, self.rank * e.cap), e.rows_of(self.rank))
            local = own.reshape(-1, *p.shape[1:]) if p.dim() else own.reshape(-1)
            # its own storage, so the full tensor can go
            shard = nn.Parameter(local.clone(), requires_grad=p.requires_grad)
            shard._mdp_fully_shard = True  # nested calls leave it to this unit
            self.sharded.append(shard)
        device = named[0][2].device
        self.flat = torch.empty(self.numel, dtype=self.param_dtype, device=device)
        self.full = [nn.Parameter(self.flat.narrow(0, e.start, e.rows * e.row).view(e.shape),
                                  requires_grad=s.requires_grad)
                     for e, s in zip(self.entries, self.sharded, strict=True)]
        self.flat.untyped_storage().resize_(0)
        self.gathered = False
        self.pending: list = []  # reduce-scatters started in this backward
        self.register(self.sharded)

    # which tensors the modules hold

    def register(self, params: list[nn.Parameter]) -> None:
        """Put `params` (the shards, or the full parameters during forward) on the modules."""
        for e, p in zip(self.entries, params, strict=True):
            e.owner._parameters[e.name] = p

    # parameters

    def pack(self, tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """This rank's slot: its chunk of each tensor (shards), end to end, padded."""
        send = torch.zeros(self.slot, dtype=dtype, device=self.flat.device)
        for e, t in zip(self.entries, tensors, strict=True):
            n = e.rows_of(self.rank) * e.row
            send.narrow(0, e.offset, n).copy_(t.detach().reshape(-1))
        return send

    def all_gather(self, send: torch.Tensor) -> torch.Tensor:
        """Every rank's slot, rank after rank."""
        out = send.new_empty(self.world_size * self.slot)
        outs = list(out.split(self.slot)) if self.slot else [out] * self.world_size
        all_gather_slots(outs, send, self.group)
        return out

    def unpack(self, gathered: torch.Tensor, into: torch.Tensor) -> None:
        """Every rank's chunks, from their slots, to their places in the flat `into`."""
        for r in range(self.world_size):
            for e in self.entries:
                n = e.rows_of(r) * e.row
                if n:
                    into.narrow(0, e.start + r * e.cap * e.row, n).copy_(
                        gathered.narrow(0, r * self.slot + e.offset, n))

    @torch.no_grad()
    def unshard(self) -> None:
        """Gather the full parameters (in param_dtype) into the flat buffer."""
        if self.gathered:
            return
        gathered = self.all_gather(self.pack(self.sharded, self.param_dtype))
        self.flat.untyped_storage().resize_(self.numel * self.flat.element_size())
        self.unpack(gathered, self.flat.data)
        self.gathered = True

    def reshard(self) -> None:
        """Free the full parameters: only the shards stay."""
        self.flat.untyped_storage().resize_(0)
        self.gathered = False

    @torch.no_grad()
    def full_tensors(self) -> list[torch.Tensor]:
        """Every parameter whole, in its own dtype (new tensors: for saving)."""
        flat = torch.empty(self.numel, dtype=self.dtype, device=self.flat.device)
        self.unpack(self.all_gather(self.pack(self.sharded, self.dtype)), flat)
        return [flat.narrow(0, e.start, e.rows * e.row).view(e.shape) for e in self.entries]

    @torch.no_grad()
    def load_full(self, tensors: list[torch.Tensor]) -> None:
        """Each shard from the whole parameters (a full state dict): this rank's rows."""
        for e, s, t in zip(self.entries, self.sharded, tensors, strict=True):
            rows = t.reshape(e.rows, e.row).narrow(0, min(e.rows, self.rank * e.cap),
                                                   e.rows_of(self.rank))
            s.copy_(rows.reshape(s.shape))

    # gradients

    @torch.no_grad()
    def reduce_grads(self) -> None:
        """Start averaging the full gradients over ranks, and drop them; finish_reduce adds
        the result into the shards' .grad (to what is there, as autograd accumulates)."""
        grads = [f.grad for f in self.full]
        if all(g is None for g in grads):
            return
        send = torch.zeros(self.world_size * self.slot, dtype=self.reduce_dtype,
                           device=self.flat.device)
        for e, g in zip(self.entries, grads, strict=True):
            if g is None:
                continue  # zeros: a parameter this backward did not reach
            rows = g.reshape(e.rows, e.row)
            for r in range(self.world_size):
                n = e.rows_of(r)
                if n:
                    send.narrow(0, r * self.slot + e.offset, n * e.row).copy_(
                        rows.narrow(0, r * e.cap, n).reshape(-1))
        # Divided before the sum (no division after the wait), in reduce_dtype: a bf16
        # gradient divided by 3 in bf16 would lose bits FSDP2's keeps.
        send.div_(self.world_size)
        out = send.new_empty(self.slot)
        ins = list(send.split(self.slot)) if self.slot else [out] * self.world_size
        # Started, not waited: backward goes on computing the earlier units meanwhile.
        handle = reduce_scatter_slots(out, ins, self.group)
        # `send` (the whole unit's gradients) lives only while it travels
        freed = free_when_sent([handle], send) if handle is not None else None
        self.pending.append((handle, freed, out))
        for f in self.full:
            f.grad = None

    def finish_reduce(self) -> None:
        """Wait for the reduce-scatters started, and add their rows into the shards' .grad."""
        for handle, freed, out in self.pending:
            if handle is not None:
                handle.wait()
                freed.wait()
            for e, s in zip(self.entries, self.sharded, strict=True):
                if not s.requires_grad:
                    continue
                g = out.narrow(0, e.offset, e.rows_of(self.rank) * e.row).view(s.shape)
                g = g.to(s.dtype)
                if s.grad is None:
                    s.grad = g  # a view of `out`, which holds only this rank's slot
                else:
                    s.grad.add_(g)
        self.pending.clear()
