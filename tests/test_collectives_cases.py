"""Rank-side helpers for the collectives tests (no tests here): run each of our algorithms
and the torch.distributed collective of the same name on the same inputs, and compare."""

from __future__ import annotations

import torch
import torch.distributed as dist

from microddp import collectives as C
from microddp.collectives.ring.loops import pair_all_reduce_
from microddp.transport.peers import Peers

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "int64": torch.int64}
TORCH_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "product": dist.ReduceOp.PRODUCT,
             "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}


def make(seed: int, rank: int, shape: tuple, dtype: str, op: str) -> torch.Tensor:
    """Rank `rank`'s input: different on every rank, reproducible from the seed."""
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    dt = DTYPES[dtype]
    if dt == torch.int64:
        hi = 40 if op == "product" else 1 << 40  # products stay far from overflow anyway
        return torch.randint(-hi, hi, shape, generator=g, dtype=dt)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    if op == "product":  # keep products of 8 values in a sane range
        x = x.sign() * (0.5 + x.abs().clamp(max=1.5))
    return x.to(dt)


def tolerance(op: str, dtype: str, p: int, inputs_abs_sum: torch.Tensor,
              ref: torch.Tensor) -> torch.Tensor:
    """A rigorous bound on |ours - torch| for float sums/products computed in another order.

    Each side rounds p-1 times, each rounding off by at most u = eps/2 of the value it rounds:
    a partial sum (at most the sum of |inputs|, `inputs_abs_sum`) or, for a product, the
    running product (about |ref|). Two sides make that (p-1) eps; avg's division rounds once
    more on each side (eps |ref|). The 10% covers the partial results' own rounding, which
    can lift them a little above the exact magnitudes (at most 3% for bfloat16 on 8 ranks).
    """
    eps = torch.finfo(DTYPES[dtype]).eps
    r = ref.double().abs()
    if op in ("sum", "avg"):
        scale = inputs_abs_sum / (p if op == "avg" else 1)
        return 1.1 * (p - 1) * eps * scale + eps * r
    return 1.1 * (p - 1) * eps * r


def compare(where: str, ours: torch.Tensor, ref: torch.Tensor, op: str, dtype: str, p: int,
            abs_sum: torch.Tensor | None) -> str | None:
    """None if equal (exactly, or within the float bound); else a description."""
    if ours.shape != ref.shape or ours.dtype != ref.dtype:
        return f"{where}: got {tuple(ours.shape)} {ours.dtype}, torch {tuple(ref.shape)} {ref.dtype}"
    if DTYPES[dtype] == torch.int64 or op in ("min", "max") or abs_sum is None:
        if torch.equal(ours, ref):
            return None
        return f"{where}: differs from torch exactly-compared ({ours.flatten()[:4]} vs {ref.flatten()[:4]})"
    err = (ours.double() - ref.double()).abs()
    bound = tolerance(op, dtype, p, abs_sum, ref)
    if bool((err <= bound).all()):
        return None
    worst = (err - bound).argmax()
    return (f"{where}: {op} {dtype} differs by {err.flatten()[worst].item():.3g} "
            f"> bound {bound.flatten()[worst].item():.3g}")


def torch_all_reduce(x: torch.Tensor, op: str, group) -> torch.Tensor:
    y = x.clone()
    dist.all_reduce(y, TORCH_OPS[op], group=group)
    if op == "avg":
        y.div_(dist.get_world_size(group))
    return y


def run_case(case: dict, group=None) -> list[str]:
    """Every algorithm against torch on one (seed, shape, dtype, op); returns the failures."""
    seed, shape, dtype, op = case["seed"], tuple(case["shape"]), case["dtype"], case["op"]
    me, p = dist.get_rank(group), dist.get_world_size(group)
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    root = ranks[case["root"] % p]
    x = make(seed, me, shape, dtype, op)
    fails = []
    abs_sum = None
    if x.is_floating_point():
        abs_sum = x.double().abs()
        dist.all_reduce(abs_sum, group=group)
    valid_op = not (op == "avg" and DTYPES[dtype] == torch.int64)
    if valid_op:
        ref = torch_all_reduce(x, op, group)
        for name, fn, kw in (("ring", C.ring_all_reduce, {"segment_bytes": case["segment"]}),
                             ("tree", C.tree_all_reduce, {}), ("naive", C.naive_all_reduce, {})):
            fails.append(compare(f"{name}_all_reduce", fn(x.clone(), op, group, **kw), ref, op,
                                 dtype, p, abs_sum))
        if p == 2:  # the pair loop (the default for large chunks on 2 ranks), in 3 segments
            y = x.clone()
            pair_all_reduce_(Peers(group), y.view(-1), op, 3)
            fails.append(compare("pair_all_reduce_", y, ref, op, dtype, p, abs_sum))
        # reduce: torch leaves non-destination tensors unspecified, so compare only on dst
        y = x.clone()
        dist.reduce(y, root, TORCH_OPS[op], group=group)
        ours = C.tree_reduce(x.clone(), root, op, group)
        if ranks[me] == root:
            if op == "avg":
                y.div_(p)
            fails.append(compare("tree_reduce", ours, y, op, dtype, p, abs_sum))
        else:
            fails.append(None if torch.equal(ours, x) else "tree_reduce changed a non-dst input")
        # reduce_scatter: chunk i of every rank's list goes to rank i
        parts = [make(seed + 7 * (i + 1), me, shape, dtype, op) for i in range(p)]
        ref_rs = torch.empty_like(x)
        dist.reduce_scatter(ref_rs, [t.clone() for t in parts], TORCH_OPS[op], group=group)
        if op == "avg":
            ref_rs.div_(p)
        keep = [t.clone() for t in parts]
        ours = C.ring_reduce_scatter(torch.empty_like(x), parts, op, group)
        rs_abs = None
        if abs_sum is not None:
            rs_abs = parts[me].double().abs()
            rs_abs_all = [t.double().abs() for t in parts]
            rs_abs = torch.empty_like(rs_abs)
            dist.reduce_scatter(rs_abs, rs_abs_all, group=group)
        fails.append(compare("ring_reduce_scatter", ours, ref_rs, op, dtype, p, rs_abs))
        if not all(torch.equal(a, b) for a, b in zip(keep, parts, strict=True)):
            fails.append("ring_reduce_scatter modified its inputs")
    else:
        try:
            C.ring_all_reduce(x.clone(), op, group)
            fails.append("ring_all_reduce accepted avg on int64")
        except Exception as e:  # noqa: BLE001
            fails.append(None if "floating-point" in str(e) else f"wrong error: {e}")
    ref_ag = [torch.empty_like(x) for _ in range(p)]
    dist.all_gather(ref_ag, x, group=group)
    ours_ag = C.ring_all_gather([torch.empty_like(x) for _ in range(p)], x, group)
    fails += [None if torch.equal(a, b) else f"ring_all_gather[{i}] differs"
              for i, (a, b) in enumerate(zip(ours_ag, ref_ag, strict=True))]
    b_ref = x.clone()
    dist.broadcast(b_ref, root, group=group)
    fails.append(None if torch.equal(C.tree_broadcast(x.clone(), root, group), b_ref)
                 else "tree_broadcast differs")
    if ranks[me] == root:
        s_list = [make(seed + 100 + i, me, shape, dtype, op) for i in range(p)]
        g_ref, g_ours = [torch.empty_like(x) for _ in range(p)], [torch.empty_like(x) for _ in range(p)]
    else:
        s_list, g_ref, g_ours = None, None, None
    s_ref, s_ours = torch.empty_like(x), torch.empty_like(x)
    dist.scatter(s_ref, s_list, root, group=group)
    C.scatter(s_ours, s_list, root, group)
    fails.append(None if torch.equal(s_ours, s_ref) else "scatter differs")
    dist.gather(x, g_ref, root, group=group)
    C.gather(x, g_ours, root, group)
    if g_ref is not None:
        fails += [None if torch.equal(a, b) else f"gather[{i}] differs"
                  for i, (a, b) in enumerate(zip(g_ours, g_ref, strict=True))]
    return [f"{f} [case {case}]" for f in fails if f]


def run_cases(world, cases: list[dict], group_ranks: list[int] | None = None) -> list[str]:
    """Run every case on the default group, or on a sub-group of `group_ranks`."""
    if not dist.is_initialized():  # a world of one has no process group; torch's needs one
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    group = dist.new_group(group_ranks) if group_ranks is not None else None
    if group_ranks is not None and world.rank not in group_ranks:
        return []
    fails = []
    for case in cases:
        fails += run_case(case, group)
    return fails
