"""Tensors as users hand them to the collectives: parameters that require grad, and outputs
that are not contiguous. Each result is compared with torch.distributed's on plain copies."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn import Parameter

import microddp
from microddp import collectives as C


def _param(values: torch.Tensor) -> Parameter:
    return Parameter(values.clone())


def _all_reduces(rank: int) -> list[tuple[str, bool]]:
    """Every all-reduce on a Parameter, the ring on each of its paths: (name, equal to torch)."""
    out = []
    # 10 elements: whole chunks, every receive posted first (3 ranks) or receive-first (2);
    # 2 MiB chunks on 3 ranks: the pipeline; 16-byte segments: the pipeline, many messages.
    for n, kw in ((10, {}), (3 << 19, {}), (40, {"segment_bytes": 16})):
        x = torch.arange(n, dtype=torch.float32) + rank
        ref = x.clone()
        dist.all_reduce(ref)
        for name, fn in (("ring", C.ring_all_reduce), ("tree", C.tree_all_reduce),
                         ("naive", C.naive_all_reduce)):
            p = _param(x)
            got = fn(p, **(kw if fn is C.ring_all_reduce else {}))
            out.append((f"{name} n={n} {kw}", got is p and p.requires_grad and p.grad is None
                        and torch.equal(p.detach(), ref)))
    return out


def _rooted(rank: int, size: int) -> list[tuple[str, bool]]:
    """The other six collectives, with every tensor they write (and read) a Parameter."""
    x = torch.arange(6.0) * (rank + 1)
    out = []
    b, ref = _param(x), x.clone()
    C.tree_broadcast(b, 0)
    dist.broadcast(ref, 0)
    out.append(("tree_broadcast", torch.equal(b.detach(), ref)))
    r, ref = _param(x), x.clone()
    C.tree_reduce(r, 0, "max")
    dist.reduce(ref, 0, dist.ReduceOp.MAX)
    out.append(("tree_reduce", rank != 0 or torch.equal(r.detach(), ref)))
    parts = [_param(x + i) for i in range(size)]
    rs, ref = _param(torch.zeros(6)), torch.zeros(6)
    C.ring_reduce_scatter(rs, parts)
    dist.reduce_scatter(ref, [t.detach().clone() for t in parts])
    out.append(("ring_reduce_scatter", torch.equal(rs.detach(), ref)))
    ag = [_param(torch.zeros(6)) for _ in range(size)]
    ref_ag = [torch.zeros(6) for _ in range(size)]
    C.ring_all_gather(ag, _param(x))
    dist.all_gather(ref_ag, x)
    out.append(("ring_all_gather", all(torch.equal(a.detach(), b)
                                       for a, b in zip(ag, ref_ag, strict=True))))
    sc, ref = _param(torch.zeros(6)), torch.zeros(6)
    sources = [_param(x + 10 * i) for i in range(size)] if rank == 0 else None
    C.scatter(sc, sources, 0)
    dist.scatter(ref, [t.detach().clone() for t in sources] if sources else None, 0)
    out.append(("scatter", torch.equal(sc.detach(), ref)))
    g = [_param(torch.zeros(6)) for _ in range(size)] if rank == 0 else None
    ref_g = [torch.zeros(6) for _ in range(size)] if rank == 0 else None
    C.gather(_param(x), g, 0)
    dist.gather(x, ref_g, 0)
    out.append(("gather", rank != 0 or all(torch.equal(a.detach(), b)
                                           for a, b in zip(g, ref_g, strict=True))))
    return out


def _autograd_after(rank: int) -> dict[str, object]:
    """Autograd still works on a reduced parameter, and refuses a backward through a value
    that a collective changed after autograd saved it."""
    w = _param(torch.ones(3) * (rank + 1))
    C.ring_all_reduce(w)
    (w * 2).sum().backward()
    y = _param(torch.ones(3)) * 3
    z = (y * y).sum()  # saves y for backward
    C.ring_all_reduce(y)
    try:
        z.backward()
        refused = "no error"
    except RuntimeError as e:
        refused = str(e)
    return {"grad": w.grad.tolist(), "value": w.detach().tolist(), "refused": refused}


def _requires_grad(world) -> dict[str, object]:
    checks = _all_reduces(world.rank) + _rooted(world.rank, world.world_size)
    return {"failed": [name for name, ok in checks if not ok], "count": len(checks),
            **_autograd_after(world.rank)}


@pytest.mark.parametrize("world_size", [2, 3])
def test_parameters_that_require_grad_are_reduced_in_place_like_torch(world_size):
    out = microddp.launch.spawn(_requires_grad, world_size, timeout=90)
    total = sum(range(1, world_size + 1))
    for rank in out:
        assert rank["count"] == 15 and rank["failed"] == []
        assert rank["value"] == [float(total)] * 3 and rank["grad"] == [2.0] * 3
        assert "modified by an inplace operation" in rank["refused"], rank["refused"]


def _strided_outputs(world) -> list[str]:
    """Outputs (and inputs) that are transposed views: the results land in them as in
    contiguous ones."""
    p, rank = world.world_size, world.rank

    def t(values: torch.Tensor) -> torch.Tensor:  # a 3x2 view of a transposed 2x3 matrix
        view = values.reshape(2, 3).clone().t()
        assert not view.is_contiguous()
        return view

    x = torch.arange(6.0) + 10 * rank
    bad = []
    rs = t(torch.zeros(6))
    parts = [t(x + i) for i in range(p)]
    ref = torch.zeros(3, 2)
    dist.reduce_scatter(ref, [q.contiguous() for q in parts])
    C.ring_reduce_scatter(rs, parts)
    bad += [] if torch.equal(rs, ref) else ["ring_reduce_scatter"]
    ag = [t(torch.zeros(6)) for _ in range(p)]
    ref_ag = [torch.zeros(3, 2) for _ in range(p)]
    dist.all_gather(ref_ag, t(x).contiguous())
    C.ring_all_gather(ag, t(x))
    bad += [] if all(map(torch.equal, ag, ref_ag)) else ["ring_all_gather"]
    sc, ref = t(torch.zeros(6)), torch.zeros(3, 2)
    sources = [t(x + 100 * i) for i in range(p)] if rank == 1 else None
    dist.scatter(ref, [q.contiguous() for q in sources] if sources else None, 1)
    C.scatter(sc, sources, 1)
    bad += [] if torch.equal(sc, ref) else ["scatter"]
    g = [t(torch.zeros(6)) for _ in range(p)] if rank == 1 else None
    ref_g = [torch.zeros(3, 2) for _ in range(p)] if rank == 1 else None
    dist.gather(t(x).contiguous(), ref_g, 1)
    C.gather(t(x), g, 1)
    bad += [] if rank != 1 or all(map(torch.equal, g, ref_g)) else ["gather"]
    return bad


def test_non_contiguous_outputs_receive_the_results():
    assert microddp.launch.spawn(_strided_outputs, 3, timeout=60) == [[]] * 3
