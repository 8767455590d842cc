"""Chapter 5, stage 2: two replicas in one process. Each sees half of every batch; autograd
computes each replica's gradients alone, so we average them by hand before stepping.

    python course/05_data_parallel/manual.py
"""

from problem import batches, finish, fresh_model, loss_fn, report

from microddp.dp import ladder


def main() -> None:
    (model_a, opt_a), (model_b, opt_b) = fresh_model(), fresh_model()
    for step, (x, y) in enumerate(batches()):
        loss = ladder.manual_step([model_a, model_b], [opt_a, opt_b], loss_fn, x, y)
        report(None, step, loss)
    finish(None, model_a)


if __name__ == "__main__":
    main()
