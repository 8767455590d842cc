"""Chapter 4: ranks on one host need no network: an all-reduce through shared memory.

    python course/04_allreduce_algorithms/shared_memory.py

Two ranks on one host, gloo over loopback TCP against microddp's shared-memory all-reduce
(what `microddp.comms.all_reduce` and microddp's DDP take by themselves when every rank of a
group is on this host), interleaved call by call, and beside them the least time this host's
memory allows: a copy and an add of the same sizes, timed on both ranks at once. Part 1
checks that both give the same bits; part 2 is the table; part 3 says where the time goes.
Full sweep: `microddp bench allreduce --algorithms shm`.
"""

import torch
import torch.distributed as dist

import microddp as mdp
from microddp.bench.allreduce import memory_bound, memory_contenders
from microddp.collectives import route
from microddp.timing import compare, interleaved, median

SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20]
REPEATS = 15


def same_bits(world) -> tuple[bool, bool]:
    """(shared memory taken?, the same bits as gloo?) on random floats of every size."""
    x = torch.randn(SIZES[-1] // 4, generator=torch.Generator().manual_seed(world.rank))
    ref = x.clone()
    dist.all_reduce(ref)  # gloo, over loopback TCP
    mine = x.clone()
    mdp.comms.all_reduce(mine)  # microddp: shared memory here
    return route.all_reduce_path(mine, "sum", None) is not None, torch.equal(mine, ref)


def timings(world, repeats: int) -> list[dict]:
    out = []
    for nbytes in SIZES:
        t = torch.zeros(nbytes // 4)  # zeros stay zeros: every call does the same work
        calls = {"gloo": lambda t=t: dist.all_reduce(t),
                 "shm": lambda t=t: mdp.comms.all_reduce(t),
                 **memory_contenders(nbytes, world.world_size)}
        times = interleaved(calls, repeats, 2, dist.barrier)
        bound = memory_bound(nbytes, world.world_size, times["mem-copy"], times["mem-add"],
                             times["mem-add-slice"])
        out.append({"bytes": nbytes, "gloo": median(times["gloo"]),
                    "shm": median(times["shm"]), "ratio": compare(times["shm"], times["gloo"]),
                    "bound": bound})
    return out


def label(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def main() -> None:
    print("Part 1: the same bits as gloo")
    took, same = mdp.spawn(same_bits, 2, timeout=120, backend="gloo")[0]
    print(f"  shared memory taken: {'yes' if took else 'NO'}; "
          f"{label(SIZES[-1])} of random floats, equal to gloo's bit for bit: "
          f"{'yes' if same else 'NO'}")
    print(f"\nPart 2: 2 ranks, median of {REPEATS} interleaved calls each (ms)")
    print(f"  {'size':>7} {'gloo':>8} {'shm':>8} {'shm/gloo':>9} {'memory bound':>13} "
          f"{'shm/bound':>10}")
    rows = mdp.spawn(timings, 2, (REPEATS,), timeout=300, backend="gloo")[0]
    for r in rows:
        ratio, _ = r["ratio"]
        print(f"  {label(r['bytes']):>7} {r['gloo'] * 1e3:>8.3f} {r['shm'] * 1e3:>8.3f} "
              f"{ratio:>9.2f} {r['bound'] * 1e3:>13.3f} {r['shm'] / r['bound']:>10.2f}")
    print("\nPart 3: where the time goes")
    print("  gloo over loopback: every byte is copied into the kernel and out again, a message")
    print("  is a system call and a hand-over to gloo's thread on each side: tens of")
    print("  microseconds before the first byte moves, and two copies per byte after.")
    print("  shared memory: each rank copies its tensor into a segment both ranks map, waits")
    print("  for a counter the other rank writes, and adds the other's copy into its own tensor.")
    print("  Small tensors: one wait instead of a round trip through the kernel. Large ones:")
    print("  the memory bus is the limit (the bound column), shared by both ranks.")


if __name__ == "__main__":
    main()
