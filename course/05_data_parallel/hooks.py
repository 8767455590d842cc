"""Chapter 5, stage 4: hooks. The all-reduce moves into a hook that fires the moment each
gradient is accumulated, during backward; the training step is the monolith's again.

    python course/05_data_parallel/hooks.py            # 2 ranks
    python course/05_data_parallel/hooks.py -n 4
"""

from problem import batches, finish, fresh_model, local, loss_fn, report, world_size_from_args

import microddp as mdp
from microddp.dp import ladder


def train(world: mdp.World) -> None:
    model, opt = fresh_model()
    ladder.GradHooks(model.parameters())
    for step, (x, y) in enumerate(batches()):
        loss = ladder.monolith_step(model, opt, loss_fn, *local(world, x, y))
        report(world, step, loss)
    finish(world, model)


if __name__ == "__main__":
    mdp.spawn(train, world_size_from_args(__doc__), backend="gloo")
