"""Issue 57: what one rank alone changes (a frozen parameter, a bucket size, a ZeRO stage or
optimizer) is refused at construction on every rank, in one line naming it and the ranks,
instead of training on with different gradients per rank."""

import pytest
import torch
from torch import nn

import microddp as mdp
from microddp import MicroDDPError


class Small(nn.Module):
    def __init__(self, width=4):
        super().__init__()
        self.a = nn.Linear(4, width)
        self.b = nn.Linear(width, 2)

    def forward(self, x):
        return self.b(self.a(x))


def _attempt(build) -> str:
    try:
        build()
        return "built"
    except MicroDDPError as e:
        return str(e)


def ddp_cases(world):
    odd = world.rank == 1
    out = {}

    def frozen():
        m = Small()
        if odd:
            m.a.bias.requires_grad_(False)
        return mdp.DDP(m, find_unused_parameters=True)

    out["frozen"] = _attempt(frozen)
    out["bucket"] = _attempt(lambda: mdp.DDP(Small(), bucket_cap_mb=1 if odd else 25))
    out["same"] = _attempt(lambda: mdp.DDP(Small(), bucket_cap_mb=2.0 if odd else 2))
    return out


def test_ddp_refuses_a_parameter_frozen_or_a_bucket_size_on_one_rank_only():
    ranks = mdp.spawn(ddp_cases, 2, timeout=60)
    assert ranks[0] == ranks[1]  # every rank says the same line
    out = ranks[0]
    assert ("parameter 'a.bias' is not the same everywhere (rank 0: trainable; rank 1: frozen)"
            in out["frozen"]), out["frozen"]
    assert ("DistributedDataParallel was built with different arguments on different ranks: "
            "bucket_cap_mb is not the same everywhere (rank 0: bucket_cap_mb=25.0; "
            "rank 1: bucket_cap_mb=1.0)") in out["bucket"], out["bucket"]
    assert out["same"] == "built"


@pytest.mark.parametrize("cap", [float("inf"), float("nan"), "25", -1, True])
def test_ddp_refuses_a_bucket_size_that_is_not_a_finite_positive_number(cap):
    with pytest.raises(MicroDDPError, match=r"bucket_cap_mb must be a positive number of MiB, "
                                            r"finite and not a string, got "):
        mdp.DDP(Small(), bucket_cap_mb=cap)


def zero_cases(world):
    from microddp import zero
    odd = world.rank == 1

    def build(width=4, frozen=False, stage=2, opt=torch.optim.SGD, cap=None, lr=0.1):
        m = Small(width)
        if frozen:
            m.a.bias.requires_grad_(False)
        return zero.Zero(m, opt, stage=stage, bucket_cap_mb=cap, lr=lr)

    return {
        "width": _attempt(lambda: build(width=5 if odd else 4)),
        "frozen": _attempt(lambda: build(frozen=odd)),
        "stage": _attempt(lambda: build(stage=3 if odd else 2)),
        "optimizer": _attempt(lambda: build(opt=torch.optim.Adam if odd else torch.optim.SGD)),
        "lr": _attempt(lambda: build(lr=0.2 if odd else 0.1)),
        "bucket": _attempt(lambda: build(cap=1 if odd else None)),
        "same": _attempt(lambda: build(stage=3, cap=2)),
        "inf": _attempt(lambda: build(cap=float("inf"))),
    }


def test_zero_refuses_a_model_or_argument_that_differs_on_one_rank():
    ranks = mdp.spawn(zero_cases, 2, timeout=90)
    assert ranks[0] == ranks[1]  # every rank says the same line
    out = ranks[0]
    assert out["width"].startswith("the model differs across ranks: parameter 'a.weight' is not "
                                   "the same everywhere (rank 0: shape (4, 4) float32; "
                                   "rank 1: shape (5, 4) float32)"), out["width"]
    assert "wrapping it in Zero" in out["width"]
    assert ("parameter 'a.bias' is not the same everywhere (rank 0: trainable; rank 1: frozen)"
            in out["frozen"]), out["frozen"]
    args = "Zero was built with different arguments on different ranks: "
    assert out["stage"].startswith(args + "stage is not the same everywhere (rank 0: stage=2; "
                                   "rank 1: stage=3)"), out["stage"]
    assert out["optimizer"].startswith(
        args + "optimizer is not the same everywhere (rank 0: optimizer=torch.optim.sgd.SGD; "
        "rank 1: optimizer=torch.optim.adam.Adam)"), out["optimizer"]
    assert "optimizer options is not the same everywhere" in out["lr"], out["lr"]
    assert ("bucket_cap_mb is not the same everywhere (rank 0: bucket_cap_mb=None; "
            "rank 1: bucket_cap_mb=1.0)") in out["bucket"], out["bucket"]
    assert out["same"] == "built"
    assert out["inf"] == "bucket_cap_mb must be a positive number of MiB, finite and not a " \
                         "string, got inf"
