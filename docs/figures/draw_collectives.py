"""Figures drawn by make.py from microddp's own code and runs, for chapters 3, 4 and 9.

- collectives (chapter 3): what every one of 4 ranks holds before and after each collective,
  from a real run: 4 ranks call microddp.comms on tensors whose every element says whose it
  is (rank r's element i is 10 r + i, drawn as A0..D3; a sum over the ranks as Σi);
- ring (chapter 4): the ring all-reduce on 4 ranks step by step, from the algorithm: which
  chunk each rank sends at every step of the reduce-scatter and the all-gather, and whose
  contributions each chunk holds after it;
- zero-bytes (chapter 9): the model state per rank of each ZeRO stage, from microddp.predict.
"""

from __future__ import annotations

from pathlib import Path

P = 4
NAMES = "ABCD"
SUM = 10 * sum(range(P))  # the sum over ranks of element 0; element i adds P * i


def _collectives_rank(world) -> dict:
    """On each rank: (before, after) of every collective, as lists of element values."""
    import torch

    import microddp as mdp

    r, out = world.rank, {}
    mine = torch.tensor([10.0 * r + i for i in range(P)])

    x = mine.clone()
    mdp.comms.broadcast(x, 0)
    out["broadcast (src 0)"] = (mine.tolist(), x.tolist())
    x = mine.clone()
    mdp.comms.all_reduce(x, "sum")
    out["all_reduce (sum)"] = (mine.tolist(), x.tolist())
    x = mine.clone()
    mdp.comms.reduce(x, 0, "sum")
    out["reduce (sum, dst 0)"] = (mine.tolist(), x.tolist() if r == 0 else [])
    y = torch.zeros(1)
    mdp.comms.reduce_scatter(y, list(mine.clone().chunk(P)), "sum")
    out["reduce_scatter (sum)"] = (mine.tolist(), y.tolist())
    one = mine[:1].clone()
    parts = [torch.zeros(1) for _ in range(P)]
    mdp.comms.all_gather(parts, one)
    out["all_gather"] = (one.tolist(), torch.cat(parts).tolist())
    parts = [torch.zeros(1) for _ in range(P)] if r == 0 else None
    mdp.comms.gather(one.clone(), parts, 0)
    out["gather (dst 0)"] = (one.tolist(), torch.cat(parts).tolist() if r == 0 else [])
    y = torch.zeros(1)
    mdp.comms.scatter(y, list(mine.clone().chunk(P)) if r == 0 else None, 0)
    out["scatter (src 0)"] = (mine.tolist() if r == 0 else [], y.tolist())
    return out


def _label(v: float) -> tuple[str, int | None]:
    """'B2' and its owner rank for one rank's element, 'Σ2' and None for a sum over ranks."""
    v = int(round(v))
    if v >= SUM:
        return f"Σ{(v - SUM) // P}", None
    return f"{NAMES[v // 10]}{v % 10}", v // 10


def draw_collectives(target: Path, save) -> str:
    """Before/after grids of seven collectives, from a 4-rank run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import microddp as mdp

    results = mdp.spawn(_collectives_rank, P, timeout=120)
    names = list(results[0])
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:purple"]
    fig, axes = plt.subplots(len(names), 2, figsize=(7.5, 1.25 * len(names) + 0.4))
    for row, name in enumerate(names):
        for col, when in enumerate(("before", "after")):
            ax = axes[row][col]
            for rank in range(P):
                values = results[rank][name][col]
                ax.text(-0.6, rank, f"rank {rank}", ha="right", va="center", fontsize=7)
                for i, v in enumerate(values):
                    text, owner = _label(v)
                    face = "0.55" if owner is None else colors[owner]
                    ax.add_patch(matplotlib.patches.Rectangle((i - 0.45, rank - 0.4), 0.9, 0.8,
                                                              color=face))
                    ax.text(i, rank, text, ha="center", va="center", fontsize=7,
                            color="white")
            ax.set(xlim=(-2.2, P - 0.4), ylim=(P - 0.4, -0.6))
            ax.axis("off")
            ax.set_title(f"{name}: {when}" if col == 0 else "after", fontsize=8, loc="left")
    fig.text(0.01, 0.005, "rank r's element i is drawn r-letter + i (A0 = rank 0's first); "
             "Σi = the sum over all ranks of element i; an empty row holds nothing defined",
             fontsize=7)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    save(fig, target)
    return ("python docs/figures/make.py collectives (4 ranks running microddp.comms, "
            "every element labelled by its owner)")


def ring_states(p: int = P) -> list[tuple[str, list[list[frozenset[int]]], list[tuple]]]:
    """The ring all-reduce as data: after each step, whose contributions every rank's every
    chunk holds, and the (sender, chunk) pairs of that step. Reduce-scatter step s: rank r
    sends chunk (r - 1 - s) % p to rank r + 1, which adds it to its own, so that rank r ends
    with the whole sum of chunk r (chapter 4's convention); all-gather step s: rank r sends
    the finished chunk (r - s) % p, which the next rank copies."""
    held = [[frozenset({r}) for _ in range(p)] for r in range(p)]
    states = [("start: every rank holds its own tensor, cut in p chunks",
               [list(row) for row in held], [])]
    for s in range(p - 1):
        sends = [(r, (r - 1 - s) % p) for r in range(p)]
        incoming = {(r + 1) % p: held[r][c] for r, c in sends}
        for r, c in sends:
            dst = (r + 1) % p
            held[dst][c] = held[dst][c] | incoming[dst]
        states.append((f"reduce-scatter step {s + 1}", [list(row) for row in held], sends))
    for s in range(p - 1):
        sends = [(r, (r - s) % p) for r in range(p)]
        incoming = {(r + 1) % p: held[r][c] for r, c in sends}
        for r, c in sends:
            held[(r + 1) % p][c] = incoming[(r + 1) % p]
        states.append((f"all-gather step {s + 1}", [list(row) for row in held], sends))
        if s == 0:  # before the first copy: rank r held the whole of chunk r, and only that
            assert all(states[p - 1][1][r][r] == frozenset(range(p)) for r in range(p))
    assert all(chunk == frozenset(range(p)) for row in held for chunk in row)
    return states


def draw_ring(target: Path, save) -> str:
    """The ring's 2 (p - 1) steps on 4 ranks: chunks, sends, and how full each chunk is."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    states = ring_states()
    cmap = plt.get_cmap("Blues")
    fig, axes = plt.subplots(1, len(states), figsize=(13, 3.3), sharey=True)
    for ax, (title, held, sends) in zip(axes, states, strict=True):
        sending = dict(sends)
        for r in range(P):
            for c in range(P):
                n = len(held[r][c])
                ax.add_patch(matplotlib.patches.Rectangle(
                    (c - 0.45, r - 0.4), 0.9, 0.8, color=cmap(0.25 + 0.75 * n / P),
                    ec="tab:red" if sending.get(r) == c else "white", lw=2))
                ax.text(c, r, "".join(NAMES[i] for i in sorted(held[r][c])), ha="center",
                        va="center", fontsize=6, color="white" if n > 2 else "black")
        ax.set(xlim=(-0.6, P - 0.4), ylim=(P - 0.5, -0.5))
        ax.set_xticks(range(P), [f"c{c}" for c in range(P)], fontsize=6)
        ax.set_yticks(range(P), [f"rank {r}" for r in range(P)], fontsize=7)
        ax.tick_params(length=0)
        for side in ax.spines.values():
            side.set_visible(False)
        ax.set_title(title.replace(": ", ":\n").replace(" step", "\nstep"), fontsize=7)
    fig.suptitle("ring all-reduce on 4 ranks: letters = whose data a chunk holds; red edge = "
                 "the chunk that rank sent to the next rank in that step", fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    save(fig, target)
    return "python docs/figures/make.py ring (the ring's chunks and sends, p = 4)"


def draw_zero_bytes(target: Path, save) -> str:
    """Chapter 9: bytes of model state per rank, per ZeRO stage, from microddp.predict's
    memory model (the ZeRO paper's Figure 1: 7.5B parameters, 64 ranks, mixed-precision Adam)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from microddp.predict.memory import STAGES, per_rank

    params, world = 7.5e9, 64
    parts = (("params", "parameters (fp16: 2 B)", "tab:blue"),
             ("grads", "gradients (fp16: 2 B)", "tab:orange"),
             ("optimizer_state", "optimizer: fp32 copy + 2 moments (12 B)", "tab:green"))
    fig, ax = plt.subplots(figsize=(7.5, 3.4))
    names = list(STAGES.values())
    bottoms = [0.0] * len(names)
    for key, label, color in parts:
        values = [per_rank(params, world, stage)[key] / 1e9 for stage in STAGES]
        ax.bar(names, values, bottom=bottoms, color=color, label=label)
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    for i, total in enumerate(bottoms):
        ax.text(i, total + 1.5, f"{total:.1f} GB", ha="center", fontsize=8)
    ax.set(ylabel="GB of model state per rank",
           title=f"{params / 1e9:g}B parameters on {world} ranks: what each ZeRO stage shards")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save(fig, target)
    return ("python docs/figures/make.py zero-bytes (microddp.predict.memory.per_rank, "
            "7.5B parameters, 64 ranks)")
