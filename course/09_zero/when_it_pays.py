"""Chapter 9: when sharding pays. ZeRO-3 divides the model state (parameters, gradients, Adam's
moments) by the number of ranks, but a rank also holds the activations of its batch and the
process itself (the Python interpreter, torch's libraries). On a small model the model state
is a sliver of that, and sharding saves next to nothing while sending 1.5x the bytes of plain
data parallelism; as the model grows, the state becomes what fills the memory.

    python course/09_zero/when_it_pays.py          # 2 ranks
"""

import resource

import torch
from problem import GLOBAL_BATCH, batches, fresh_model, local, loss_fn, train, world_size_from_args

import microddp as mdp

DIMS = (32, 256, 768)


def activation_bytes(world: mdp.World, dim: int) -> int:
    """Bytes autograd saves for backward in one forward of this rank's batch (the weights
    it saves are parameters, not activations, and are left out)."""
    model = fresh_model(dim)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        if t.untyped_storage().data_ptr() not in weights:
            saved += t.numel() * t.element_size()
        return t

    x, y = batches(dim)[0]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_fn(model(local(world, x)), local(world, y))
    return saved


def state(memory: dict[str, int]) -> int:
    return memory["params"] + memory["grads"] + memory["optimizer_state"]


def main(world: mdp.World) -> None:
    rows = []
    for dim in DIMS:
        dp, _ = train(world, 0, dim)
        z3, _ = train(world, 3, dim)
        activations = activation_bytes(world, dim)
        process = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
        n = sum(p.numel() for p in fresh_model(dim).parameters())
        rows.append((dim, n, state(dp), state(z3), activations, process,
                     z3["sent_per_step"] / dp["sent_per_step"]))
    if world.rank != 0:
        return
    mib = 2**20
    print(f"rank 0 of {world.world_size}, Adam, fp32, {GLOBAL_BATCH // world.world_size} "
          "samples per rank")
    print(f"{'width':>6}{'parameters':>12}{'DP state':>12}{'ZeRO-3':>12}{'activations':>13}"
          f"{'process peak':>14}{'saved':>9}  sent vs DP")
    for dim, n, dp, z3, act, proc, sent in rows:
        print(f"{dim:>6}{n:>12}{dp / mib:>9.2f} MiB{z3 / mib:>9.2f} MiB{act / mib:>10.2f} MiB"
              f"{proc / mib:>11.0f} MiB{100 * (dp - z3) / proc:>8.2f}%  {sent:.2f}x")


if __name__ == "__main__":
    mdp.spawn(main, world_size_from_args(__doc__), backend="gloo")
