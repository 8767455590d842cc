"""Issue 57: all_reduce(max/min) of +0.0 and -0.0 (equal, so either may win) must leave the
same bits on every rank, whichever path the call takes. Shared memory's rank 1 used to
compute op(x1, x0) in place while rank 0 computed op(x0, x1): each kept its own zero."""

import torch
import torch.distributed as dist

import microddp as mdp
from microddp import collectives as C

TORCH_OPS = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def zeros(rank: int, n: int) -> torch.Tensor:
    """+0.0 and -0.0 alternating, shifted by rank: every element meets both zeros."""
    return torch.tensor([0.0, -0.0])[(torch.arange(n) + rank) % 2]


def run(world):
    paths = {"comms": lambda t, op: mdp.comms.all_reduce(t, op),
             "shm": C.shm_all_reduce, "ring": C.ring_all_reduce, "tree": C.tree_all_reduce,
             "naive": C.naive_all_reduce,
             "gloo": lambda t, op: dist.all_reduce(t, TORCH_OPS[op])}
    out = {}
    for n in (8, 20_000):  # shared memory's small path, and its large one on 3 ranks
        for op in ("max", "min"):
            for name, fn in paths.items():
                if n > 8 and name not in ("comms", "shm"):
                    continue  # the send/recv paths take no size-dependent turn here
                t = zeros(world.rank, n)
                fn(t, op)
                out[f"{name} {op} {n}"] = torch.signbit(t).tolist()
    return out


def test_max_and_min_of_signed_zeros_give_the_same_bits_on_every_rank():
    ranks = mdp.spawn(run, 3, timeout=120)
    assert len(ranks[0]) == 2 * 6 + 2 * 2
    for key, bits in ranks[0].items():
        assert all(r[key] == bits for r in ranks), (key, [r[key][:4] for r in ranks])
        # shared memory folds in rank order, (x0 op x1) op x2, as one process would
        if key.startswith("shm"):
            name, op, n = key.split()
            fn = torch.maximum if op == "max" else torch.minimum
            ref = fn(fn(zeros(0, int(n)), zeros(1, int(n))), zeros(2, int(n)))
            assert bits == torch.signbit(ref).tolist(), key
