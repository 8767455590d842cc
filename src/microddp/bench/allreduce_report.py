"""How `microddp bench allreduce` shows its results: the fitted model in words, one table row
per size and contender (median and mean time, the model's prediction of the mean, the ratio
of medians to gloo with its interval), the JSON records and the plot."""

from __future__ import annotations

from .. import outputs
from ..collectives.cost import CostModel
from ..collectives.ring import ring_segments
from ..timing import compare, median, trimmed_mean

CONTROL = "gloo-2"  # the A/A contender: gloo's all_reduce again
# ring+check is not modelled: the model does not count the agreement round in front of it.
MODELLED = {"ring": "ring_all_reduce", "tree": "tree_all_reduce", "naive": "naive_all_reduce"}


def human(nbytes: float) -> str:
    """A byte count as people read it (`4 MiB`, `512 KiB`, `12 B`)."""
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:g} {unit}"
    return f"{nbytes:g} B"


def describe(model: CostModel) -> str:
    """The fitted parameters, as a person reads them: latency in us, rates in GB/s (beta and
    gamma are seconds per byte, so a rate is 1/beta or 1/gamma, labelled so)."""
    def per_byte(seconds: float) -> str:  # a fit on bad data can give a slope <= 0
        return f"{1 / seconds / 1e9:.2f} GB/s" if seconds > 0 else f"{seconds:.3g} s/byte"

    def link(alpha: float, beta: float) -> str:
        return f"alpha {alpha * 1e6:.1f} us/message, 1/beta {per_byte(beta)} per link"

    rate = per_byte(model.gamma)
    if model.small is None:
        return f"fitted: {link(model.alpha, model.beta)}, 1/gamma {rate} reduction"
    up_to, a, b = model.small
    return (f"fitted: messages up to {human(int(up_to))}: {link(a, b)}\n"
            f"        larger messages: {link(model.alpha, model.beta)}\n"
            f"        1/gamma {rate} reduction")


def table(rows: list[dict], algos: list[str], model: CostModel, p: int,
          duplex: bool = False) -> dict:
    """The printed table and the JSON records; `duplex`: whether the 2-rank ring ran with a
    connection per direction (it changes how many messages the model counts)."""
    lines = [f"{'size':>9}  {'algorithm':<10} {'median':>11} {'mean':>11} {'predicted':>11} "
             f"{'model err':>9} {'x gloo time':>11}  {'90% interval':>12}"]
    records = []
    for row in rows:
        n, times = row["bytes"], row["times"]
        gloo, gloo_mean = median(times["gloo"]), trimmed_mean(times["gloo"])
        lines.append(f"{human(n):>9}  {'gloo':<10} {gloo * 1e3:>9.3f}ms {gloo_mean * 1e3:>9.3f}ms "
                     f"{'':>11} {'':>9} {1.0:>11.2f}")
        rec = {"bytes": n, "gloo_s": gloo, "gloo_mean_s": gloo_mean, "repeats": len(times["gloo"])}
        if CONTROL in times:
            aa, (lo, hi) = compare(times[CONTROL], times["gloo"])
            lines.append(f"{'':>9}  {CONTROL:<10} {median(times[CONTROL]) * 1e3:>9.3f}ms "
                         f"{trimmed_mean(times[CONTROL]) * 1e3:>9.3f}ms {'':>11} {'':>9} "
                         f"{aa:>11.2f}  {lo:>7.2f}-{hi:.2f}")
            rec.update({"control_vs_gloo": aa, "control_vs_gloo_interval": [lo, hi]})
        for a in algos:
            got, mean = median(times[a]), trimmed_mean(times[a])
            ratio, (lo, hi) = compare(times[a], times["gloo"])
            rec.update({f"{a}_s": got, f"{a}_mean_s": mean, f"{a}_vs_gloo": ratio,
                        f"{a}_vs_gloo_interval": [lo, hi]})
            modelled = f"{'':>11} {'':>9}"
            if a in MODELLED:
                # The ring pipelines large chunks: model the messages it really sends.
                opts = {"segments": ring_segments(n, p, duplex=duplex)} if a == "ring" else {}
                pred = model.predict(MODELLED[a], n, p, **opts)  # a mean time: judged on one
                rec[f"{a}_predicted_s"] = pred
                modelled = f"{pred * 1e3:>9.3f}ms {(pred - mean) / mean:>+9.0%}"
            lines.append(f"{'':>9}  {a:<10} {got * 1e3:>9.3f}ms {mean * 1e3:>9.3f}ms {modelled} "
                         f"{ratio:>11.2f}  {lo:>7.2f}-{hi:.2f}")
        if "bound_s" in row:
            # The memory bound: the shm row's distance to what this host's memory allows.
            bound = row["bound_s"]
            rec.update({"bound_s": bound, "shm_vs_bound": median(times["shm"]) / bound})
            lines.append(f"{'':>9}  {'bound':<10} {bound * 1e3:>9.3f}ms {'':>11} {'':>11} "
                         f"{'':>9} {bound / gloo:>11.2f}  shm / bound "
                         f"{rec['shm_vs_bound']:.2f}")
        if "ring+check" in algos and "ring" in algos:
            # What the default check costs: the checked call against the same ring unchecked,
            # timed in the same rounds.
            ratio, (lo, hi) = compare(times["ring+check"], times["ring"])
            rec.update({"check_vs_ring": ratio, "check_vs_ring_interval": [lo, hi]})
            lines.append(f"{'':>9}  {'check cost':<10} {'ring+check / ring (both timed above)':>45} "
                         f"{ratio:>11.2f}  {lo:>7.2f}-{hi:.2f}")
        if "shm-nocheck" in times and "shm" in algos:
            # The same for the default call: shm against shm without its check, same rounds.
            ratio, (lo, hi) = compare(times["shm"], times["shm-nocheck"])
            rec.update({"shm_check_vs_unchecked": ratio,
                        "shm_check_vs_unchecked_interval": [lo, hi]})
            lines.append(f"{'':>9}  {'shm check':<10} "
                         f"{'shm / shm without its check (same rounds)':>45} "
                         f"{ratio:>11.2f}  {lo:>7.2f}-{hi:.2f}")
        records.append(rec)
    return {"lines": lines, "records": records}


def plot(records: list[dict], algos: list[str], p: int, path: str) -> None:
    """Draw each algorithm's mean time per call, measured and as modelled, beside gloo's over
    the message sizes (log-log), into the PNG at `path`."""
    import matplotlib  # noqa: PLC0415 (only the benchmark needs it)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    sizes = [r["bytes"] for r in records]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    # Means, the model's own measure (the table gives medians too).
    ax.plot(sizes, [r["gloo_mean_s"] * 1e3 for r in records], "k-o", label="gloo all_reduce")
    for a, color in zip(algos, ("tab:blue", "tab:purple", "tab:orange", "tab:green", "tab:red"),
                        strict=False):
        ax.plot(sizes, [r[f"{a}_mean_s"] * 1e3 for r in records], "-o", color=color,
                label=f"{a} (measured)")
        if a in MODELLED:
            ax.plot(sizes, [r[f"{a}_predicted_s"] * 1e3 for r in records], "--", color=color,
                    alpha=0.6, label=f"{a} (model)")
    ax.set(xscale="log", yscale="log", xlabel="tensor size (bytes)",
           ylabel="mean time per call (ms, a tenth trimmed at each end)",
           title=f"all-reduce on {p} ranks: microddp's vs gloo")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with outputs.atomic(path) as tmp:  # a reader never sees half a PNG
        fig.savefig(tmp, dpi=120)
    plt.close(fig)
