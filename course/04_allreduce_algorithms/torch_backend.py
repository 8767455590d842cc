"""Chapter 4: PyTorch's own DDP, unchanged, on microddp's shared memory.

    python course/04_allreduce_algorithms/torch_backend.py

A torch.distributed backend is a process group: an object with `allreduce`, `broadcast`,
`allgather`, ... that torch calls and that hands back a Work to wait on. microddp registers
one from Python, named "microddp" (`import microddp.backend`), whose CPU calls between ranks
of one host go through shared memory and the rest to gloo. Two ranks train the same model
with torch.nn.parallel.DistributedDataParallel, once on a gloo group and once on a "microddp"
group, steps interleaved; the script prints what DDP asked the backend for, whether both
trainings end with the same parameters, and their step times.
Benchmark: `microddp bench ddp --engines torch --torch-on-microddp --control`.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import microddp as mdp
import microddp.backend  # noqa: F401 (registers the "microddp" backend with torch.distributed)
from microddp.timing import compare, interleaved, median

DIM, DEPTH, BATCH, STEPS = 128, 16, 32, 30


def trainer(group, rank: int):
    """Plain PyTorch: a model, DDP on `group`, an optimizer, one step per call."""
    torch.manual_seed(0)
    model = DDP(mdp.FullMLP(DIM, DEPTH), process_group=group)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)

    def step() -> None:
        x, y = torch.randn(BATCH, DIM, generator=g), torch.randint(0, 2, (BATCH,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    return model, step


def rank_main(rank: int) -> dict:
    dist.init_process_group("gloo")  # torchrun's environment, from spawn
    groups = {"gloo": dist.group.WORLD, "microddp": dist.new_group(backend="microddp")}
    models, steps = {}, {}
    for name, group in groups.items():
        models[name], steps[name] = trainer(group, rank)
    asked = dict(groups["microddp"].calls)  # construction: what DDP asks before training
    times = interleaved(steps, STEPS, 3, dist.barrier)
    calls = dict(groups["microddp"].calls)
    same = all(torch.equal(a, b) for a, b in zip(models["gloo"].parameters(),
                                                  models["microddp"].parameters(), strict=True))
    dist.destroy_process_group()
    return {"asked": asked, "calls": calls, "same": same, "times": times}


def main() -> None:
    out = mdp.spawn(rank_main, 2, join=False, timeout=300)[0]
    print(f"PyTorch's DDP of FullMLP({DIM}, {DEPTH}), 2 ranks, batch {BATCH}/rank, "
          f"{STEPS + 3} steps on each backend")
    print("What DDP asked the microddp backend for, in calls:")
    print(f"  {'op':<10} {'path':<5} {'construction':>12} {'training':>9}")
    for (op, path), n in sorted(out["calls"].items()):
        first = out["asked"].get((op, path), 0)
        print(f"  {op:<10} {path:<5} {first:>12} {n - first:>9}")
    print(f"parameters after training, equal to gloo's bit for bit: "
          f"{'yes' if out['same'] else 'NO'}")
    gloo, mine = out["times"].get("gloo"), out["times"].get("microddp")
    ratio, (lo, hi) = compare(mine, gloo)
    print(f"median step: gloo {median(gloo) * 1e3:.2f} ms, microddp {median(mine) * 1e3:.2f} ms; "
          f"microddp / gloo {ratio:.2f} (90% interval {lo:.2f}-{hi:.2f})")


if __name__ == "__main__":
    main()
