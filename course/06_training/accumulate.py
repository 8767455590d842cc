"""Chapter 6, script 3: gradient accumulation, and `no_sync` to skip needless all-reduces.

    python course/06_training/accumulate.py

A batch too big for memory can be fed as N micro-batches whose gradients add up before one
optimizer step. Under DDP every backward would average gradients over ranks, N times per step;
only the last average matters, so the first N-1 backwards run inside `no_sync()`.
"""

import contextlib

import torch
import torch.nn.functional as F

import microddp as mdp
from microddp.data import digits
from microddp.dp.comm_hooks import allreduce

MICRO, STEPS_PER_UPDATE = 16, 4  # global micro-batch 16 (8 per rank); 4 make one update


def fresh_model():
    torch.manual_seed(0)
    return mdp.FullMLP(32, depth=2, n_classes=10, in_features=64)


def accumulate(world, use_no_sync: bool) -> tuple[torch.Tensor, int]:
    """One update's gradient from 4 micro-batches; also how many buckets were all-reduced."""
    model = fresh_model()
    ddp = mdp.DDP(model)
    calls = {"n": 0}

    def counting(state, bucket):  # the default averaging, counted
        calls["n"] += 1
        return allreduce(None, bucket)

    ddp.register_comm_hook(None, counting)
    data = digits().train
    for k in range(STEPS_PER_UPDATE):
        micro = torch.arange(k * MICRO, (k + 1) * MICRO)
        mine = torch.tensor_split(micro, world.world_size)[world.rank]
        last = k == STEPS_PER_UPDATE - 1
        # Forward and backward both inside: DDP decides at forward whether backward syncs.
        with contextlib.nullcontext() if (last or not use_no_sync) else ddp.no_sync():
            loss = F.cross_entropy(ddp(data.x[mine]), data.y[mine]) / STEPS_PER_UPDATE
            loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()]), calls["n"]


def worker(world):
    synced, calls_always = accumulate(world, use_no_sync=False)
    skipped, calls_no_sync = accumulate(world, use_no_sync=True)
    big = fresh_model()  # one process, one batch of all 64 samples
    data = digits().train
    n = MICRO * STEPS_PER_UPDATE
    F.cross_entropy(big(data.x[:n]), data.y[:n]).backward()
    reference = torch.cat([p.grad.flatten() for p in big.parameters()])
    return (calls_always, calls_no_sync, (synced - reference).abs().max().item(),
            (skipped - reference).abs().max().item())


def main() -> None:
    always, no_sync, gap_always, gap_no_sync = mdp.spawn(worker, 2, timeout=120, backend="gloo")[0]
    n = MICRO * STEPS_PER_UPDATE
    print(f"{STEPS_PER_UPDATE} micro-batches of {MICRO} (2 ranks x {MICRO // 2}) "
          f"= one update over {n} samples")
    print(f"  bucket all-reduces per update, syncing every backward: {always}")
    print(f"  bucket all-reduces per update, no_sync on the first "
          f"{STEPS_PER_UPDATE - 1}: {no_sync}")
    print(f"  max |gradient - one batch of {n}|: every backward synced {gap_always:.1e}, "
          f"with no_sync {gap_no_sync:.1e}")
    print(f"same gradient, {always // no_sync}x fewer all-reduces")


if __name__ == "__main__":
    main()
