"""Chapter 11: the hierarchical all-reduce, on 4 ranks of this machine seen as 2 hosts of 2.

    python course/11_many_hosts/hierarchical.py

A flat ring over ranks on several hosts makes every rank whose next neighbour sits on another
host send its whole share, 2(p-1)/p of the tensor, across the slow link. The hierarchical
all-reduce sums inside each host first, so only one chunk per rank crosses, once each way.
This script runs both on the same integer tensors (sums exact in any order), written out step
by step with the chapter 4 collectives and as microddp.collectives.hierarchical_all_reduce,
checks that all three agree bit for bit, and counts the bytes that cross between the hosts.
"""

import torch
import torch.distributed as dist

import microddp as mdp
from microddp import collectives as C

HOSTS = ["host-a", "host-a", "host-b", "host-b"]  # rank r runs on HOSTS[r], as if
NBYTES = 4 << 20  # a 4 MiB tensor of int64
MiB = 1 << 20


def flat(x: torch.Tensor, rank: int) -> tuple[torch.Tensor, int]:
    """The ring over all ranks; bytes this rank sends to another host (its next neighbour)."""
    y = x.clone()
    with C.traffic() as sent:
        C.ring_all_reduce(y, check=False)
    crosses = HOSTS[rank] != HOSTS[(rank + 1) % len(HOSTS)]
    return y, sent.bytes if crosses else 0


def three_steps(x: torch.Tensor, rank: int, intra, rail) -> tuple[torch.Tensor, int]:
    """Inside the host, across hosts on this rank's rail, inside the host again."""
    local = dist.get_rank(intra)  # 0 or 1: which chunk this rank looks after
    chunks = list(x.chunk(2))
    mine = torch.empty_like(chunks[local])
    C.ring_reduce_scatter(mine, chunks, group=intra)  # 1. my chunk, summed over my host
    with C.traffic() as sent:
        C.ring_all_reduce(mine, group=rail, check=False)  # 2. ... and over the other host
    gathered = [torch.empty_like(c) for c in chunks]
    C.ring_all_gather(gathered, mine, group=intra)  # 3. every chunk, on every rank
    return torch.cat(gathered), sent.bytes  # every byte of step 2 crosses between hosts


def main(world) -> dict:
    # Every rank forms every group, in the same order (new_group is collective).
    hosts = {h: [r for r, x in enumerate(HOSTS) if x == h] for h in dict.fromkeys(HOSTS)}
    intra = [dist.new_group(ranks) for ranks in hosts.values()][world.rank // 2]
    rails = [dist.new_group([ranks[j] for ranks in hosts.values()]) for j in range(2)]
    x = torch.randint(-1000, 1000, (NBYTES // 8,), dtype=torch.int64,
                      generator=torch.Generator().manual_seed(world.rank))
    y_flat, flat_cross = flat(x, world.rank)
    y_steps, steps_cross = three_steps(x, world.rank, intra, rails[world.rank % 2])
    y_lib = C.hierarchical_all_reduce(x.clone(), hierarchy=C.Hierarchy(HOSTS))
    return {"same": torch.equal(y_flat, y_steps) and torch.equal(y_flat, y_lib),
            "flat": flat_cross, "hierarchical": steps_cross}


if __name__ == "__main__":
    ranks = mdp.spawn(main, len(HOSTS), backend="gloo")
    flat_total = sum(r["flat"] for r in ranks)
    hier_total = sum(r["hierarchical"] for r in ranks)
    print(f"{len(HOSTS)} ranks on 2 hosts, a {NBYTES // MiB} MiB tensor")
    print(f"flat ring:    {flat_total / MiB:.2f} MiB cross between the hosts (ranks "
          f"{', '.join(str(r) for r, x in enumerate(ranks) if x['flat'])} send "
          f"{max(r['flat'] for r in ranks) / MiB:.2f} MiB each)")
    print(f"hierarchical: {hier_total / MiB:.2f} MiB cross between the hosts (every rank sends "
          f"{max(r['hierarchical'] for r in ranks) / MiB:.2f} MiB on its rail)")
    print(f"flat / hierarchical: {flat_total / hier_total:.2f} times the bytes between hosts")
    same = all(r["same"] for r in ranks)
    print(f"same result, bit for bit: {'yes' if same else 'NO'} (flat ring, the three steps, "
          "hierarchical_all_reduce)")
