"""Ring algorithms: reduce-scatter, all-gather, and all-reduce as one followed by the other.

Ranks sit on a ring and only ever talk to their two neighbours. The tensor is cut into p
chunks; in each of p-1 steps every rank passes one chunk on while receiving another, so each
rank sends 2(p-1)/p of the tensor in total, however many ranks there are: the bandwidth cost
does not grow with the world size, which is why data parallelism uses it for gradients.
"""

from __future__ import annotations

from functools import partial

import torch

from ...errors import MicroDDPError
from ...transport.duplex import duplex, duplex_decided, duplex_setting
from ...transport.peers import COMBINE, Flat, Peers, bounds, scratch, wait_all, written
from ...world.args import check_kind
from ..agreement.agree import (
    INLINE_MAX_CHUNK,
    agree,
    agreed,
    check_all_reduce,
    describe_tensor,
    home,
    shared_agreement,
)
from ..agreement.carried import Header, carried_ring_all_reduce_, inline_ring_all_reduce_
from ..agreement.checks import try_layout, try_list, try_op, try_tensor
from ..agreement.early import EarlyCall, early_ring_all_reduce_, goes_early
from .loops import (
    pair_all_reduce_,
    pipelined_ring_all_reduce_,
    planned_ring_all_reduce_,
    preposted_ring_all_reduce_,
)
from .plan import make_plan, plan_for, recall, remember
from .policy import PIPELINE_SEGMENT, PIPELINE_WINDOW, pair_segments, posting, widest_chunk_bytes


def reduce_scatter_flat_(peers: Peers, data: torch.Tensor, name: str,
                         off: list[int] | None = None, purpose: str = "ring-incoming"
                         ) -> list[int]:
    """In place on a 1-D tensor: afterwards chunk `me` holds op over ranks of that chunk.

    Returns the chunk offsets (near-equal chunks unless `off` is given). At step s a rank
    sends chunk me-s-1 (its running partial) and folds the incoming partial into chunk
    me-s-2; after p-1 steps chunk me is complete. `purpose` names the scratch buffer for the
    incoming partials (a caller on another thread keeps its own).
    """
    p, r = peers.size, peers.me
    off = bounds(data.numel(), p) if off is None else off
    nxt, prv = (r + 1) % p, (r - 1) % p
    combine = COMBINE[name]
    incoming = scratch(purpose, max(off[i + 1] - off[i] for i in range(p)), data.dtype,
                       data.device)  # one buffer for all steps
    for s in range(p - 1):
        si, ri = (r - s - 1) % p, (r - s - 2) % p
        part = incoming[: off[ri + 1] - off[ri]]
        wait_all(peers.exchange(data[off[si]:off[si + 1]], nxt, part, prv, 1 + s))
        if part.numel():
            combine(data[off[ri]:off[ri + 1]], part)
    return off


def all_gather_flat_(peers: Peers, data: torch.Tensor, off: list[int]) -> None:
    """In place: rank me owns chunk me of `data`; afterwards every rank holds every chunk."""
    p, r = peers.size, peers.me
    nxt, prv = (r + 1) % p, (r - 1) % p
    for s in range(p - 1):
        si, ri = (r - s) % p, (r - s - 1) % p
        # Received chunks land straight in their place: no copies in the gather phase.
        wait_all(peers.exchange(data[off[si]:off[si + 1]], nxt, data[off[ri]:off[ri + 1]], prv,
                                p + s))


def ring_all_reduce(tensor: torch.Tensor, op: str = "sum", group=None, *, check: bool = True,
                    segment_bytes: int | None = None) -> torch.Tensor:
    """In place, every rank ends with op over all ranks' `tensor`; returns `tensor`.

    `check=False` skips the metadata agreement (where the group's ranks are all on this host,
    numbers written to and read from shared memory, no message: shm/agreement.py; otherwise one
    small exchange per round of log2 p, or on 2 gloo ranks, after the group's first call, one
    header sent beside the data, or with the first chunk for tensors up to 2 *
    INLINE_MAX_CHUNK bytes: agreement/carried.py) when the caller already knows every rank passes
    the same shape, dtype and op.
    `segment_bytes` cuts each chunk into segments of at most that many bytes that travel
    through the ring independently (a pipeline, see loops.py; gloo only: NCCL pipelines
    internally). By default chunks go whole, except on more than 2 ranks, where chunks of
    PIPELINE_MIN_CHUNK bytes or more go in segments of at most PIPELINE_SEGMENT. On 2 gloo
    ranks the first call opens a second connection between them (transport/duplex.py), one per
    direction, and every message from group rank 1 to 0 goes over it; with MICRODDP_DUPLEX=0
    they share one, and chunks of PAIR_MIN_CHUNK bytes or more go in segments of at most
    PAIR_SEGMENT (loops.py). The pipeline
    posts up to PIPELINE_WINDOW receives ahead and keeps a scratch segment for each
    reduce-scatter receive in flight: up to PIPELINE_WINDOW segments (of `segment_bytes` when
    given), about (p-1)/p of the tensor at most, kept for reuse by later calls.
    A repeat call on a tensor whose chunks go whole (the same tensor object, memory, dtype, op
    and group), with `check=False`, or with check=True where the check is carried or in shared
    memory, skips the local checks and set-up as well: it runs the loop kept from its last such call (plan.py).
    """
    where = "ring_all_reduce"
    bad_segment = (MicroDDPError(f"{where}: segment_bytes must be positive, got {segment_bytes}")
                   if segment_bytes is not None and segment_bytes < 1 else None)
    if segment_bytes is None:
        loop = recall(tensor, op, group, check)  # this very call before: nothing to set up
        if loop is not None:
            loop(duplex(Peers(group)))
            written(tensor)
            return tensor
    local = check_all_reduce(tensor, op, group, where, bad_segment)
    if local is None:
        return tensor
    peers, name, problem = local
    # MICRODDP_DUPLEX and segment_bytes are agreed on too: ranks that disagree would wait for
    # each other on different connections until the timeout, or send messages of different
    # sizes (which gloo answers by aborting the process). MICRODDP_DUPLEX as the group settled
    # it, once it has (transport/duplex.py's duplex_setting).
    settings = {"MICRODDP_DUPLEX": duplex_setting(peers), "segment_bytes": segment_bytes or 0}
    # Where the group shares memory, the check goes through it (no message: shm/agreement.py).
    # Otherwise, on 2 gloo ranks whose connections are settled (the group's first ring call
    # settles them, after agreeing on MICRODDP_DUPLEX), the check travels beside the data.
    box = shared_agreement(peers) if check and peers.size > 1 else None
    # Both ask for 2 gloo ranks whose connections are settled; early, for a tensor of two
    # elements or more (agreement/early.py), where the group shares memory, carried otherwise.
    settled = peers.size == 2 and not peers.nccl and duplex_decided(peers)  # before this call
    paired = (check and problem is None and segment_bytes is None and settled
              and duplex(peers).back is not None)
    early = paired and box is not None and goes_early(tensor.numel(), tensor.element_size())
    carried = paired and box is None
    if not carried and not early:
        agree(peers, where, home(tensor, peers), problem, check, settings,
              **describe_tensor(tensor), op=name)
        if peers.size <= 1:
            return tensor
        peers = duplex(peers)  # on 2 gloo ranks, opens a connection per direction on first use
    flat = Flat(tensor)
    chunk_bytes = widest_chunk_bytes(flat.data.numel(), peers.size, flat.data.element_size())
    how = ("batched" if peers.nccl else
           posting(chunk_bytes, peers.size, segment_bytes, peers.back is not None))
    if how == "pair":
        pair_all_reduce_(peers, flat.data, name,
                         pair_segments(chunk_bytes, flat.data.element_size()))
        return flat.done()
    if how == "pipeline":
        pipelined_ring_all_reduce_(peers, flat.data, name, segment_bytes or PIPELINE_SEGMENT,
                                   PIPELINE_WINDOW)
        return flat.done()
    # The ring from views kept for this tensor while it lives (a packed copy's change every
    # call).
    preposted = how == "prepost"
    plan = (plan_for(tensor, flat.data, peers.size, peers.me, preposted)
            if flat.in_place else make_plan(flat.data, peers.size, peers.me, preposted))
    if early:  # receive-first, checked in shared memory, the first step sent at once
        loop = partial(early_ring_all_reduce_, plan=plan, name=name,
                       call=EarlyCall(where, {**describe_tensor(tensor), "op": name}, settings,
                                      plan))
    elif carried:  # receive-first, with the header (posting picks it for 2 duplex ranks)
        header = Header(where, {**describe_tensor(tensor), "op": name}, settings)
        if chunk_bytes <= INLINE_MAX_CHUNK:  # the header and the first chunk in one message
            (send0, _, into0, _) = plan.steps[0]
            inline = header.payloads(flat.data.dtype, send0.numel(), into0.numel())
            loop = partial(inline_ring_all_reduce_, plan=plan, name=name, header=header,
                           inline=inline)
        else:
            loop = partial(carried_ring_all_reduce_, plan=plan, name=name, header=header)
    elif preposted:
        loop = partial(preposted_ring_all_reduce_, plan=plan, name=name)
    else:
        loop = partial(planned_ring_all_reduce_, plan=plan, name=name, how=how)
    loop(peers)
    # Not a first call on 2 ranks whose connections were not settled yet: the next one may go
    # early or carried, and must not find this one's loop kept.
    kept = box is not None and (settled or peers.size != 2)
    if flat.in_place and segment_bytes is None and (carried or not check or kept):
        if box is not None and not early:  # a repeat call agrees in shared memory, then runs
            loop = agreed(where, {**describe_tensor(tensor), "op": name}, settings, loop)
        remember(tensor, op, group, loop, check)  # holds the plan, whose views alias, not `tensor`
    return flat.done()


def ring_reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op: str = "sum",
                        group=None, *, check: bool = True) -> torch.Tensor:
    """Group rank i ends with op over ranks of input_list[i] in `output` (inputs untouched)."""
    where = "ring_reduce_scatter"
    peers = Peers(group)
    if not peers.member:
        check_kind(output, where, "output")
        return output
    problem, name, inputs = try_tensor(output, where, "output"), str(op), []
    if problem is None:
        name, problem = try_op(op, output, where)
        inputs, problem2 = try_list(input_list, output, peers.size, where, "input_list")
        problem = problem or try_layout(output, where, "output") or problem2
    agree(peers, where, home(output, peers), problem, check, **describe_tensor(output), op=name)
    # One packed working copy: the ring reduces in place, the caller's inputs stay as they were.
    data = torch.cat([t.detach().reshape(-1) for t in inputs])
    n = output.numel()
    if peers.size > 1:
        reduce_scatter_flat_(peers, data, name, [i * n for i in range(peers.size + 1)])
    mine = data[peers.me * n:(peers.me + 1) * n]
    if name == "avg" and peers.size > 1:
        mine.div_(peers.size)
    output.detach().copy_(mine.view(output.shape))  # detached: see Flat
    return output


def ring_all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None, *,
                    check: bool = True) -> list[torch.Tensor]:
    """tensor_list[i] becomes group rank i's `tensor`, on every rank; returns tensor_list."""
    where = "ring_all_gather"
    peers = Peers(group)
    if not peers.member:
        check_kind(tensor, where)
        return tensor_list
    problem, outs = try_tensor(tensor, where), []
    if problem is None:
        outs, problem = try_list(tensor_list, tensor, peers.size, where, "tensor_list",
                                 written=True)
        problem = problem or try_layout(tensor, where, written=False)
    agree(peers, where, home(tensor, peers), problem, check, **describe_tensor(tensor))
    n = tensor.numel()
    data = torch.empty(n * peers.size, dtype=tensor.dtype, device=tensor.device)
    data[peers.me * n:(peers.me + 1) * n].copy_(tensor.detach().reshape(-1))
    if peers.size > 1:
        all_gather_flat_(peers, data, [i * n for i in range(peers.size + 1)])
    for i, out in enumerate(outs):
        out.detach().copy_(data[i * n:(i + 1) * n].view(out.shape))
    return tensor_list
