"""Chapter 6, script 1: who reads which samples, and why the order must change every epoch.

    python course/06_training/sharding.py

No processes needed: a sampler only needs to know its rank and the world size, so we can ask
every "rank" in turn from one process and look at all the shards side by side.
"""

from torch.utils.data import DistributedSampler

from microddp.data import ShardedBatchSampler

WORLD = 2


def torch_orders(n: int, epochs: int, call_set_epoch: bool) -> list[list[list[int]]]:
    """orders[epoch][rank]: the indices torch's DistributedSampler hands each rank."""
    samplers = [DistributedSampler(range(n), num_replicas=WORLD, rank=r, seed=0)
                for r in range(WORLD)]
    orders = []
    for epoch in range(epochs):
        if call_set_epoch:
            for s in samplers:
                s.set_epoch(epoch)  # the line everyone forgets
        orders.append([list(s) for s in samplers])
    return orders


def main() -> None:
    n = 10
    print(f"torch's DistributedSampler, {n} samples, {WORLD} ranks, WITHOUT set_epoch:")
    forgot = torch_orders(n, 3, call_set_epoch=False)
    for epoch, ranks in enumerate(forgot):
        print(f"  epoch {epoch}: " + "  ".join(f"rank {r} {o}" for r, o in enumerate(ranks)))
    print(f"  same order every epoch: {forgot[0] == forgot[1] == forgot[2]}")

    print("with set_epoch(epoch) each epoch:")
    fixed = torch_orders(n, 3, call_set_epoch=True)
    for epoch, ranks in enumerate(fixed):
        print(f"  epoch {epoch}: " + "  ".join(f"rank {r} {o}" for r, o in enumerate(ranks)))
    print(f"  distinct epoch orders: {len({str(e) for e in fixed})} of 3")

    batch = 4
    print(f"microddp's ShardedBatchSampler, global batch {batch}: no set_epoch to forget")
    print("  (one entry per step: [rank 0's share], [rank 1's share])")
    ours = [ShardedBatchSampler(n, batch, r, WORLD, seed=0) for r in range(WORLD)]
    seen = []
    for epoch in range(3):
        steps = list(zip(*[list(s) for s in ours], strict=True))  # steps[i][rank]
        print(f"  epoch {epoch}: " + "  ".join(str(list(step)) for step in steps))
        seen.append(str(steps))
        flat = [i for step in steps for shard in step for i in shard]
        assert sorted(flat) == list(range(n))  # disjoint and complete, every epoch
    print(f"  distinct epoch orders: {len(set(seen))} of 3")

    n = 11
    print(f"an uneven data set: {n} samples over {WORLD} ranks")
    pad = [list(DistributedSampler(range(n), num_replicas=WORLD, rank=r, shuffle=False))
           for r in range(WORLD)]
    flat = pad[0] + pad[1]
    print(f"  torch pads to {len(flat)} indices: sample {max(set(flat), key=flat.count)} is "
          f"seen twice, so {len(flat) - n} duplicate(s) per epoch")
    ours = [ShardedBatchSampler(n, batch, r, WORLD, shuffle=False) for r in range(WORLD)]
    sizes = [[len(b) for b in s] for s in ours]
    print(f"  microddp: per-rank batch sizes {sizes}: the last global batch of "
          f"{n % batch} is split {sizes[0][-1]}+{sizes[1][-1]}, nothing seen twice")


if __name__ == "__main__":
    main()
