"""Chapter 5, stage 1: the monolith. One process trains on the whole batch: the baseline
every later stage must reproduce.

    python course/05_data_parallel/monolith.py
"""

from problem import batches, finish, fresh_model, loss_fn, report

from microddp.dp import ladder


def main() -> None:
    model, opt = fresh_model()
    for step, (x, y) in enumerate(batches()):
        loss = ladder.monolith_step(model, opt, loss_fn, x, y)
        report(None, step, loss)
    finish(None, model)


if __name__ == "__main__":
    main()
