"""Chapter 13's figure, drawn by make.py: the ranks of a dp 2 x pp 2 x tp 2 mesh as
microddp.comms.mesh3d lays them out, with its three kinds of group: TP (boxes around
neighbours, one host), DP (the same shard of a stage in each replica) and PP (one replica's
stages, for one TP rank)."""

from __future__ import annotations

from pathlib import Path


def draw_mesh(target: Path, save) -> str:
    """The 2 x 2 x 2 mesh: stages as hosts side by side, replicas as rows, TP ranks in boxes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    from microddp.comms.mesh3d import Mesh3D

    mesh = Mesh3D(dp=2, pp=2, tp=2)
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    where = {}
    for r in range(mesh.size):
        stage, replica, t = mesh.coords(r)
        where[r] = (stage * 4.2 + t * 1.3, (mesh.dp - 1 - replica) * 1.8)
    for stage in range(mesh.pp):  # a stage's ranks: one host
        x0 = stage * 4.2 - 0.75
        ax.add_patch(FancyBboxPatch((x0, -0.75), 2.8, 3.3, boxstyle="round,pad=0.05",
                                    fill=False, ls=":", color="0.4"))
        ax.text(x0 + 1.4, 2.75, f"host {stage}: stage {stage}", ha="center", fontsize=9)
    for stage in range(mesh.pp):
        for replica in range(mesh.dp):
            ranks = mesh.tp_ranks(stage, replica)
            x, y = where[ranks[0]]
            ax.add_patch(FancyBboxPatch((x - 0.45, y - 0.45), 2.2, 0.9,
                                        boxstyle="round,pad=0.05", color="tab:blue",
                                        alpha=0.15))
            ax.text(x + 0.65, y + 0.55, f"TP group {ranks}", ha="center", fontsize=7,
                    color="tab:blue")
    for r, (x, y) in where.items():
        stage, replica, t = mesh.coords(r)
        ax.add_patch(plt.Circle((x, y), 0.32, color="white", ec="black", zorder=3))
        ax.text(x, y, str(r), ha="center", va="center", fontsize=10, zorder=4)
        ax.text(x + 0.42, y - 0.42, f"r{replica} t{t}", ha="left", fontsize=6, color="0.3")
    for stage in range(mesh.pp):  # DP: same stage, same TP rank, across replicas
        for t in range(mesh.tp):
            a, b = (where[r] for r in mesh.dp_ranks(stage, t))
            ax.plot([a[0] - 0.25, b[0] - 0.25], [a[1] - 0.25, b[1] + 0.25],
                    color="tab:green", lw=1.5)
    for replica in range(mesh.dp):  # PP: same replica, same TP rank, across stages
        for t in range(mesh.tp):
            a, b = (where[r] for r in mesh.pp_ranks(replica, t))
            bend = -0.3 if t == 0 else 0.3  # tp rank 0's arc above the boxes, 1's below
            ax.annotate("", xy=(b[0], b[1] + 0.33 * (1 if t == 0 else -1)),
                        xytext=(a[0], a[1] + 0.33 * (1 if t == 0 else -1)),
                        arrowprops={"arrowstyle": "->", "color": "tab:red", "lw": 1,
                                    "connectionstyle": f"arc3,rad={bend}"})
    ax.plot([], [], color="tab:blue", lw=6, alpha=0.3, label="TP: all-reduce in every block")
    ax.plot([], [], color="tab:green", label="DP: gradients averaged once a step")
    ax.plot([], [], color="tab:red", label="PP: one activation per micro-batch")
    ax.legend(fontsize=7, loc="lower center", bbox_to_anchor=(0.5, -0.12), ncol=3, frameon=False)
    ax.set_xlim(-1.0, 8.0)
    ax.set_ylim(-1.2, 3.1)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title("dp 2 x pp 2 x tp 2: rank = stage * 4 + replica * 2 + tp rank", fontsize=9)
    fig.tight_layout()
    save(fig, target)
    return "python docs/figures/make.py mesh (microddp.comms.mesh3d.Mesh3D(2, 2, 2))"
