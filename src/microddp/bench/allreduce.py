"""All-reduce algorithms from send/recv (ring, tree, naive) against gloo's own all_reduce.

Times every algorithm and gloo interleaved in one run and, in the same loop, this host's ring
step (latency and bandwidth) and add (reduction speed) at each size's chunk; fits the
alpha-beta-gamma cost model to those, then prints, per size: the median and mean time, the
model's prediction of the mean, and the ratio of medians to gloo (below 1 = faster than gloo).
The algorithms run with check=False, like gloo, which does not compare shapes across ranks;
the row "ring+check" is the default call (check=True), and "check cost" its ratio of medians
to the unchecked ring timed in the same rounds: what the metadata check adds (the model does
not count it). With shm, "shm check" is the same for the default call: microddp.comms.all_reduce
against itself with its check switched off, in the same rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from .. import comms, flags, outputs
from ..collectives import naive_all_reduce, ring_all_reduce, route, tree_all_reduce
from ..collectives.cost import CostModel, fit_line, fit_lines
from ..collectives.ring import (
    planned_ring_all_reduce_,
    posting,
    preposted_ring_all_reduce_,
)
from ..collectives.ring.plan import RingPlan
from ..errors import MicroDDPError
from ..launch.spawn import spawn
from ..shm import checked as shm_checked
from ..shm.group import sizes as shm_sizes
from ..timing import interleaved, median, trimmed_mean
from ..transport.duplex import duplex
from ..transport.peers import Peers
from . import mpi
from .allreduce_report import CONTROL, describe, plot, table

EPILOG = """\
examples:
  microddp bench allreduce                      # 2 ranks, 1 KiB .. 64 MiB
  microddp bench allreduce -n 4 --repeats 100 --min-repeats 40   # 4 ranks, tighter medians
  microddp bench allreduce --sizes 1M,8M,32M --algorithms ring --out runs/ring
  microddp bench allreduce --sizes 2M --algorithms ring --control   # is a 5% gap real here?
  microddp bench allreduce --sizes 4K,64K,4M,16M --algorithms shm --repeats 100   # vs memory
  microddp bench allreduce --sizes 4K,64K --algorithms shm --back-to-back 20   # per call, in a row
  microddp bench allreduce --sizes 4K,64K,1M,4M --algorithms shm --mpi --control   # vs MPICH
writes allreduce_<N>ranks.png and .json into a new runs/bench-allreduce-DATE-TIME (or --out).
"""

DEFAULT_SIZES = "1K,4K,16K,64K,256K,1M,4M,16M,64M"
ALGOS = {"ring": ring_all_reduce, "tree": tree_all_reduce, "naive": naive_all_reduce}
CHOICES = (*ALGOS, "shm")  # shm: microddp.comms.all_reduce, through shared memory
CALIBRATION_SIZES = [1 << 10, 16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `microddp bench allreduce`: ranks, sizes, algorithms, repetitions."""
    p.add_argument("-n", "--world-size", type=int, default=2, help="ranks to start (default 2)")
    p.add_argument("--sizes", default=DEFAULT_SIZES,
                   help=f"tensor sizes in bytes, K/M suffixes allowed (default {DEFAULT_SIZES})")
    p.add_argument("--algorithms", default="ring,tree,naive,shm",
                   help="comma-separated subset of ring,tree,naive,shm (shm: microddp.comms."
                        "all_reduce, which takes shared memory on one host; gloo is always "
                        "timed; default ring,tree,naive,shm)")
    p.add_argument("--repeats", type=int, default=30,
                   help="timed calls per contender at <= 1 MiB; fewer for larger sizes "
                        "(never below --min-repeats) (default 30)")
    p.add_argument("--min-repeats", type=int, default=9,
                   help="timed calls per contender at any size, at least (default 9)")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed rounds of every contender before timing (default 2)")
    p.add_argument("--out", default=None, help="folder for the PNG plot and JSON "
                   "(default: a new runs/bench-allreduce-DATE-TIME)")
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="deadline for the whole run, s (default 1800)")
    p.add_argument("--back-to-back", type=int, default=1, metavar="K",
                   help="time K calls in a row after each barrier and report the time per call "
                        "(default 1: one call per barrier). A barrier releases the ranks tens "
                        "of microseconds apart, which a single small call pays in full; DDP "
                        "all-reduces its buckets back to back, without one")
    p.add_argument("--control", action="store_true",
                   help="also time gloo's all_reduce a second time (gloo-2) and print its ratio "
                        "to the first (A/A): how far apart this run puts two equal contenders")
    p.add_argument("--mpi", action="store_true",
                   help="start the ranks under mpiexec and time MPI's Allreduce, "
                        "Reduce_scatter_block and Allgather (mpi4py) beside shared memory's "
                        "all_reduce, reduce_scatter and all_gather; needs "
                        "pip install 'microddp[mpi]' and --algorithms with shm")


def parse_size(text: str) -> int:
    """'64K' -> 65536, '1M' -> 1048576, '4096' -> 4096."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    digits = t[:-1] if mult > 1 else t
    if not digits.isdigit() or int(digits) <= 0:
        raise MicroDDPError(f"size {text!r} is not a positive number of bytes like 4096, 64K, 1M")
    return int(digits) * mult


def check_sizes(sizes: list[int]) -> list[int]:
    """The sizes to time: float32 tensors, so whole multiples of 4 bytes, each given once."""
    if not sizes:
        raise MicroDDPError("--sizes is empty: give one or more sizes like 4K,1M,64M")
    for n in sizes:
        if n % 4:
            raise MicroDDPError(f"size {n} bytes is not a whole number of float32 elements: "
                                f"give a multiple of 4 bytes, e.g. {n // 4 * 4 or 4}")
    twice = sorted({n for n in sizes if sizes.count(n) > 1})
    if twice:
        raise MicroDDPError(f"--sizes gives {', '.join(map(str, twice))} bytes more than once")
    return sizes


def repeats_for(nbytes: int, repeats: int, min_repeats: int) -> int:
    """Full repeats up to 1 MiB, then fewer in proportion, so every size costs about the same."""
    return max(min_repeats, min(repeats, repeats * (1 << 20) // max(nbytes, 1)))


def _calibrate(world, reps: int) -> dict:
    """Time of one ring step and of one add (`calibration_point`), per size n (used when only
    one size is benchmarked, so the interleaved calibration has too few points to fit a line).

    A step is every rank sending n bytes to the next and receiving n from the previous, all
    at once (the ring's own contention), timed as the ring takes them: a chain of 2(p-1)
    steps, each waiting for the one before, posted in the ring's order (`ring_rhythm`).
    """
    peers = duplex(Peers())  # the ring's own connections (collective: every rank is here)
    chain = 2 * (peers.size - 1)
    points = []
    for n in CALIBRATION_SIZES:
        t = interleaved(_calibration_contenders(peers, n // 4), reps, 2, dist.barrier)
        points.append(calibration_point(t["step"], t["add"], chain))
    return _fit(CALIBRATION_SIZES, points)


def calibration_point(chain_times: list[float], add_times: list[float],
                      chain: int) -> tuple[float, float]:
    """(seconds per ring step, seconds per add) from timed chains of `chain` steps and timed
    adds: trimmed means, as the model predicts mean times (chapter 4 says why not medians)."""
    return trimmed_mean(chain_times) / chain, trimmed_mean(add_times)


def _fit(sizes: list[int], points: list[tuple[float, float]]) -> dict:
    """The model's parameters from a `calibration_point` per size: a line (or two, when this
    host's link is faster per byte below some size) for the step, a slope for the add; with
    the sizes and times they were fitted to."""
    step, add = [s for s, _ in points], [a for _, a in points]
    (alpha, beta), small = fit_lines(sizes, step)
    _, gamma = fit_line(sizes, add, nonnegative=True)
    return {"alpha": alpha, "beta": beta, "gamma": gamma, "small": small and list(small),
            "sizes": sizes, "step_s": step, "add_s": add}


def _calibration_contenders(peers: Peers, width: int) -> dict:
    """A chain of ring steps ("step") and one add ("add") on chunks of `width` float32
    elements, ready to time: buffers and steps are made here, once, so that a timed call does
    only the work, as the ring does with its kept plan."""
    chain = 2 * (peers.size - 1)
    a, inbox = torch.zeros(width), torch.zeros(chain, width)
    how = posting(width * 4, peers.size, duplex=peers.back is not None)
    plan = rhythm_plan(peers.size, a, inbox, how)
    return {"step": lambda: ring_rhythm(peers, plan, how),
            "add": lambda b=inbox[0]: a.add_(b)}


def rhythm_plan(p: int, a: torch.Tensor, inbox: torch.Tensor, how: str) -> RingPlan:
    """The steps `ring_rhythm` runs: 2(p-1) of `a`'s bytes, each received into its own row of
    `inbox`, nothing added."""
    chain = 2 * (p - 1)
    if how == "prepost":
        # The gather steps copy what they receive (into row 0, whose message is in by then),
        # as the preposted ring copies into its chunks.
        return RingPlan(a, tuple((a, inbox[i], inbox[0] if i >= p - 1 else None, 1 + i)
                                 for i in range(chain)))
    return RingPlan(a, tuple((a, inbox[i], None, 1 + i) for i in range(chain)))


def ring_rhythm(peers: Peers, plan: RingPlan, how: str) -> None:
    """2(p-1) ring steps (a `rhythm_plan`), each waiting for the one before, with the messages
    posted in the order the ring posts them for chunks of this size (`ring.posting`), by the
    ring's own loop: the ring's rhythm, without its adds."""
    if how == "prepost":
        preposted_ring_all_reduce_(peers, plan, "sum")
        return
    # Whole steps; on 3+ ranks the pipeline posts its receives ahead, like lookahead, and the
    # pair loop (2 ranks, one connection) posts each receive beside its send, like plain.
    order = {"pipeline": "lookahead", "pair": "plain"}.get(how, how)
    planned_ring_all_reduce_(peers, plan, "sum", order)


def back_to_back(contenders: dict, k: int) -> dict:
    """Each contender called `k` times in a row (one timed sample); divide its times by k."""
    if k == 1:
        return contenders
    return {name: (lambda fn=fn: [fn() for _ in range(k)]) for name, fn in contenders.items()}


def per_call_times(contenders: dict, repeats: int, warmup: int, sync, k: int) -> dict:
    """`interleaved` with each timed sample `k` calls in a row: seconds per call."""
    times = interleaved(back_to_back(contenders, k), repeats, warmup, sync=sync)
    return {name: [x / k for x in xs] for name, xs in times.items()}


def _rank(world, sizes: list[int], algos: list[str], repeats: int, min_repeats: int,
          warmup: int, control: bool = False, k: int = 1, with_mpi: bool = False):
    peers = duplex(Peers())  # as the ring's first call would (collective: every rank is here)
    p = peers.size
    chain = 2 * (p - 1)

    # The cost model is calibrated inside the same interleaved loop as the algorithms, at each
    # size's own chunk (n/p bytes), so a change in the machine's load moves the calibration and
    # the measurement together instead of turning into model error.
    interleave_cal = len(sizes) >= 2
    cal = None if interleave_cal else _calibrate(world, max(min_repeats, repeats // 2))
    rows, points = [], []
    for nbytes in sizes:
        t = torch.zeros(nbytes // 4)  # zeros stay zeros under sum: every call does equal work
        contenders = {name: (lambda f=ALGOS[name], t=t: f(t, check=False)) for name in algos
                      if name in ALGOS}
        if "shm" in algos:
            contenders["shm"] = shm_contender(t)
            contenders["shm-nocheck"] = unchecked(contenders["shm"])
            contenders.update(memory_contenders(nbytes, p))
        if "ring" in algos:
            contenders["ring+check"] = lambda t=t: ring_all_reduce(t)
        contenders["gloo"] = lambda t=t: dist.all_reduce(t)
        if control:
            contenders[CONTROL] = lambda t=t: dist.all_reduce(t)
        if with_mpi:
            contenders.update(mpi.contenders(t, p, control))
        if interleave_cal:
            cal_parts = _calibration_contenders(peers, max(1, nbytes // 4 // p))
            contenders.update({f"cal-{k}": fn for k, fn in cal_parts.items()})
        times = per_call_times(contenders, repeats_for(nbytes, repeats, min_repeats), warmup,
                               dist.barrier, k)
        if interleave_cal:
            points.append(calibration_point(times.pop("cal-step"), times.pop("cal-add"), chain))
        row = {"bytes": nbytes, "times": times}
        if "shm" in algos:
            row["bound_s"] = memory_bound(nbytes, p, times.pop("mem-copy"),
                                          times.pop("mem-add"), times.pop("mem-add-slice"))
        rows.append(row)
    if interleave_cal:
        chunk = [max(4, n // 4 // p * 4) for n in sizes]
        cal = _fit(chunk, points)
    return ({"calibration": cal, "rows": rows, "duplex": peers.back is not None}
            if world.rank == 0 else None)


def shm_contender(t: torch.Tensor):
    """microddp.comms.all_reduce(t), having checked that it takes shared memory here (a
    collective step: every rank asks)."""
    if route.all_reduce_path(t, "sum", None) is None:
        raise MicroDDPError("--algorithms shm: microddp.comms.all_reduce does not take shared "
                            "memory here (MICRODDP_TRANSPORT=gloo, or no usable /dev/shm); "
                            "leave shm out")
    return lambda: comms.all_reduce(t)


def unchecked(call):
    """`call` (comms.all_reduce through shared memory) without the check every rank's call
    makes in its first synchronisation (shm/checked.py): what the check costs."""
    def run() -> None:
        shm_checked.CHECKING = False
        try:
            call()
        finally:
            shm_checked.CHECKING = True
    return run


def memory_contenders(nbytes: int, p: int) -> dict:
    """What bounds an all-reduce through memory on this host, timed beside it on every rank at
    once (the ranks share the memory bus), on one piece of the tensor as shared memory moves
    it (at most a slot: `bound_pieces`): a copy of the piece, an add of a piece into another,
    and the same of its p-th parts. The adds are in place (c += a), the cheapest way to add:
    an add into a third tensor also reads that tensor's old contents before writing them over
    (0.55 against 0.38 ms for 4 MiB here). A piece, not the whole tensor, because a piece's
    copy and add meet in the cache: timed whole, 16 MiB took longer than shared memory's four
    pieces of 4 MiB did, and a bound it can beat bounds nothing."""
    piece, _ = bound_pieces(nbytes, p)
    a, c = torch.zeros(piece // 4), torch.zeros(piece // 4)
    k = max(1, piece // 4 // p)
    a_k, c_k = a[:k], c[:k]
    return {"mem-copy": lambda: c.copy_(a),
            "mem-add": lambda: c.add_(a),
            "mem-add-slice": lambda: c_k.add_(a_k)}


def bound_pieces(nbytes: int, p: int) -> tuple[int, int]:
    """(bytes of a piece, pieces) in which shared memory moves `nbytes` on p ranks: a slot's
    worth at a time (shm/group.py)."""
    slot, _ = shm_sizes(p)
    piece = min(nbytes, slot // 4 * 4)
    return piece, -(-nbytes // piece)


def memory_bound(nbytes: int, p: int, copy: list[float], add: list[float],
                 add_slice: list[float]) -> float:
    """The least time an all-reduce through shared memory can take here, from medians of the
    `memory_contenders` (one piece each): per piece, every rank must copy its piece in and,
    through a shared slot, the result out (2 copies) and reduce its p-th of the p inputs
    (p-1 adds of a p-th); or, without the second copy, reduce all of them (p-1 adds of the
    piece). The cheaper of the two, times the pieces, is the bound."""
    t_copy, t_add, t_slice = median(copy), median(add), median(add_slice)
    _, pieces = bound_pieces(nbytes, p)
    return pieces * min(2 * t_copy + (p - 1) * t_slice, t_copy + (p - 1) * t_add)


def run(args: argparse.Namespace) -> int:
    """Check the flags, time every algorithm against gloo on spawned ranks, and write the
    report; the exit code."""
    sizes = check_sizes([parse_size(s) for s in args.sizes.split(",") if s.strip()])
    algos = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    bad = [a for a in algos if a not in CHOICES]
    if bad or not algos:
        raise MicroDDPError(f"unknown algorithm(s) {bad or algos}; choose from "
                            f"{','.join(CHOICES)}")
    if args.world_size < 2:
        raise MicroDDPError(f"need at least 2 ranks to compare all-reduces, got {args.world_size}")
    if args.repeats < 1 or args.min_repeats < 1:
        raise MicroDDPError("--repeats and --min-repeats must be at least 1")
    if args.warmup < 0:
        raise MicroDDPError(f"--warmup must be 0 or more, got {args.warmup}")
    if args.back_to_back < 1:
        raise MicroDDPError(f"--back-to-back must be at least 1, got {args.back_to_back}")
    flags.positive("timeout", args.timeout)
    if args.mpi:
        if "shm" not in algos:
            raise MicroDDPError("--mpi compares MPI with shared memory: add shm to --algorithms")
        why = mpi.available()
        if why is not None:
            raise MicroDDPError(f"--mpi: {why}")
    with outputs.run_folder(args.out, "bench-allreduce") as folder:
        return _run(args, sizes, algos, folder)


def _run(args: argparse.Namespace, sizes: list[int], algos: list[str], folder) -> int:
    p = args.world_size
    k = args.back_to_back
    each = ("call by call, each after a barrier" if k == 1 else
            f"{k} calls in a row after each barrier, time per call")
    print(f"all-reduce on {p} ranks (gloo, 127.0.0.1, {os.cpu_count()} CPUs), float32 sum; "
          f"contenders interleaved {each}")
    start = time.perf_counter()
    job = (sizes, algos, args.repeats, args.min_repeats, args.warmup, args.control, k,
           args.mpi)
    out = (mpi.run(_rank, p, job, args.timeout) if args.mpi else
           spawn(_rank, p, job, timeout=args.timeout, backend="gloo")[0])
    cal = out["calibration"]
    small = tuple(cal["small"]) if cal["small"] else None
    model = CostModel(cal["alpha"], cal["beta"], cal["gamma"], small)
    print(describe(model))
    shown = [a for a in ("ring", "ring+check", "tree", "naive", "shm")
             if a in out["rows"][0]["times"]]
    report = table(out["rows"], shown, model, p, out["duplex"])
    for line in report["lines"]:
        print(line)
    stem = os.path.join(folder, f"allreduce_{p}ranks")
    mpi_records = None
    if args.mpi:
        lines, mpi_records = mpi.table(out["rows"])
        print("\nagainst MPI (mpiexec, mpi4py), same rounds: microddp's shared memory / MPI")
        for line in lines:
            print(line)
    outputs.write_text(stem + ".json", json.dumps({
        "world_size": p, "back_to_back": k, "duplex": out["duplex"], "calibration": cal,
        "rows": report["records"], "mpi": mpi_records}, indent=1))
    plot(report["records"], shown, p, stem + ".png")
    print("mean = after dropping a tenth of the calls at each end; the model predicts it, since "
          "times add up\n  and medians do not (model err = predicted / mean - 1); x gloo time = "
          "ratio of medians")
    if "shm" in shown:
        print("shm = microddp.comms.all_reduce through shared memory; bound = the least time "
              "this host's memory allows it\n  (per slot-sized piece: 2 copies and (p-1) "
              "in-place adds of a p-th, or 1 copy and (p-1) in-place adds, timed beside it)")
    if args.control:
        print(f"{CONTROL} = gloo's all_reduce timed again: a gap between gloo and an algorithm "
              f"no larger than gloo-2's is within this run's noise")
    print("90% interval = where the ratio lands when this run's rounds are drawn again (a "
          "bootstrap);\n  load that lasted the whole run does not show in it: compare runs "
          "for that")
    print(outputs.wrote([f"{stem}.png", f"{stem}.json"])
          + f" in {time.perf_counter() - start:.0f} s")
    return 0
