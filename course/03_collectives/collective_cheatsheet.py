"""Chapter 3: every collective on 4 ranks, before and after, one table each.

    python course/03_collectives/collective_cheatsheet.py

Each one here is microddp.collectives' version, built from send/recv alone, and each result
is checked against torch.distributed's own collective on the same inputs.
"""

import torch
import torch.distributed as dist

import microddp as mdp
from microddp import collectives as C

WORLD_SIZE = 4
WHAT = {
    "broadcast(src=0)": "every rank gets rank 0's tensor",
    "reduce(dst=0, sum)": "rank 0 gets the element-wise sum; the others keep theirs",
    "all_reduce(sum)": "every rank gets the element-wise sum",
    "all_gather": "every rank gets every rank's tensor, in rank order",
    "reduce_scatter(sum)": "rank i gets the sum over ranks of everyone's chunk i",
    "scatter(src=0)": "rank i gets chunk i of rank 0's list",
    "gather(dst=0)": "rank 0 gets every rank's tensor, in rank order",
}


def show(t) -> str:
    if isinstance(t, str):
        return t
    if isinstance(t, list):
        return "[" + ",".join(show(x) for x in t) + "]"
    return str(t.tolist()).replace(" ", "")


def cheatsheet(world) -> list[tuple[str, str, str, bool]]:
    """(collective, before, after, same as torch) for this rank, one entry per collective."""
    r, n = world.rank, world.world_size
    x = torch.tensor([1 + 2 * r, 2 + 2 * r])  # rank 0: [1,2], rank 1: [3,4], ...
    rows = []

    def record(name, before, ours, theirs):
        same = (all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
                if isinstance(ours, list) else torch.equal(ours, theirs))
        rows.append((name, show(before), show(ours), same))

    ref = x.clone()
    dist.broadcast(ref, src=0)
    record("broadcast(src=0)", x, C.tree_broadcast(x.clone(), src=0), ref)
    ref = x.clone()
    dist.reduce(ref, dst=0)
    ours = C.tree_reduce(x.clone(), dst=0)
    # only rank 0 is promised a result; the others keep their input (torch: unspecified)
    record("reduce(dst=0, sum)", x, ours, ref if r == 0 else ours)
    ref = x.clone()
    dist.all_reduce(ref)
    record("all_reduce(sum)", x, C.ring_all_reduce(x.clone()), ref)
    ref = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(ref, x)
    record("all_gather", x, C.ring_all_gather([torch.empty_like(x) for _ in range(n)], x), ref)
    parts = [x * 0 + 10 * i + r for i in range(n)]  # chunk i is meant for rank i
    ref = torch.empty_like(x)
    dist.reduce_scatter(ref, [p.clone() for p in parts])
    record("reduce_scatter(sum)", parts, C.ring_reduce_scatter(torch.empty_like(x), parts), ref)
    src_list = [torch.tensor([100 * i, 100 * i + 1]) for i in range(n)] if r == 0 else None
    ref, ours = torch.empty_like(x), torch.empty_like(x)
    dist.scatter(ref, src_list, src=0)
    C.scatter(ours, src_list, src=0)
    record("scatter(src=0)", src_list if r == 0 else "-", ours, ref)
    ref = [torch.empty_like(x) for _ in range(n)] if r == 0 else None
    ours = [torch.empty_like(x) for _ in range(n)] if r == 0 else None
    dist.gather(x, ref, dst=0)
    C.gather(x, ours, dst=0)
    if r == 0:
        record("gather(dst=0)", x, ours, ref)
    else:
        rows.append(("gather(dst=0)", show(x), "-", True))
    return rows


def main() -> None:
    per_rank = mdp.spawn(cheatsheet, WORLD_SIZE, backend="gloo")
    for i, (name, *_rest) in enumerate(per_rank[0]):
        same = all(rows[i][3] for rows in per_rank)
        print(f"{name}: {WHAT[name]}   (same as torch.distributed: {'yes' if same else 'NO'})")
        print(f"  {'rank':<5} {'before':<38} after")
        for rank, rows in enumerate(per_rank):
            print(f"  {rank:<5} {rows[i][1]:<38} {rows[i][2]}")
        print()


if __name__ == "__main__":
    main()
