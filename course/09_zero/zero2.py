"""Chapter 9: ZeRO-2, the gradients are sharded too. During backward, as soon as a bucket of gradients is
complete it is reduce-scattered (asynchronously, while backward goes on) and the full
gradients are freed, so each rank keeps only the averaged gradient of its own shard. The other
ranks' parts of a bucket wait in a buffer until they are sent, released as soon as the bucket's
reduces complete: the script measures the most a rank held at once, with small buckets so
this small model has several.

    python course/09_zero/zero2.py          # 2 ranks
    python course/09_zero/zero2.py -n 4
"""

import torch
from problem import LR, against_dp, batches, fresh_model, kib, local, loss_fn, world_size_from_args

import microddp as mdp
from microddp import zero

STAGE = 2
BUCKET_MB = 0.05  # ~13,000 parameters a bucket: the chapter's model in several


def packed_in_flight(world: mdp.World) -> None:
    """Train ZeRO-2 with small buckets; print the most bytes of packed gradients rank 0 held
    at once during a backward, measured from their storages, against all buckets' together."""
    z = zero.Zero(fresh_model(), torch.optim.Adam, stage=STAGE, bucket_cap_mb=BUCKET_MB, lr=LR)
    peak = 0
    for x, y in batches():
        loss_fn(z(local(world, x)), local(world, y)).backward()
        peak = max(peak, z.reducer.peak_packed_bytes)
        z.step()
        z.zero_grad()
    rest = [(b.numel - b.sizes[world.rank]) * 4 for b in z.plan.buckets]
    full = sum(p.numel() * 4 for p in z.module.parameters())
    if world.rank == 0:
        print(f"with {len(rest)} buckets of {BUCKET_MB} MiB: packed gradients held at once during "
              f"backward {kib(peak)}; largest bucket's{kib(max(rest))}, all buckets'"
              f"{kib(sum(rest))}, the full gradient{kib(full)}")


def main(world: mdp.World) -> None:
    against_dp(world, STAGE)
    packed_in_flight(world)


if __name__ == "__main__":
    mdp.spawn(main, world_size_from_args(__doc__), backend="gloo")
