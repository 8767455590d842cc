"""Chapter 5, stage 5: buckets. Gradients are copied, in reverse order, into a few flat
buffers; one all-reduce per full bucket instead of one per parameter.

    python course/05_data_parallel/buckets.py                     # 2 ranks, 16 KiB buckets
    python course/05_data_parallel/buckets.py -n 4
"""

from problem import batches, finish, fresh_model, local, loss_fn, report, world_size_from_args

import microddp as mdp
from microddp.dp import ladder

BUCKET_CAP_MB = 1 / 64  # 16 KiB: this small model's 66 KiB of gradients fill 4 buckets


def train(world: mdp.World) -> None:
    model, opt = fresh_model()
    ladder.BucketHooks(model.parameters(), BUCKET_CAP_MB)
    for step, (x, y) in enumerate(batches()):
        loss = ladder.monolith_step(model, opt, loss_fn, *local(world, x, y))
        report(world, step, loss)
    finish(world, model)


if __name__ == "__main__":
    mdp.spawn(train, world_size_from_args(__doc__), backend="gloo")
