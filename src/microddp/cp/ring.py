"""Ring attention: exact attention over a sequence split across a context-parallel group.

Each rank holds its queries, keys and values for two chunks of the sequence (split.py). The
key/value block travels once around the ring; at every step a rank posts the send of the block it
holds to the next rank (and the receive of the next block from the previous one) before computing
attention against it, so the transfer runs behind the block's compute. The softmax over all the
blocks is merged exactly, FlashAttention's way: each block gives its output normalised by its own
sum and the log of that sum (lse); two partial results combine as
    lse = logaddexp(lse_a, lse_b),  out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse),
so no rank ever holds a whole row of scores.

The backward pass (RingAttention.backward) recomputes each block's probabilities from the saved
lse, and the key/value block goes around the ring again, this time with the running dK/dV of that
block beside it: each rank adds its share and passes it on, and after P steps every block's
gradient is back on its owner. The dK/dV hop of one step runs behind the next step's compute.

With causal attention a pair of chunks (query chunk a, key chunk b) is full when a > b, causal on
the diagonal a == b, and empty when a < b (skipped, not masked): with the zigzag split every rank
computes the same number of blocks at every step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from .. import comms, spans
from ..errors import MicroDDPError
from ..pipeline.activations import hold
from . import split

KV_TAG, DKV_TAG = 53, 54  # the two streams that share a ring link in the backward pass
_ledgers: list[list[tuple[str, int, str]]] = []


@contextmanager
def counting() -> Iterator[list[tuple[str, int, str]]]:
    """Every hop this rank sends inside the block, in order: ("kv" or "dkv", bytes, phase)."""
    hops: list[tuple[str, int, str]] = []
    _ledgers.append(hops)
    try:
        yield hops
    finally:
        _ledgers.remove(hops)


def pair_kind(a: int, b: int, causal: bool) -> str | None:
    """What query chunk a sees of key chunk b: "full", "diag" (causal within), or None."""
    if not causal or a > b:
        return "full"
    return "diag" if a == b else None


def _chunks(r: int, p: int) -> tuple[int, ...]:
    return (0,) if p == 1 else split.chunks_of(r, p)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, kind: str) -> torch.Tensor:
    s = (q @ k.transpose(-2, -1)) * scale
    if kind == "diag":
        future = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(future, float("-inf"))
    return s


def block_attention(q, k, v, scale: float, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's output, normalised by its own softmax sum, and the log of that sum (lse)."""
    s = _scores(q, k, scale, kind)
    lse = s.logsumexp(-1)
    return torch.exp(s - lse.unsqueeze(-1)) @ v, lse


def merge(out, lse, out_b, lse_b) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial softmax results as one, exactly (None: nothing seen yet)."""
    if out is None:
        return out_b, lse_b
    new = torch.logaddexp(lse, lse_b)
    return out * torch.exp(lse - new).unsqueeze(-1) + out_b * torch.exp(lse_b - new).unsqueeze(-1), new


def _pass_on(t: torch.Tensor, group, tag: int, phase: str) -> tuple[torch.Tensor, list]:
    """Post the send of t to the next rank and the receive of the previous rank's t."""
    p, r = split.size(group), split.rank(group)
    for hops in _ledgers:
        hops.append(("kv" if tag == KV_TAG else "dkv", t.numel() * t.element_size(), phase))
    buf = torch.empty_like(t)
    hold(buf)  # a message buffer is activation memory while it lives (ActivationMeter)
    handles = [comms.isend(t, group=group, tag=tag, group_dst=(r + 1) % p),
               comms.irecv(buf, group=group, tag=tag, group_src=(r - 1) % p)]
    return buf, handles


def _wait(handles: list, what: str = "kv") -> None:
    """Wait for a hop; while spans are recorded, the wait is a span of its own ("wait kv" on
    the comm_wait track): the part of the ring's communication the compute did not hide."""
    t0 = time.perf_counter()
    for h in handles:
        if h is not None:
            h.wait()
    spans.add_span(f"wait {what}", t0, time.perf_counter(), track="comm_wait")


class RingAttention(torch.autograd.Function):
    """softmax(q k^T * scale [+ causal mask]) v over the group's whole sequence; (B, H, L, D) local."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale):
        """P steps of the ring: each block's attention merged into the running output."""
        p, r = split.size(group), split.rank(group)
        halves = len(_chunks(r, p))
        qs = q.chunk(halves, -2)
        outs: list = [None] * halves
        lses: list = [None] * halves
        kv = torch.stack([k, v])
        for step in range(p):
            src = (r - step) % p
            if step < p - 1:  # posted before the compute, so the hop hides behind it
                nxt, handles = _pass_on(kv, group, KV_TAG, "forward")
            ks, vs = kv[0].chunk(halves, -2), kv[1].chunk(halves, -2)
            for i, a in enumerate(_chunks(r, p)):
                for j, b in enumerate(_chunks(src, p)):
                    kind = pair_kind(a, b, causal)
                    if kind is not None:
                        o, lse = block_attention(qs[i], ks[j], vs[j], scale, kind)
                        outs[i], lses[i] = merge(outs[i], lses[i], o, lse)
            if step < p - 1:
                _wait(handles)
                kv = nxt
        out, lse = torch.cat(outs, -2), torch.cat(lses, -1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.scale = group, causal, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        """dq here; dk, dv carried around the ring beside their block back to its owner."""
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, scale = ctx.group, ctx.causal, ctx.scale
        p, r = split.size(group), split.rank(group)
        halves = len(_chunks(r, p))
        dout = dout.contiguous()
        delta = (dout * out).sum(-1)  # rowsum(dO * O): softmax's backward without the whole row
        qs, dos = q.chunk(halves, -2), dout.chunk(halves, -2)
        lses, deltas = lse.chunk(halves, -1), delta.chunk(halves, -1)
        dq = torch.zeros_like(q)
        dqs = dq.chunk(halves, -2)
        kv = torch.stack([k, v])
        incoming, acc_handles = None, []  # the running dK/dV on its way from the previous rank
        for step in range(p):
            src = (r - step) % p
            if step < p - 1:
                nxt, kv_handles = _pass_on(kv, group, KV_TAG, "backward")
            ks, vs = kv[0].chunk(halves, -2), kv[1].chunk(halves, -2)
            dkv = torch.zeros_like(kv)
            dks, dvs = dkv[0].chunk(halves, -2), dkv[1].chunk(halves, -2)
            for i, a in enumerate(_chunks(r, p)):
                for j, b in enumerate(_chunks(src, p)):
                    kind = pair_kind(a, b, causal)
                    if kind is None:
                        continue
                    prob = torch.exp(_scores(qs[i], ks[j], scale, kind) - lses[i].unsqueeze(-1))
                    dvs[j].add_(prob.transpose(-2, -1) @ dos[i])
                    ds = prob * (dos[i] @ vs[j].transpose(-2, -1) - deltas[i].unsqueeze(-1))
                    dqs[i].add_((ds @ ks[j]) * scale)
                    dks[j].add_((ds.transpose(-2, -1) @ qs[i]) * scale)
            if incoming is not None:  # block src's dK/dV from the ranks it visited before
                _wait(acc_handles, "dkv")
                dkv += incoming
            if p > 1:  # on to the next rank; after the last step, to the block's owner
                incoming, acc_handles = _pass_on(dkv, group, DKV_TAG, "backward")
            if step < p - 1:
                _wait(kv_handles)
                kv = nxt
        _wait(acc_handles, "dkv")
        mine = dkv if incoming is None else incoming
        return dq, mine[0], mine[1], None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None,
                   causal: bool = True, scale: float | None = None) -> torch.Tensor:
    """Attention of this rank's (B, H, L, D) queries over the keys and values of the whole group's
    sequence, split as split.shard splits it; differentiable (gradients through the ring)."""
    if not (q.shape == k.shape == v.shape) or q.dim() != 4:
        raise MicroDDPError(f"ring_attention needs q, k, v of one (batch, heads, seq, head_dim) "
                            f"shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    p = split.size(group)
    if p > 1 and q.shape[-2] % 2:
        raise MicroDDPError(f"ring_attention's local sequence {q.shape[-2]} must be two equal "
                            f"chunks (split.shard of a sequence that divides by {2 * p})")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), group, causal, scale)
