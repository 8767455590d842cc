"""Chapter 5, stage 3: naive data parallelism. Real ranks, each with a replica and its slice
of the batch; after backward, one blocking all-reduce per parameter averages the gradients.

    python course/05_data_parallel/naive.py            # 2 ranks
    python course/05_data_parallel/naive.py -n 4
"""

from problem import batches, finish, fresh_model, local, loss_fn, report, world_size_from_args

import microddp as mdp
from microddp.dp import ladder


def train(world: mdp.World) -> None:
    model, opt = fresh_model()
    for step, (x, y) in enumerate(batches()):
        loss = ladder.naive_step(model, opt, loss_fn, *local(world, x, y))
        report(world, step, loss)
    finish(world, model)


if __name__ == "__main__":
    mdp.spawn(train, world_size_from_args(__doc__), backend="gloo")
