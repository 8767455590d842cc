"""Figures drawn by make.py for chapters 5 and 5b, from real traced runs on 2 ranks.

- ladder (chapter 5): one training step of each rung of the ladder (naive, hooks, buckets,
  overlap) on rank 0, compute above and communication below, on one time axis: where each
  stage's all-reduces run and how much of them the step waits for. The overlap stage records
  its own spans (ladder.py); the blocking stages' all-reduces are timed here, around the very
  call they make (`comms.all_reduce_mean`), and counted as waits, since the rank does nothing
  else meanwhile;
- ddp-buckets (chapter 5b): one backward of microddp.DistributedDataParallel, after its
  buckets were rebuilt: when each parameter's gradient hook fired (last layer first), which
  bucket it filled, and when each bucket's all-reduce started and ended while backward went on.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

LADDER = ("naive", "hooks", "buckets", "overlap")
# big enough that backward and the all-reduces both take milliseconds on loopback gloo,
# small enough for 2 ranks on a shared 2-core machine
LADDER_SIZE = {"dim": 512, "depth": 8, "batch": 128, "steps": 6, "bucket_cap_mb": 1.0}
DDP_SIZE = {"dim": 256, "depth": 8, "batch": 256, "steps": 4, "bucket_cap_mb": 0.25}


class _TimedComms:
    """microddp.comms as ladder.py sees it, with each blocking all-reduce recorded as a
    communication span and as a wait (the overlap stage's asynchronous ones pass through)."""

    def __init__(self, comms) -> None:
        self._comms = comms

    def __getattr__(self, name: str):
        return getattr(self._comms, name)

    def all_reduce_mean(self, t, *args, async_op: bool = False, **kw):
        from microddp import spans

        if async_op:
            return self._comms.all_reduce_mean(t, *args, async_op=True, **kw)
        t0 = time.perf_counter()
        out = self._comms.all_reduce_mean(t, *args, **kw)
        t1 = time.perf_counter()
        spans.add_span("allreduce", t0, t1, track="comm", bytes=t.numel() * t.element_size())
        spans.add_span("wait allreduce", t0, t1, track="comm_wait")
        return out


def _ladder_rank(world) -> dict:
    """Rank 0's spans of the median step (of the last three) of every stage, in ms from its start."""
    from microddp import spans
    from microddp.dp import ladder
    from microddp.trace import steps

    ladder.comms = _TimedComms(ladder.comms)
    out = {}
    for engine in LADDER:
        rec = spans.start()
        steps.run_steps(world, engine=engine, **LADDER_SIZE)
        spans.stop()
        by_step: dict[int, list] = {}
        for s in rec.spans:
            by_step.setdefault(s.step, []).append(s)
        last = sorted(by_step)[-3:]
        times = {k: spans.step_stats(by_step[k])["step_s"] for k in last}
        k = min(last, key=lambda k: abs(times[k] - statistics.median(times.values())))
        chosen = by_step[k]
        t0 = min(s.start for s in chosen)
        out[engine] = {"spans": [(s.name, s.track, (s.start - t0) * 1e3, (s.end - t0) * 1e3)
                                 for s in chosen],
                       "stats": {n: v * 1e3 for n, v in spans.step_stats(chosen).items()
                                 if n.endswith("_s")}}
    return out if world.rank == 0 else {}


def draw_ladder(target: Path, save) -> str:
    """The ladder's timelines side by side: one step of each stage on rank 0 of 2."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import microddp as mdp

    result = mdp.spawn(_ladder_rank, 2, timeout=600)[0]
    colors = {"forward": "tab:blue", "backward": "tab:orange", "optimizer": "tab:green",
              "data": "tab:gray", "comm": "tab:purple", "wait": "tab:red"}
    fig, axes = plt.subplots(len(LADDER), 1, figsize=(9.5, 1.25 * len(LADDER) + 1.0),
                             sharex=True)
    seen = set()
    for ax, engine in zip(axes, LADDER, strict=True):
        # longest first, so a wait inside backward is drawn over it
        for name, track, start, end in sorted(result[engine]["spans"],
                                              key=lambda s: s[2] - s[3]):
            if track == "comm":
                key, y = "comm", 1
            elif track == "comm_wait" or name.startswith("wait"):
                key, y = "wait", 0
            else:
                key, y = (name if name in colors else "data"), 0
            ax.broken_barh([(start, end - start)], (y - 0.35, 0.7), facecolors=colors[key],
                           edgecolor="black", linewidth=0.3,
                           label=None if key in seen else key)
            seen.add(key)
        st = result[engine]["stats"]
        ax.set_yticks([0, 1], ["compute", "comm"], fontsize=7)
        ax.set_ylim(1.6, -0.6)
        ax.set_title(f"{engine}: step {st['step_s']:.1f} ms, communication "
                     f"{st['comm_s']:.1f} ms, of it exposed {st['exposed_comm_s']:.1f} ms",
                     fontsize=8, loc="left")
    axes[-1].set_xlabel("time since the step began (ms), rank 0 of 2")
    fig.legend(loc="upper right", ncol=6, fontsize=7,
               title="wait = the rank waits for an all-reduce", title_fontsize=7)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    save(fig, target)
    size = LADDER_SIZE
    return (f"python docs/figures/make.py ladder (2 ranks, microddp.trace.steps.run_steps per "
            f"engine: FullMLP({size['dim']}, depth {size['depth']}), batch {size['batch']} per "
            f"rank, {size['bucket_cap_mb']:g} MiB buckets; the median of the last 3 of "
            f"{size['steps']} steps)")


def _ddp_rank(world) -> dict:
    """Rank 0's last backward under microddp's DDP: hook times, buckets, all-reduce spans."""
    import torch

    import microddp as mdp
    from microddp import spans
    from microddp.model import FullMLP

    size = DDP_SIZE
    torch.manual_seed(0)
    model = mdp.DistributedDataParallel(FullMLP(size["dim"], size["depth"]),
                                        bucket_cap_mb=size["bucket_cap_mb"])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    reducer = model.reducer
    fired: dict[int, float] = {}
    # registered after DDP's own hook on the same parameter, so it fires right after it
    for i, p in enumerate(reducer.params):
        p.register_post_accumulate_grad_hook(lambda _p, i=i: fired.__setitem__(i, time.perf_counter()))
    gen = torch.Generator().manual_seed(world.rank)
    x = torch.randn(size["batch"], size["dim"], generator=gen)
    y = torch.randint(0, 2, (size["batch"],), generator=gen)
    for _ in range(size["steps"]):  # the first iteration rebuilds the buckets in arrival order
        fired.clear()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        rec = spans.start()
        t0 = time.perf_counter()
        loss.backward()
        t1 = time.perf_counter()
        spans.stop()
        opt.step()
        opt.zero_grad(set_to_none=True)
    comm = [(s.args["bucket"], (s.start - t0) * 1e3, (s.end - t0) * 1e3)
            for s in rec.spans if s.track == "comm"]
    return {"names": list(reducer.names), "fired": {i: (t - t0) * 1e3 for i, t in fired.items()},
            "buckets": [list(b.indices) for b in reducer.buckets],
            "nbytes": [b.nbytes for b in reducer.buckets], "comm": comm,
            "backward_ms": (t1 - t0) * 1e3}


def draw_ddp_buckets(target: Path, save) -> str:
    """Chapter 5b: hook firing order, bucket fill and each bucket's all-reduce in one backward."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import microddp as mdp

    r = mdp.spawn(_ddp_rank, 2, timeout=300)[0]
    bucket_of = {i: k for k, idx in enumerate(r["buckets"]) for i in idx}
    assert sorted(bucket_of) == sorted(r["fired"]), "every parameter in one bucket, and fired"
    cmap = plt.get_cmap("tab10")
    n = len(r["names"])
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5.2), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 1.2]})
    order = sorted(r["fired"], key=r["fired"].get)
    for rank_in_order, i in enumerate(order):
        k = bucket_of[i]
        top.plot(r["fired"][i], i, "o", ms=5, color=cmap(k % 10))
        top.annotate(str(rank_in_order + 1), (r["fired"][i], i), fontsize=6,
                     xytext=(4, -2), textcoords="offset points")
    top.set_yticks(range(n), r["names"], fontsize=6)
    top.invert_yaxis()
    top.set_title("when each parameter's gradient hook fired (numbers: firing order), "
                  "coloured by the bucket it fills", fontsize=8, loc="left")
    top.grid(True, axis="x", alpha=0.3)
    for k, start, end in sorted(r["comm"]):
        bottom.broken_barh([(start, end - start)], (k - 0.35, 0.7), facecolors=cmap(k % 10),
                           edgecolor="black", linewidth=0.3)
        bottom.text(end, k, f" {r['nbytes'][k] / 1024:.0f} KiB", va="center", fontsize=6)
    bottom.axvline(r["backward_ms"], color="black", lw=0.8, ls="--")
    bottom.text(r["backward_ms"], -0.9, " backward returns", fontsize=6)
    bottom.set_yticks(range(len(r["buckets"])), [f"bucket {k}" for k in range(len(r["buckets"]))],
                      fontsize=6)
    bottom.set_ylim(len(r["buckets"]) - 0.4, -1.2)
    bottom.set_title("each bucket's all-reduce: launched when its last gradient arrived, "
                     "done when the bytes came back", fontsize=8, loc="left")
    bottom.set_xlabel("time since backward began (ms), rank 0 of 2")
    fig.tight_layout()
    save(fig, target)
    size = DDP_SIZE
    return (f"python docs/figures/make.py ddp-buckets (2 ranks, microddp.DistributedDataParallel"
            f"(FullMLP({size['dim']}, depth {size['depth']}), bucket_cap_mb="
            f"{size['bucket_cap_mb']:g}), batch {size['batch']} per rank, backward "
            f"{size['steps']} of {size['steps']})")
