"""Sparse gradients (issue 50): nn.Embedding / nn.EmbeddingBag with sparse=True, averaged by
microddp's DDP and by torch's in the same ranks, from the same seed and data; parameters and
gradients compared bit for bit, on 2 and 3 ranks, with and without no_sync accumulation."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import microddp as mdp
from microddp import MicroDDPError

ENGINES = ("microddp", "torch")


class BagOnly(nn.Module):
    """Nothing but a sparse EmbeddingBag (the shape of torch's SparseGradientModule)."""

    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(20, 8, sparse=True)

    def forward(self, x):
        return F.softmax(self.bag(x), dim=1)


class Mixed(nn.Module):
    """A sparse Embedding under a dense head: both kinds of gradient in one backward."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(30, 6, sparse=True)
        self.head = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x):
        return self.head(self.emb(x).mean(dim=1))


def run(world, engine, kind, accumulate):
    torch.manual_seed(0)
    model = BagOnly() if kind == "bag" else Mixed()
    cls = mdp.DDP if engine == "microddp" else nn.parallel.DistributedDataParallel
    ddp = cls(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    rows = 20 if kind == "bag" else 30
    for step in range(4):
        opt.zero_grad()
        for micro in range(2 if accumulate else 1):
            g = torch.Generator().manual_seed(100 * step + 10 * micro + world.rank)
            x = torch.randint(0, rows, (5, 3), generator=g)
            y = torch.randint(0, 4 if kind == "mixed" else 8, (5,), generator=g)
            last = micro == (1 if accumulate else 0)
            ctx = ddp.no_sync() if not last else _null()
            with ctx:
                F.cross_entropy(ddp(x), y).backward()
        grads = [p.grad.to_dense() if p.grad.is_sparse else p.grad for p in model.parameters()]
        opt.step()
    return [p.detach().clone() for p in model.parameters()] + [g.clone() for g in grads]


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def every_case(world):
    out = {}
    for kind in ("bag", "mixed"):
        for accumulate in (False, True):
            ours, theirs = (run(world, e, kind, accumulate) for e in ENGINES)
            out[kind, accumulate] = [torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)]
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_sparse_gradients_average_as_torchs(n):
    for out in mdp.spawn(every_case, n, timeout=180):
        assert out and all(all(v) and v for v in out.values()), out


def test_sparse_and_a_comm_hook_say_what_to_do():
    ddp = mdp.DDP(BagOnly())
    with pytest.raises(MicroDDPError, match="sparse=False to use a hook"):
        ddp.register_comm_hook(None, "allreduce")
