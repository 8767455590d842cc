"""All-reduce algorithms from send/recv (ring, tree, naive) against gloo's own all_reduce.

Times every algorithm and gloo interleaved in one run and, in the same loop, this host's ring
step (latency and bandwidth) and add (reduction speed) at each size's chunk; fits the
alpha-beta-gamma cost model to those, then prints, per size: measured time, the model's
prediction, and the ratio to gloo (below 1 = faster than gloo).
The algorithms run with check=False, like gloo, which does not compare shapes across ranks;
the row "ring+check" shows what microddp's default metadata check adds.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from ..collectives import naive_all_reduce, ring_all_reduce, tree_all_reduce
from ..collectives._group import Peers
from ..collectives._plan import RingPlan
from ..collectives.cost import CostModel, fit_line, fit_lines
from ..collectives.ring import (
    planned_ring_all_reduce_,
    posting,
    preposted_ring_all_reduce_,
    ring_segments,
)
from ..errors import MicroDDPError
from ..spawn import spawn
from .timing import interleaved, median, ratio_of_medians

EPILOG = """\
examples:
  microddp bench allreduce                      # 2 ranks, 1 KiB .. 64 MiB
  microddp bench allreduce -n 4 --repeats 30    # 4 ranks, more repetitions
  microddp bench allreduce --sizes 1M,8M,32M --algorithms ring --out results/
  microddp bench allreduce --sizes 2M --algorithms ring --control   # is a 5% gap real here?
writes allreduce_<N>ranks.png and .json into --out.
"""

DEFAULT_SIZES = "1K,4K,16K,64K,256K,1M,4M,16M,64M"
ALGOS = {"ring": ring_all_reduce, "tree": tree_all_reduce, "naive": naive_all_reduce}
MODELLED = {"ring": "ring_all_reduce", "ring+check": "ring_all_reduce",
            "tree": "tree_all_reduce", "naive": "naive_all_reduce"}
CALIBRATION_SIZES = [1 << 10, 16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--world-size", type=int, default=2, help="ranks to start (default 2)")
    p.add_argument("--sizes", default=DEFAULT_SIZES,
                   help=f"tensor sizes in bytes, K/M suffixes allowed (default {DEFAULT_SIZES})")
    p.add_argument("--algorithms", default="ring,tree,naive",
                   help="comma-separated subset of ring,tree,naive (gloo is always timed)")
    p.add_argument("--repeats", type=int, default=30,
                   help="timed calls per contender at <= 1 MiB; fewer for larger sizes "
                        "(never below --min-repeats)")
    p.add_argument("--min-repeats", type=int, default=9)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default="bench-out", help="folder for the PNG plot and JSON")
    p.add_argument("--timeout", type=float, default=1800.0, help="deadline for the whole run, s")
    p.add_argument("--control", action="store_true",
                   help="also time gloo's all_reduce a second time (gloo-2) and print its ratio "
                        "to the first (A/A): how far apart this run puts two equal contenders")


def parse_size(text: str) -> int:
    """'64K' -> 65536, '1M' -> 1048576, '4096' -> 4096."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    digits = t[:-1] if mult > 1 else t
    if not digits.isdigit() or int(digits) <= 0:
        raise MicroDDPError(f"size {text!r} is not a positive number of bytes like 4096, 64K, 1M")
    return int(digits) * mult


def human(nbytes: float) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:g} {unit}"
    return f"{nbytes:g} B"


def repeats_for(nbytes: int, repeats: int, min_repeats: int) -> int:
    """Full repeats up to 1 MiB, then fewer in proportion, so every size costs about the same."""
    return max(min_repeats, min(repeats, repeats * (1 << 20) // max(nbytes, 1)))


def _calibrate(world, reps: int) -> dict:
    """Median time of one ring step and of one add, per size n (used when only one size is
    benchmarked, so the interleaved calibration has too few points to fit a line).

    A step is every rank sending n bytes to the next and receiving n from the previous, all
    at once (the ring's own contention), timed as the ring takes them: a chain of 2(p-1)
    steps, each waiting for the one before, posted in the ring's order (`ring_rhythm`).
    """
    peers = Peers()
    chain = 2 * (peers.size - 1)
    step, add = [], []
    for n in CALIBRATION_SIZES:
        t = interleaved(_calibration_contenders(peers, n // 4), reps, 2, dist.barrier)
        step.append(median(t["step"]) / chain)
        add.append(median(t["add"]))
    return {**_fit(CALIBRATION_SIZES, step, add), "sizes": CALIBRATION_SIZES,
            "step_s": step, "add_s": add}


def _fit(sizes: list[int], step: list[float], add: list[float]) -> dict:
    """The model's parameters from per-size step and add times: a line (or two, when this
    host's link is faster per byte below some size) for the step, a slope for the add."""
    (alpha, beta), small = fit_lines(sizes, step)
    _, gamma = fit_line(sizes, add, nonnegative=True)
    return {"alpha": alpha, "beta": beta, "gamma": gamma, "small": small and list(small)}


def _calibration_contenders(peers: Peers, width: int) -> dict:
    """A chain of ring steps ("step") and one add ("add") on chunks of `width` float32
    elements, ready to time: buffers and steps are made here, once, so that a timed call does
    only the work, as the ring does with its kept plan."""
    chain = 2 * (peers.size - 1)
    a, inbox = torch.zeros(width), torch.zeros(chain, width)
    how = posting(width * 4, peers.size)
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
    else:  # the pipelines' steps go whole
        planned_ring_all_reduce_(peers, plan, "sum", "lookahead" if how == "lookahead" else "plain")


CONTROL = "gloo-2"  # the A/A contender: gloo's all_reduce again


def _rank(world, sizes: list[int], algos: list[str], repeats: int, min_repeats: int,
          warmup: int, control: bool = False):
    peers = Peers()
    p = peers.size
    chain = 2 * (p - 1)

    # The cost model is calibrated inside the same interleaved loop as the algorithms, at each
    # size's own chunk (n/p bytes), so a change in the machine's load moves the calibration and
    # the measurement together instead of turning into model error.
    interleave_cal = len(sizes) >= 2
    cal = None if interleave_cal else _calibrate(world, max(min_repeats, repeats // 2))
    rows, step, add = [], [], []
    for nbytes in sizes:
        t = torch.zeros(nbytes // 4)  # zeros stay zeros under sum: every call does equal work
        contenders = {name: (lambda f=ALGOS[name], t=t: f(t, check=False)) for name in algos}
        if "ring" in algos:
            contenders["ring+check"] = lambda t=t: ring_all_reduce(t)
        contenders["gloo"] = lambda t=t: dist.all_reduce(t)
        if control:
            contenders[CONTROL] = lambda t=t: dist.all_reduce(t)
        if interleave_cal:
            cal_parts = _calibration_contenders(peers, max(1, nbytes // 4 // p))
            contenders.update({f"cal-{k}": fn for k, fn in cal_parts.items()})
        times = interleaved(contenders, repeats_for(nbytes, repeats, min_repeats), warmup,
                            sync=dist.barrier)
        if interleave_cal:
            step.append(median(times.pop("cal-step")) / chain)
            add.append(median(times.pop("cal-add")))
        rows.append({"bytes": nbytes, "times": times})
    if interleave_cal:
        chunk = [max(4, n // 4 // p * 4) for n in sizes]
        cal = {**_fit(chunk, step, add), "sizes": chunk, "step_s": step, "add_s": add}
    return {"calibration": cal, "rows": rows} if world.rank == 0 else None


def run(args: argparse.Namespace) -> int:
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    algos = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    bad = [a for a in algos if a not in ALGOS]
    if bad or not algos:
        raise MicroDDPError(f"unknown algorithm(s) {bad or algos}; choose from ring,tree,naive")
    if args.world_size < 2:
        raise MicroDDPError(f"need at least 2 ranks to compare all-reduces, got {args.world_size}")
    if args.repeats < 1 or args.min_repeats < 1:
        raise MicroDDPError("--repeats and --min-repeats must be at least 1")
    p = args.world_size
    print(f"all-reduce on {p} ranks (gloo, 127.0.0.1, {os.cpu_count()} CPUs), float32 sum; "
          "contenders interleaved, medians")
    start = time.perf_counter()
    out = spawn(_rank, p, (sizes, algos, args.repeats, args.min_repeats, args.warmup,
                           args.control), timeout=args.timeout, backend="gloo")[0]
    cal = out["calibration"]
    small = tuple(cal["small"]) if cal["small"] else None
    model = CostModel(cal["alpha"], cal["beta"], cal["gamma"], small)
    print(_describe(model))
    shown = [a for a in ("ring", "ring+check", "tree", "naive") if a in out["rows"][0]["times"]]
    table = _table(out["rows"], shown, model, p)
    for line in table["lines"]:
        print(line)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"allreduce_{p}ranks")
    with open(stem + ".json", "w") as f:
        json.dump({"world_size": p, "calibration": cal, "rows": table["records"]}, f, indent=1)
    _plot(table["records"], shown, p, stem + ".png")
    if args.control:
        print(f"{CONTROL} = gloo's all_reduce timed again: a gap between gloo and an algorithm "
              f"no larger than gloo-2's is within this run's noise")
    print(f"wrote {stem}.png and {stem}.json in {time.perf_counter() - start:.0f} s")
    return 0


def _describe(model: CostModel) -> str:
    """The fitted parameters, as a person reads them: latency in us, rates in GB/s."""
    def per_byte(seconds: float) -> str:  # a fit on bad data can give a slope <= 0
        return f"{1 / seconds / 1e9:.2f} GB/s" if seconds > 0 else f"{seconds:.3g} s/byte"

    def link(alpha: float, beta: float) -> str:
        return f"alpha {alpha * 1e6:.1f} us/message, beta {per_byte(beta)} per link"

    rate = per_byte(model.gamma)
    if model.small is None:
        return f"fitted: {link(model.alpha, model.beta)}, gamma {rate} reduction"
    up_to, a, b = model.small
    return (f"fitted: messages up to {human(int(up_to))}: {link(a, b)}\n"
            f"        larger messages: {link(model.alpha, model.beta)}\n"
            f"        gamma {rate} reduction")


def _table(rows: list[dict], algos: list[str], model: CostModel, p: int) -> dict:
    lines = [f"{'size':>9}  {'algorithm':<10} {'measured':>11} {'predicted':>11} "
             f"{'model err':>9} {'x gloo time':>11}"]
    records = []
    for row in rows:
        n, times = row["bytes"], row["times"]
        gloo = median(times["gloo"])
        lines.append(f"{human(n):>9}  {'gloo':<10} {gloo * 1e3:>9.3f}ms {'':>11} {'':>9} "
                     f"{1.0:>11.2f}")
        rec = {"bytes": n, "gloo_s": gloo, "repeats": len(times["gloo"])}
        if CONTROL in times:
            aa = ratio_of_medians(times[CONTROL], times["gloo"])
            lines.append(f"{'':>9}  {CONTROL:<10} {median(times[CONTROL]) * 1e3:>9.3f}ms "
                         f"{'':>11} {'':>9} {aa:>11.2f}")
            rec["control_vs_gloo"] = aa
        for a in algos:
            got = median(times[a])
            # The ring pipelines large chunks: model the messages it really sends.
            opts = {"segments": ring_segments(n, p)} if a.startswith("ring") else {}
            pred = model.predict(MODELLED[a], n, p, **opts)
            ratio = ratio_of_medians(times[a], times["gloo"])
            lines.append(f"{'':>9}  {a:<10} {got * 1e3:>9.3f}ms {pred * 1e3:>9.3f}ms "
                         f"{(pred - got) / got:>+9.0%} {ratio:>11.2f}")
            rec.update({f"{a}_s": got, f"{a}_predicted_s": pred, f"{a}_vs_gloo": ratio})
        records.append(rec)
    return {"lines": lines, "records": records}


def _plot(records: list[dict], algos: list[str], p: int, path: str) -> None:
    import matplotlib  # noqa: PLC0415 (only the benchmark needs it)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    sizes = [r["bytes"] for r in records]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(sizes, [r["gloo_s"] * 1e3 for r in records], "k-o", label="gloo all_reduce")
    for a, color in zip(algos, ("tab:blue", "tab:purple", "tab:orange", "tab:green"),
                        strict=False):
        ax.plot(sizes, [r[f"{a}_s"] * 1e3 for r in records], "-o", color=color,
                label=f"{a} (measured)")
        if a != "ring+check":  # same model line as the ring
            ax.plot(sizes, [r[f"{a}_predicted_s"] * 1e3 for r in records], "--", color=color,
                    alpha=0.6, label=f"{a} (model)")
    ax.set(xscale="log", yscale="log", xlabel="tensor size (bytes)", ylabel="time per call (ms)",
           title=f"all-reduce on {p} ranks: from send/recv vs gloo")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
