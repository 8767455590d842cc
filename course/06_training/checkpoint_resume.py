"""Chapter 6, script 5: save from rank 0, crash, resume, and end bit-identical.

    python course/06_training/checkpoint_resume.py

A checkpoint must hold everything the next step depends on: weights, optimizer state
(momentum), the step, the sampler's place in the epoch and the random generators. Only rank 0
writes (the replicas are identical), atomically, and every rank waits at a barrier until the
file is complete. Then a resumed run cannot be told apart from one that never stopped.
"""

import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

import microddp as mdp
from microddp import checkpoint
from microddp.data import ShardedBatchSampler, digits

TOTAL, EVERY, CRASH_AFTER = 12, 4, 6


def run(world, folder: str, stop_after: int):
    torch.manual_seed(0)
    model = mdp.FullMLP(32, depth=2, n_classes=10, in_features=64)
    ddp = mdp.DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    data = digits().train
    sampler = ShardedBatchSampler(len(data), 64, world.rank, world.world_size, seed=0)
    step = 0
    found = checkpoint.load_latest(folder, map_location=world.device)  # every rank reads it
    if found:
        state, _ = found
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sampler.load_state_dict(state["sampler"])
        checkpoint.set_rng_state(state["rng"][world.rank])
        step = state["step"]
    started_at = step

    def state_now():
        return {"format": checkpoint.FORMAT, "model": model.state_dict(),
                "optimizer": opt.state_dict(), "step": step, "epoch": sampler.epoch,
                "position": sampler.position, "sampler": sampler.state_dict(),
                "world_size": world.world_size}

    while step < stop_after:
        for idx in sampler:  # the sampler remembers where it was, even across a resume
            loss = F.cross_entropy(ddp(data.x[idx]), data.y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if step % EVERY == 0:
                checkpoint.save_from_rank0(state_now, folder, step, world)
            if step == stop_after:
                break
    return started_at, step, {k: v.clone() for k, v in model.state_dict().items()}


def first_two_runs(world, clean: str, crashed: str):
    """Run 1 goes all the way; run 2 stops dead after CRASH_AFTER steps."""
    reference = run(world, clean, TOTAL)[2]
    run(world, crashed, CRASH_AFTER)
    return reference


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        clean, crashed = str(Path(tmp) / "clean"), str(Path(tmp) / "crashed")
        reference = mdp.spawn(first_two_runs, 2, args=(clean, crashed), timeout=120,
                              backend="gloo")[0]
        print(f"run 1: {TOTAL} steps without stopping, a checkpoint every {EVERY}")
        files = [p.name for p in checkpoint.list_checkpoints(crashed)]
        print(f"run 2: stops dead after step {CRASH_AFTER}; on disk (written by rank 0 only): "
              f"{files}")
        # New processes: nothing survives from run 2 except what is on disk.
        start, end, resumed = mdp.spawn(run, 2, args=(crashed, TOTAL), timeout=120,
                                        backend="gloo")[0]
        print(f"run 3: resumes from step {start} (steps {start + 1}-{CRASH_AFTER} are redone), "
              f"trains to step {end}")
        gap = max((resumed[k] - reference[k]).abs().max().item() for k in reference)
        same = all(torch.equal(resumed[k], reference[k]) for k in reference)
        print(f"max |resumed - uninterrupted| = {gap}; bit-identical: {same}")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
