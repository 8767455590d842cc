"""Chapter 13: the ranks of a dp x pp x tp mesh, and predict's ranking of every mesh of a
world size for a larger GPT.

    python course/13_3d_parallel/layout.py                    # 2 x 2 x 2, then 64 ranks ranked
    python course/13_3d_parallel/layout.py --world 8 --per-host 4

The rank order is microddp.comms.mesh3d's (TP innermost, PP outermost); the ranking is
`microddp predict --mesh-world N` for a 1.2e9-parameter GPT (d_model 2048, 24 blocks, 16
heads, 1024 tokens, global batch 512) on A100s of 80 GiB, 8 per host on NVLink, 10 GbE
between hosts; a mesh whose state and activations do not fit ranks last.
"""

import argparse

from microddp.comms.mesh3d import Mesh3D
from microddp.predict import mesh3d
from microddp.predict.step import HARDWARE


def show(mesh: Mesh3D) -> None:
    print(f"mesh dp {mesh.dp} x pp {mesh.pp} x tp {mesh.tp}: rank = stage * {mesh.dp * mesh.tp}"
          f" + replica * {mesh.tp} + tp_rank")
    for s in range(mesh.pp):
        row = "  ".join(f"[{' '.join(str(r) for r in mesh.tp_ranks(s, d))}]"
                        for d in range(mesh.dp))
        print(f"  stage {s}: TP groups {row}")
    print("  DP groups (same stage, same TP rank): "
          + " ".join(str(mesh.dp_ranks(s, t)) for s in range(mesh.pp) for t in range(mesh.tp)))
    print("  PP groups (same replica, same TP rank): "
          + " ".join(str(mesh.pp_ranks(d, t)) for d in range(mesh.dp) for t in range(mesh.tp)))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=64, help="ranks to rank the meshes of")
    p.add_argument("--per-host", type=int, default=8, help="ranks per host")
    args = p.parse_args()
    show(Mesh3D(2, 2, 2))
    shape = mesh3d.GPTShape(2048, 24, 16, 1024, 256, batch=512)
    rows = mesh3d.rank(shape, args.world, HARDWARE["a100-nvlink"], 80 * 2**30, microbatches=8,
                       per_host=args.per_host, inter=HARDWARE["10gbe"])
    print(f"\nevery mesh of {args.world} ranks for a {shape.params:.2g}-parameter GPT, "
          f"fastest first ({args.per_host} ranks per host, 80 GiB each):")
    print(mesh3d.table(rows))
    best = rows[0]
    print(f"best: dp {best['dp']} x pp {best['pp']} x tp {best['tp']}, "
          f"{best['step_s'] / rows[-1]['step_s']:.3f} of the worst's step time")


if __name__ == "__main__":
    main()
