"""Figures drawn by make.py for chapters 11 and 12, from real runs of microddp's own code.

- hierarchy (chapter 11): the two-level all-reduce on 4 ranks playing 2 hosts of 2, as the
  chapter's script runs it (reduce-scatter inside each host, all-reduce along each rail across
  the hosts, all-gather inside each host). Rank r's tensor holds 2 ** r in every element, so
  a sum says exactly whose contributions it holds (its bits); the result is checked against
  microddp.collectives.hierarchical_all_reduce, and the bytes that cross between the hosts
  are counted by transport.traffic for a flat ring and for the three steps;
- tp-split (chapter 12): a transformer's MLP block (Linear d -> 4d, GELU, Linear 4d -> d)
  split over 2 ranks by microddp.tp's ColumnParallelLinear and RowParallelLinear: each rank's
  weight shard as the layers hold it (its shape and which rows or columns of the whole weight
  it is, found by comparing), and the collectives the layers issued in one forward and
  backward (tp.comm.counting), with the output checked against the unsplit block.
"""

from __future__ import annotations

from pathlib import Path

HOSTS = ["host-a", "host-a", "host-b", "host-b"]  # rank r plays HOSTS[r], as in chapter 11
NAMES = "ABCD"
CROSS_BYTES = 4 << 20  # the tensor whose bytes between hosts are counted (chapter 11's)
D, T = 8, 4  # the MLP's width and the tokens of its input, small enough to draw every cell


def _hierarchy_rank(world) -> dict:
    """Every rank's two chunks after each step, as bitmasks of the ranks they hold, and the
    bytes this rank sent across hosts in a flat ring and in the three steps."""
    import torch
    import torch.distributed as dist

    from microddp import collectives as C

    hosts = {h: [r for r, x in enumerate(HOSTS) if x == h] for h in dict.fromkeys(HOSTS)}
    intra = [dist.new_group(ranks) for ranks in hosts.values()][world.rank // 2]
    rails = [dist.new_group([ranks[j] for ranks in hosts.values()]) for j in range(2)]
    rail = rails[world.rank % 2]

    def three_steps(x: torch.Tensor, states: list | None) -> tuple[torch.Tensor, int]:
        local = dist.get_rank(intra)
        chunks = list(x.chunk(2))
        mine = torch.empty_like(chunks[local])
        C.ring_reduce_scatter(mine, chunks, group=intra)
        if states is not None:
            states.append([int(mine[0]) if j == local else 0 for j in range(2)])
        with C.traffic() as sent:
            C.ring_all_reduce(mine, group=rail, check=False)
        if states is not None:
            states.append([int(mine[0]) if j == local else 0 for j in range(2)])
        gathered = [torch.empty_like(c) for c in chunks]
        C.ring_all_gather(gathered, mine, group=intra)
        if states is not None:
            states.append([int(g[0]) for g in gathered])
        return torch.cat(gathered), sent.bytes

    x = torch.full((2,), 2 ** world.rank, dtype=torch.int64)
    states = [[int(v) for v in x]]
    y, _ = three_steps(x, states)
    library = C.hierarchical_all_reduce(x.clone(), hierarchy=C.Hierarchy(HOSTS))
    big = torch.ones(CROSS_BYTES // 8, dtype=torch.int64)
    flat = big.clone()
    with C.traffic() as sent:
        C.ring_all_reduce(flat, check=False)
    crosses = HOSTS[world.rank] != HOSTS[(world.rank + 1) % len(HOSTS)]  # its next neighbour
    stepped, rail_bytes = three_steps(big.clone(), None)
    return {"states": states, "same": torch.equal(y, library) and torch.equal(flat, stepped),
            "flat": sent.bytes if crosses else 0, "hierarchical": rail_bytes}


def draw_hierarchy(target: Path, save) -> str:
    """Chapter 11: what every rank holds after each of the three steps, hosts boxed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import microddp as mdp

    ranks = mdp.spawn(_hierarchy_rank, len(HOSTS), timeout=300)
    assert all(r["same"] for r in ranks), "the three steps differ from the library's or the ring"
    full = (1 << len(HOSTS)) - 1
    assert all(chunk == full for r in ranks for chunk in r["states"][-1])
    titles = ["start: rank r holds its own tensor, in 2 chunks",
              "1. reduce-scatter inside each host", "2. all-reduce along each rail\n"
              "(crosses between the hosts)", "3. all-gather inside each host"]
    cmap = plt.get_cmap("Blues")
    fig, axes = plt.subplots(1, len(titles), figsize=(12, 3.6), sharey=True)
    for step, (ax, title) in enumerate(zip(axes, titles, strict=True)):
        for h, host in enumerate(dict.fromkeys(HOSTS)):
            rows = [r for r, x in enumerate(HOSTS) if x == host]
            ax.add_patch(matplotlib.patches.Rectangle(
                (-0.6, min(rows) - 0.5), 2.2, len(rows), color="0.92" if h % 2 else "0.85"))
            ax.text(-0.55, min(rows) - 0.38, host, fontsize=6, va="top")
        for r, rank in enumerate(ranks):
            for c, mask in enumerate(rank["states"][step]):
                owners = [NAMES[i] for i in range(len(HOSTS)) if mask >> i & 1]
                n = len(owners)
                ax.add_patch(matplotlib.patches.Rectangle(
                    (c - 0.4, r - 0.3), 0.8, 0.6,
                    color=cmap(0.2 + 0.8 * n / len(HOSTS)) if n else "white",
                    ec="0.6", lw=0.5))
                ax.text(c, r, "".join(owners) or "-", ha="center", va="center", fontsize=7,
                        color="white" if n > 2 else "black")
        if step == 2:  # the rails: local rank j of every host
            for r in range(len(HOSTS) // 2):
                ax.annotate("", xy=(1.75, r + 2), xytext=(1.75, r), arrowprops=dict(
                    arrowstyle="<->", color="tab:red", connectionstyle=f"arc3,rad={-0.4 - 0.2 * r}"))
        ax.set(xlim=(-0.7, 2.2), ylim=(len(HOSTS) - 0.4, -0.6))
        ax.set_xticks([0, 1], ["chunk 0", "chunk 1"], fontsize=7)
        ax.set_yticks(range(len(HOSTS)), [f"rank {r}" for r in range(len(HOSTS))], fontsize=7)
        ax.tick_params(length=0)
        for side in ax.spines.values():
            side.set_visible(False)
        ax.set_title(title, fontsize=8)
    flat = sum(r["flat"] for r in ranks) / (1 << 20)
    hier = sum(r["hierarchical"] for r in ranks) / (1 << 20)
    fig.suptitle(f"letters: whose contributions a chunk holds (A = rank 0's ...); '-': not "
                 f"held. Bytes between the hosts for a {CROSS_BYTES >> 20} MiB tensor, counted: "
                 f"flat ring {flat:.0f} MiB, hierarchical {hier:.0f} MiB", fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    save(fig, target)
    return ("python docs/figures/make.py hierarchy (4 ranks as 2 hosts of 2: the three steps "
            "with chapter 4's collectives, checked against hierarchical_all_reduce)")


def _tp_rank(world) -> dict:
    """This rank's shards of the MLP block, where they sit in the whole weights, and the
    collectives one forward and backward issued; the output checked against the whole block."""
    import torch
    from torch import nn

    from microddp.tp import comm
    from microddp.tp.layers import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(0)
    up, down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
    x = torch.randn(T, D, requires_grad=True)  # so backward reaches the column's entry
    whole = down(nn.functional.gelu(up(x)))
    col, row = ColumnParallelLinear(up), RowParallelLinear(down)
    with comm.counting() as calls:
        out = row(nn.functional.gelu(col(x)))
        out.sum().backward()

    def where(shard: torch.Tensor, full: torch.Tensor, dim: int) -> tuple[int, int]:
        n = shard.shape[dim]
        for start in range(0, full.shape[dim] - n + 1):
            if torch.equal(full.narrow(dim, start, n), shard):
                return start, start + n
        raise AssertionError("a shard that is no slice of the whole weight")

    return {"up": (tuple(col.weight.shape), where(col.weight.detach(), up.weight.detach(), 0)),
            "down": (tuple(row.weight.shape), where(row.weight.detach(), down.weight.detach(), 1)),
            "same": torch.allclose(out, whole, atol=1e-6),
            "calls": [(c.op, c.bytes, c.phase) for c in calls]}


def _block(ax, x0: float, y0: float, rows: int, cols: int, label: str, split: str | None,
           shards: list[tuple[int, int]], colors: list[str]) -> float:
    """A rows x cols matrix drawn a unit per element, its shards coloured by rank along
    `split` ("rows", "cols" or None: whole on every rank); returns its right edge."""
    import matplotlib

    if split is None:
        ax.add_patch(matplotlib.patches.Rectangle((x0, y0), cols, rows, color="0.7"))
    for r, (a, b) in enumerate(shards if split else []):
        xy, w, h = ((x0 + a, y0), b - a, rows) if split == "cols" else ((x0, y0 + a), cols, b - a)
        ax.add_patch(matplotlib.patches.Rectangle(xy, w, h, color=colors[r], ec="white"))
    ax.text(x0 + cols / 2, y0 - 0.8, label, ha="center", va="bottom", fontsize=7)
    return x0 + cols


def draw_tp_split(target: Path, save) -> str:
    """Chapter 12: which dimension each Linear of the MLP splits, and where the all-reduce sits."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import microddp as mdp

    ranks = mdp.spawn(_tp_rank, 2, timeout=300)
    assert all(r["same"] for r in ranks), "the split block differs from the whole one"
    colors = ["tab:blue", "tab:orange"]
    up = [r["up"][1] for r in ranks]  # rows of up.weight (out, in) = columns of its W^T
    down = [r["down"][1] for r in ranks]  # columns of down.weight = rows of its W^T
    fig, ax = plt.subplots(figsize=(12, 4.6))
    x = _block(ax, 0, 0, T, D, f"X ({T}x{D})\nwhole on every rank", None, [], colors) + 4
    held = "\n".join(f"rank {r}: up.weight[{a}:{b}] {ranks[r]['up'][0]}"
                     for r, (a, b) in enumerate(up))
    x = _block(ax, x, 0, D, 4 * D, f"up: W1^T ({D}x{4 * D}), column-parallel\n{held}",
               "cols", up, colors) + 4
    x = _block(ax, x, 0, T, 4 * D, f"GELU(X W1^T) ({T}x{4 * D})\nsplit the same way: "
               "no message", "cols", up, colors) + 4
    held = "\n".join(f"rank {r}: down.weight[:, {a}:{b}] {ranks[r]['down'][0]}"
                     for r, (a, b) in enumerate(down))
    ax.text(x + D + 1, 2 * T + 10, f"down: W2^T ({4 * D}x{D}),\nrow-parallel\n{held}",
            fontsize=7, va="top")
    x = _block(ax, x, 0, 4 * D, D, "", "rows", down, colors) + 4
    for r in range(2):
        _block(ax, x, r * (T + 4), T, D, f"rank {r}: partial Z", "rows", [(0, T)],
               [colors[r]])
    x += D + 8
    _block(ax, x, T / 2 + 2, T, D, "Z = the sum\n(on every rank)", None, [], colors)
    ax.annotate("all-reduce\n(forward)", xy=(x - 0.3, T + 2), xytext=(x - 7.7, T + 2),
                fontsize=7, color="tab:red", ha="left", va="center",
                arrowprops=dict(arrowstyle="->", color="tab:red"))
    calls = ranks[0]["calls"]
    ledger = "; ".join(f"{phase}: {op} of {b} B" for op, b, phase in calls)
    ax.text(0, 4 * D + 3, f"rank 0's collectives in one forward and backward (tp.comm.counting):"
            f" {ledger}.\nThe forward all-reduce sums the row-parallel partials; the backward one "
            "sums X's gradient at the column-parallel entry. Between the two layers: none.",
            fontsize=7, va="top")
    ax.legend(handles=[matplotlib.patches.Patch(color=c, label=f"rank {r}'s shard")
                       for r, c in enumerate(colors)] +
              [matplotlib.patches.Patch(color="0.7", label="whole on every rank")],
              loc="lower right", fontsize=7)
    ax.set(xlim=(-1, x + D + 1), ylim=(4 * D + 6, -4))
    ax.set_aspect("equal")
    ax.axis("off")
    fig.tight_layout()
    save(fig, target)
    return ("python docs/figures/make.py tp-split (2 ranks: microddp.tp's Column- and "
            f"RowParallelLinear on the MLP block d={D}, 4d={4 * D}, {T} tokens; shards found in "
            "the whole weights, collectives from tp.comm.counting)")
