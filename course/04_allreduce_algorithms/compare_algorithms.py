"""Chapter 4: naive vs ring vs tree all-reduce: what each rank sends, and what it costs.

    python course/04_allreduce_algorithms/compare_algorithms.py

Part 1 runs the three algorithms for real on 2, 4 and 8 ranks, checks each result against
torch.distributed.all_reduce, and counts the bytes every rank sends. Part 2 feeds the same
counts into the alpha-beta cost model to show which algorithm wins at which size. Part 3
shows the ring cutting large chunks into segments, so that adding one overlaps the next.
Timings on this machine: `microddp bench allreduce`.
"""

import torch
import torch.distributed as dist

import microddp as mdp
from microddp import collectives as C
from microddp.collectives.cost import CostModel
from microddp.collectives.ring import PIPELINE_MIN_CHUNK, PIPELINE_SEGMENT

NBYTES = 1 << 20  # a 1 MiB float32 tensor
ALGORITHMS = {
    "naive": C.naive_all_reduce,
    "ring": C.ring_all_reduce,  # one message per step, as drawn in the chapter
    "tree": C.tree_all_reduce,
}
# Round numbers, not measurements: a 20 us message latency, 1 GB/s links, 4 GB/s adds.
MODEL = CostModel(alpha=20e-6, beta=1 / 1e9, gamma=1 / 4e9)


def count(world) -> dict:
    """For each algorithm: bytes and messages this rank sent, and whether it matched torch."""
    x = torch.randn(NBYTES // 4, generator=torch.Generator().manual_seed(world.rank))
    ref = x.clone()
    dist.all_reduce(ref)
    out = {}
    for name, fn in ALGORITHMS.items():
        y = x.clone()
        with C.traffic() as sent:
            fn(y, check=False)  # no metadata check: count the data messages only
        out[name] = (sent.bytes, sent.messages, torch.allclose(y, ref, rtol=1e-5, atol=1e-5))
    return out


def part1() -> None:
    print(f"Part 1: bytes sent per rank to all-reduce a {NBYTES >> 20} MiB tensor (n = 1 MiB)")
    print(f"  {'ranks':>5}  {'algorithm':<6} {'busiest rank':>13} {'quietest rank':>14} "
          f"{'messages':>9}  matches torch")
    for p in (2, 4, 8):
        per_rank = mdp.spawn(count, p, timeout=120)
        for name in ALGORITHMS:
            sent = [r[name][0] for r in per_rank]
            msgs = max(r[name][1] for r in per_rank)
            ok = all(r[name][2] for r in per_rank)
            print(f"  {p:>5}  {name:<6} {max(sent) / NBYTES:>11.2f} n {min(sent) / NBYTES:>12.2f} n "
                  f"{msgs:>9}  {'yes' if ok else 'NO'}")
    print("  ring: every rank sends 2(p-1)/p n, which stays below 2n however many ranks there")
    print("  are; naive: the root sends (p-1) n, growing with p; tree: log2(p) n per rank.")


def part2() -> None:
    print("\nPart 2: predicted time (alpha 20 us, 1 GB/s links, 4 GB/s adds)")
    for nbytes, label in ((4 << 10, "4 KiB"), (64 << 20, "64 MiB")):
        print(f"  {label} tensor:")
        print(f"  {'ranks':>7} " + "".join(f"{name:>12}" for name in ALGORITHMS) + "   fastest")
        for p in (2, 4, 8, 16, 64):
            t = {name: MODEL.predict(f"{name}_all_reduce", nbytes, p) for name in ALGORITHMS}
            print(f"  {p:>7} " + "".join(f"{t[name] * 1e3:>10.3f}ms" for name in ALGORITHMS)
                  + f"   {min(t, key=t.get)}")
    print("  small tensors: latency (alpha) dominates and the tree's log2(p) rounds win;")
    print("  large tensors: bandwidth (beta) dominates and the ring's constant volume wins.")


def segmented(world) -> dict:
    """The same large tensor all-reduced by the ring twice: chunks whole, then by default."""
    n = PIPELINE_MIN_CHUNK * world.world_size // 4  # float32 elements: chunks of exactly that
    x = torch.randn(n, generator=torch.Generator().manual_seed(world.rank))
    ref = x.clone()
    dist.all_reduce(ref)
    out = {}
    for label, kw in (("whole chunks", {"segment_bytes": PIPELINE_MIN_CHUNK}),
                      ("default", {})):
        y = x.clone()
        with C.traffic() as sent:
            C.ring_all_reduce(y, check=False, **kw)
        out[label] = (sent.bytes, sent.messages, torch.allclose(y, ref, rtol=1e-5, atol=1e-5))
    return out


def part3() -> None:
    mib = PIPELINE_MIN_CHUNK >> 20
    print(f"\nPart 3: a {2 * mib} MiB tensor on 2 ranks ({mib} MiB chunks): the ring pipelines "
          f"chunks of {mib} MiB or more in {PIPELINE_SEGMENT >> 20} MiB segments")
    r = mdp.spawn(segmented, 2, timeout=120)[0]
    for label, (nbytes, messages, ok) in r.items():
        print(f"  {label:<13} {nbytes >> 20:>4} MiB sent in {messages:>3} messages  "
              f"matches torch: {'yes' if ok else 'NO'}")
    print("  same bytes, more messages: while one segment is added the next is on the wire.")


def main() -> None:
    part1()
    part2()
    part3()


if __name__ == "__main__":
    main()
