"""The reference answer to the ZeRO-1 exercise, from microddp's collectives: average with
all_reduce_mean, update this rank's shard, all-gather the shards (padded to equal length)."""

import math

import torch

import microddp as mdp


def zero1_step(param, grad, momentum, lr, beta):
    world = mdp.init()
    n, p = param.numel(), world.world_size
    size = math.ceil(n / p)
    start = min(n, world.rank * size)
    stop = min(n, start + size)
    mdp.comms.all_reduce_mean(grad)
    momentum.mul_(beta).add_(grad[start:stop])
    mine = torch.zeros(size)
    mine[: stop - start] = param[start:stop] - lr * momentum
    pieces = [torch.empty(size) for _ in range(p)]
    mdp.comms.all_gather(pieces, mine)
    param.copy_(torch.cat(pieces)[:n])
