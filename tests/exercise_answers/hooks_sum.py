"""A wrong answer: sums the gradients instead of averaging them."""

import microddp as mdp


def attach_gradient_averaging(model):
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: mdp.comms.all_reduce(p.grad, "sum"))
