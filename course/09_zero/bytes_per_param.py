"""Chapter 9, step 1: where the 16 bytes per parameter go. Plain data parallelism with Adam in
fp32 keeps, on every rank, the parameters (4 bytes each), their gradients (4) and Adam's two
moments (8), measured here from the live tensors.

    python course/09_zero/bytes_per_param.py          # 2 ranks
    python course/09_zero/bytes_per_param.py -n 4
"""

from problem import fresh_model, train, world_size_from_args

import microddp as mdp


def main(world: mdp.World) -> None:
    memory, _ = train(world, stage=0)
    n = sum(p.numel() for p in fresh_model().parameters())
    if world.rank != 0:
        return
    print(f"{n} parameters, Adam, fp32, plain DP on {world.world_size} ranks; per rank:")
    total = 0.0
    for key, label in (("params", "parameters"), ("grads", "gradients"),
                       ("optimizer_state", "optimizer state")):
        per = memory[key] / n
        total += per
        print(f"  {label:<16} {memory[key]:>9} bytes = {per:5.2f} bytes per parameter")
    print(f"  {'total':<16} {'':>9}         {total:5.2f} bytes per parameter")
    # The same bytes per parameter, scaled to the ZeRO paper's 7.5B parameters on 64 ranks.
    p, g, o = (memory[k] / n for k in ("params", "grads", "optimizer_state"))
    psi, ranks = 7.5e9, 64
    for name, per in (("plain DP", p + g + o), ("ZeRO-1", p + g + o / ranks),
                      ("ZeRO-2", p + (g + o) / ranks), ("ZeRO-3", (p + g + o) / ranks)):
        print(f"7.5B parameters on 64 ranks, {name:<8}: {psi * per / 1e9:6.1f} GB per rank")


if __name__ == "__main__":
    mdp.spawn(main, world_size_from_args(__doc__), backend="gloo")
