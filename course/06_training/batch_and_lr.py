"""Chapter 6, script 2: batch size and learning rate when the world size changes.

    python course/06_training/batch_and_lr.py

Data parallelism averages the ranks' gradients. If the *global* batch stays fixed (each of N
ranks takes 1/N of it), that average is exactly the single-process gradient: nothing else
changes, including the learning rate. If instead each rank keeps its own batch size, the
global batch grows N times, and the usual fix is to grow the learning rate with it.
"""

import torch
import torch.nn.functional as F

import microddp as mdp
from microddp.data import digits

GLOBAL_BATCH = 64


def model_and_batch():
    torch.manual_seed(0)
    model = mdp.FullMLP(32, depth=2, n_classes=10, in_features=64)
    data = digits().train
    return model, data.x[:GLOBAL_BATCH], data.y[:GLOBAL_BATCH]


def gradients(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def worker(world) -> float:
    """Each rank: its half of the global batch, through DDP; returns the gap to one process."""
    model, x, y = model_and_batch()
    ddp = mdp.DDP(model)
    mine = torch.tensor_split(torch.arange(GLOBAL_BATCH), world.world_size)[world.rank]
    F.cross_entropy(ddp(x[mine]), y[mine]).backward()  # mean over my half ...
    averaged = gradients(model)  # ... and DDP averaged the halves over ranks

    single, x, y = model_and_batch()
    F.cross_entropy(single(x), y).backward()  # one process, the whole batch
    return (averaged - gradients(single)).abs().max().item()


def main() -> None:
    gaps = mdp.spawn(worker, 2, timeout=120, backend="gloo")
    print(f"global batch {GLOBAL_BATCH} = 2 ranks x {GLOBAL_BATCH // 2}: DDP's averaged "
          f"gradient vs one process on all {GLOBAL_BATCH} samples")
    print(f"  max |difference| = {max(gaps):.1e} (rounding only: the same gradient)")
    print("so with a fixed global batch, the learning rate stays as it is:")
    base_lr, per_rank = 0.05, 32
    print(f"  {'ranks':>5} {'per-rank batch':>15} {'global batch':>13} {'lr':>7}")
    for n in (1, 2, 4, 8):
        print(f"  {n:>5} {GLOBAL_BATCH // n:>15} {GLOBAL_BATCH:>13} {base_lr:>7.3f}")
    print(f"keep {per_rank} samples per rank instead, and the global batch grows with the "
          "world;")
    print("the linear scaling rule grows the learning rate by the same factor "
          "(with a warm-up):")
    print(f"  {'ranks':>5} {'per-rank batch':>15} {'global batch':>13} {'lr':>7}")
    for n in (1, 2, 4, 8):
        print(f"  {n:>5} {per_rank:>15} {per_rank * n:>13} {base_lr * n:>7.3f}")


if __name__ == "__main__":
    main()
