"""A wrong answer: updates this rank's shard but never shares it."""

import math

import microddp as mdp


def zero1_step(param, grad, momentum, lr, beta):
    world = mdp.init()
    n = param.numel()
    size = math.ceil(n / world.world_size)
    start = min(n, world.rank * size)
    stop = min(n, start + size)
    mdp.comms.all_reduce_mean(grad)
    momentum.mul_(beta).add_(grad[start:stop])
    param[start:stop] -= lr * momentum
