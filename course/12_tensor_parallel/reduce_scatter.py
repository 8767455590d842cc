"""Chapter 12: sequence parallelism's reduce-scatter, three ways, timed side by side: shared
memory, microddp's ring (send/recv only) and gloo's own reduce_scatter, on 2 ranks.

    python course/12_tensor_parallel/reduce_scatter.py                 # 16 MiB, 20 rounds
    python course/12_tensor_parallel/reduce_scatter.py --mib 1 --rounds 5

The calls are interleaved (each round in a fresh random order, a barrier before each), and each
ratio to gloo comes with a 90% bootstrap interval; gloo-2 is gloo again (A/A). It also counts
the bytes the ring sends per rank: (p-1)/p of the tensor.
"""

import argparse

import torch
import torch.distributed as dist

import microddp as mdp
from microddp.collectives import ring_reduce_scatter, shm_reduce_scatter, traffic
from microddp.timing import compare, interleaved, median


def rank(world, mib, rounds):
    p = world.world_size
    n = int(mib * 2**20) // 4 // p * p
    x = torch.randn(n)
    out = torch.empty(n // p)
    ins = list(x.chunk(p))
    calls = {"shm": lambda: shm_reduce_scatter(out, ins),
             "ring": lambda: ring_reduce_scatter(out, ins),
             "gloo": lambda: dist.reduce_scatter(out, ins),
             "gloo-2": lambda: dist.reduce_scatter(out, ins)}
    times = interleaved(calls, rounds, 2, sync=dist.barrier)
    with traffic() as sent:
        ring_reduce_scatter(out, ins)
    return times, sent.bytes, n * 4


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, default=16, help="tensor size in MiB (default: 16)")
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds (default: 20)")
    args = parser.parse_args()
    times, sent, whole = mdp.spawn(rank, 2, args=(args.mib, args.rounds), backend="gloo")[0]
    print(f"reduce-scatter of {whole / 2**20:g} MiB on 2 ranks, median of {args.rounds} rounds")
    for name, t in times.items():
        ratio, (lo, hi) = compare(t, times["gloo"])
        print(f"{name:<7}{median(t) * 1e3:>9.2f} ms {ratio:>7.3f}x gloo  ({lo:.3f}-{hi:.3f})")
    print(f"the ring sent {sent} bytes per rank: {sent / whole:.3f} of the tensor")
