"""Chapter 4: naive vs ring vs tree all-reduce: what each rank sends, and what it costs.

    python course/04_allreduce_algorithms/compare_algorithms.py

Part 1 runs the three algorithms for real on 2, 4 and 8 ranks, checks each result against
torch.distributed.all_reduce, and counts the bytes every rank sends. Part 2 feeds the same
counts into the alpha-beta cost model to show which algorithm wins at which size. Part 3
shows the ring cutting large chunks into segments, so that adding one overlaps the next.
Part 4 fits the model's message cost to this machine: one line, or two if the link is
faster per byte below some size. Part 5 times the 2-rank ring on one connection and on one
per direction. Full timings on this machine: `microddp bench allreduce`.
"""

import random
import statistics
import time

import torch
import torch.distributed as dist

# Part 5 reaches into the ring's own loop (private modules): timing one connection against
# two in one interleaved run needs both at once, and ring_all_reduce uses one per process.
import microddp as mdp
from microddp import collectives as C
from microddp.collectives.cost import CostModel, fit_lines
from microddp.collectives.ring import (
    PIPELINE_MIN_CHUNK,
    PIPELINE_SEGMENT,
    planned_ring_all_reduce_,
)
from microddp.collectives.ring.plan import make_plan
from microddp.timing import compare, interleaved
from microddp.transport.duplex import duplex
from microddp.transport.peers import Peers

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
        per_rank = mdp.spawn(count, p, timeout=120, backend="gloo")
        for name in ALGORITHMS:
            sent = [r[name][0] for r in per_rank]
            msgs = max(r[name][1] for r in per_rank)
            ok = all(r[name][2] for r in per_rank)
            print(f"  {p:>5}  {name:<6} {max(sent) / NBYTES:>11.2f} n "
                  f"{min(sent) / NBYTES:>12.2f} n {msgs:>9}  {'yes' if ok else 'NO'}")
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
    print("  large tensors: the cost per byte (beta) dominates; the ring's constant volume wins.")


SEGMENTED_BYTES = 32 << 20  # a tensor large enough to be cut on any world size


def segmented(world) -> dict:
    """The same large tensor all-reduced by the ring twice: chunks whole, then by default."""
    n = SEGMENTED_BYTES // 4  # float32 elements
    x = torch.randn(n, generator=torch.Generator().manual_seed(world.rank))
    ref = x.clone()
    dist.all_reduce(ref)
    out = {}
    whole = {"segment_bytes": SEGMENTED_BYTES // world.world_size}  # one segment per chunk
    for label, kw in (("whole chunks", whole), ("default", {})):
        y = x.clone()
        with C.traffic() as sent:
            C.ring_all_reduce(y, check=False, **kw)
        out[label] = (sent.bytes, sent.messages, torch.allclose(y, ref, rtol=1e-5, atol=1e-5))
    return out


def part3() -> None:
    mib = SEGMENTED_BYTES >> 20
    print(f"\nPart 3: a {mib} MiB tensor on 4 ranks ({mib // 4} MiB chunks). On 3 or more ranks "
          f"the ring cuts chunks of {PIPELINE_MIN_CHUNK >> 20} MiB or more into segments of at "
          f"most {PIPELINE_SEGMENT >> 20} MiB")
    r = mdp.spawn(segmented, 4, timeout=180, backend="gloo")[0]
    for label, (nbytes, messages, ok) in r.items():
        print(f"  {label:<13} {nbytes >> 20:>4} MiB sent in {messages:>3} messages  "
              f"matches torch: {'yes' if ok else 'NO'}")
    print("  same bytes, more messages: while one segment is added the next is on the wire.")


EXCHANGE_SIZES = [16 << 10, 64 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20]


def exchange_times(world, repeats: int) -> list[float]:
    """Median seconds for the two ranks to swap m bytes (one ring step on 2 ranks), per size.

    Sizes take turns in a shuffled order each round (the same on both ranks), so a busy spell
    on the machine hits every size alike instead of all the calls of one. Each call's time
    is the slower rank's: an exchange is done when both have their bytes.
    """
    other = 1 - world.rank
    buffers = {n: (torch.ones(n // 4), torch.empty(n // 4)) for n in EXCHANGE_SIZES}
    times: dict[int, list[float]] = {n: [] for n in EXCHANGE_SIZES}
    order = random.Random(0)
    for i in range(repeats + 2):  # the first two rounds warm the connection up, untimed
        for nbytes in order.sample(EXCHANGE_SIZES, len(EXCHANGE_SIZES)):
            out, inbox = buffers[nbytes]
            dist.barrier()
            start = time.perf_counter()
            sent = dist.isend(out, other)
            dist.recv(inbox, other)
            sent.wait()
            took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            if i >= 2:
                times[nbytes].append(took.item())
    return [statistics.median(times[n]) for n in EXCHANGE_SIZES]


def rate(beta: float) -> str:
    # A flat line (beta 0) happens when the sizes on one side all took about the same time.
    return f"{1 / beta / 1e9:.3f} GB/s" if beta > 0 else "flat (no cost per byte)"


def part4(repeats: int = 15) -> None:
    print(f"\nPart 4: fitting alpha and beta to this machine (2 ranks swap m bytes, median of "
          f"{repeats})")
    measured = mdp.spawn(exchange_times, 2, (repeats,), timeout=120, backend="gloo")[0]
    (alpha, beta), small = fit_lines(EXCHANGE_SIZES, measured)
    model = CostModel(alpha, beta, 0.0, small)
    if small is None:
        print(f"  one line: alpha {alpha * 1e6:.1f} us, {rate(beta)}")
    else:
        print(f"  up to {small[0] >> 10} KiB: alpha {small[1] * 1e6:.1f} us, {rate(small[2])}")
        print(f"  larger:        alpha {alpha * 1e6:.1f} us, {rate(beta)}")
    print(f"  {'m':>8}  {'measured':>10}  {'fitted':>10}  {'error':>6}")
    for nbytes, took in zip(EXCHANGE_SIZES, measured, strict=True):
        fitted = model.ring_all_gather(2 * nbytes, 2)  # on 2 ranks: one message of n/2 bytes
        print(f"  {nbytes >> 10:>5} KiB  {took * 1e3:>8.3f}ms  {fitted * 1e3:>8.3f}ms  "
              f"{fitted / took - 1:>+6.0%}")
    print("  a second line is kept only if it fits better than 95% of noisy straight lines would.")


DUPLEX_BYTES = 8 << 20


def connections(world, repeats: int) -> dict:
    """The 2-rank ring's own loop on one connection and on one per direction (each in the
    order the ring uses there), and gloo's all_reduce, interleaved; plus a check of each."""
    one, two = Peers(), duplex(Peers())  # duplex: collective, both ranks get here
    x = torch.randn(DUPLEX_BYTES // 4, generator=torch.Generator().manual_seed(world.rank))
    ref = x.clone()
    dist.all_reduce(ref)
    runs = {"one connection": (one, "lookahead"), "two connections": (two, "receive-first")}
    ok = {}
    for label, (peers, how) in runs.items():
        y = x.clone()
        planned_ring_all_reduce_(peers, make_plan(y, 2, world.rank), "sum", how)
        ok[label] = torch.allclose(y, ref, rtol=1e-5, atol=1e-5)
    z = torch.zeros(DUPLEX_BYTES // 4)  # zeros stay zeros: every timed call does equal work
    plan = make_plan(z, 2, world.rank)
    calls = {label: (lambda p=peers, h=how: planned_ring_all_reduce_(p, plan, "sum", h))
             for label, (peers, how) in runs.items()}
    times = interleaved({**calls, "gloo": lambda: dist.all_reduce(z)}, repeats, 3, dist.barrier)
    return {"ok": ok, "two": two.back is not None,
            "ratio": {label: compare(times[label], times["gloo"]) for label in runs}}


def part5(repeats: int = 40) -> None:
    print(f"\nPart 5: two ranks, one connection or two ({DUPLEX_BYTES >> 20} MiB, {repeats} "
          f"calls each, interleaved with gloo)")
    r = mdp.spawn(connections, 2, (repeats,), timeout=180, backend="gloo")[0]
    if not r["two"]:
        print("  (MICRODDP_DUPLEX=0: the second row also runs on one connection)")
    for label, (ratio, (lo, hi)) in r["ratio"].items():
        print(f"  {label:<16} {ratio:.2f}x gloo's time (90% interval {lo:.2f}-{hi:.2f})  "
              f"matches torch: {'yes' if r['ok'][label] else 'NO'}")
    print("  with 2 ranks both neighbours are one rank, and gloo gives a pair of ranks one socket;")
    print("  a send written while the other side's bytes arrive holds that socket's lock, so the")
    print("  two directions take turns. A second connection lets them overlap.")


def main() -> None:
    part1()
    part2()
    part3()
    part4()
    part5()


if __name__ == "__main__":
    main()
