"""What the ZeRO tests train: a small model with the awkward cases (sizes no world size
divides, a frozen layer, a zero-sized parameter, two parameter groups), and the three ways to
train it that every stage must agree with: one process, plain DP (microddp's DDP), ZeRO."""

import torch
from torch import nn

import microddp as mdp
from microddp import zero

STEPS, BATCH, IN = 3, 12, 7
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
}


class Awkward(nn.Module):
    """Linear layers of 7->5->3->(frozen 3->3)->2, plus a parameter with no elements."""

    def __init__(self, with_empty: bool = True) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(IN, 5), nn.Linear(5, 3), nn.Linear(3, 2)
        self.frozen = nn.Linear(3, 3)
        self.frozen.requires_grad_(False)
        self.empty = nn.Parameter(torch.zeros(0)) if with_empty else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.b(torch.relu(self.a(x))))
        out = self.c(self.frozen(h))
        return out if self.empty is None else out + self.empty.sum()


def fresh(with_empty: bool = True) -> Awkward:
    torch.manual_seed(0)
    return Awkward(with_empty)


def groups(model: Awkward) -> list[dict]:
    """Two groups with their own lr; the frozen layer listed too (it must stay untouched)."""
    return [{"params": [*model.a.parameters(), *model.c.parameters(),
                        *model.frozen.parameters()]},
            {"params": [*model.b.parameters(), *([] if model.empty is None else [model.empty])],
             "lr": 0.003}]


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, 2, generator=g)


def local(world, step: int, micro: int = 1, k: int = 0):
    """This rank's share of the step's batch (micro-batch k of `micro`)."""
    x, y = data(step)
    share = BATCH // world.world_size
    x, y = x[world.rank * share:(world.rank + 1) * share], y[world.rank * share:(world.rank + 1) * share]
    m = share // micro
    return x[k * m:(k + 1) * m], y[k * m:(k + 1) * m]


def loss_fn(out, y):
    return nn.functional.mse_loss(out, y)


def single(name: str) -> list[torch.Tensor]:
    """One process, the whole batch: the reference."""
    model = fresh()
    cls, kw = OPTIMIZERS[name]
    opt = cls(groups(model), **kw)
    for step in range(STEPS):
        x, y = data(step)
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def plain_dp(world, name: str, amp: bool = False) -> list[torch.Tensor]:
    ddp = mdp.DDP(fresh())
    cls, kw = OPTIMIZERS[name]
    opt = cls(groups(ddp.module), **kw)
    for step in range(STEPS):
        x, y = local(world, step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            out = ddp(x)
        loss_fn(out.float(), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in ddp.module.parameters()]


def zero_run(world, name: str, stage: int, micro: int = 1, amp: bool = False,
             bucket_cap_mb: float = 40 / 2**20, with_empty: bool = True,
             sync_each: bool = False) -> list[torch.Tensor]:
    """ZeRO `stage`, with `micro` micro-batches per step under no_sync (accumulation); with
    `sync_each`, every micro-step's backward reduces (no no_sync), as DDP allows."""
    model = fresh(with_empty)
    cls, kw = OPTIMIZERS[name]
    z = zero.Zero(model, cls, stage=stage, param_groups=groups(model),
                  bucket_cap_mb=bucket_cap_mb, **kw)
    for step in range(STEPS):
        for k in range(micro):
            x, y = local(world, step, micro, k)
            with z.no_sync() if k < micro - 1 and not sync_each else _nothing():
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                    out = z(x)
                (loss_fn(out.float(), y) / micro).backward()
        z.step()
        z.zero_grad()
    with z.gathered() as m:
        return [p.detach().clone() for p in m.parameters()]


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert [t.shape for t in a] == [t.shape for t in b]
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True) if x.numel())
