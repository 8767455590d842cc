"""microddp's DistributedDataParallel against PyTorch's: same seed, same data, K steps.

On 2 ranks the parameters must be bit-identical (torch.equal); on 3 and 4 ranks equal within
1e-6 relative. Cases run together inside one spawn per world size to keep the suite fast.
"""

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import microddp as mdp
from microddp.dp import comm_hooks, wrap
from microddp.dp.ladder import shard, toy_data

DIM, STEPS = 16, 4


class WithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.bn, self.b = nn.Linear(DIM, DIM), nn.BatchNorm1d(DIM), nn.Linear(DIM, 2)

    def forward(self, x):
        return self.b(torch.relu(self.bn(self.a(x))))


class Tied(nn.Module):
    """The output layer shares the input layer's weight; one layer is frozen."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(DIM, DIM, bias=False)
        self.frozen = nn.Linear(DIM, DIM).requires_grad_(False)
        self.mid = nn.Linear(DIM, DIM)
        self.out = nn.Linear(DIM, DIM, bias=False)
        self.out.weight = self.inp.weight

    def forward(self, x):
        return self.out(torch.relu(self.mid(self.frozen(self.inp(x)))))[:, :2]


class Branchy(nn.Module):
    """`extra` is used only on some ranks and some steps: find_unused_parameters territory."""

    def __init__(self):
        super().__init__()
        self.body, self.head, self.extra = nn.Linear(DIM, DIM), nn.Linear(DIM, 2), nn.Linear(DIM, 2)

    def forward(self, x, use_extra=False):
        out = self.head(torch.relu(self.body(x)))
        return out + self.extra(x) if use_extra else out


class ChannelsLast(nn.Module):
    """A conv layer whose weight is stored channels-last: its bucket view is not row-major."""

    def __init__(self):
        super().__init__()
        self.conv, self.head = nn.Conv2d(4, 8, 2), nn.Linear(8, 2)

    def forward(self, x):
        x = x.view(-1, 4, 2, 2).contiguous(memory_format=torch.channels_last)
        return self.head(torch.relu(self.conv(x)).flatten(1))


class SmallLent(nn.Module):
    """Gradients big enough on average to be lent, each small enough to be copied in together."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(224, 224, bias=False), nn.ReLU(),
                                 nn.Linear(224, 224, bias=False), nn.ReLU(),
                                 nn.Linear(224, 2, bias=False))

    def forward(self, x):
        return self.net(x)


MODELS = {"mlp": lambda: mdp.FullMLP(DIM, 4), "wide": lambda: mdp.FullMLP(512, 3),
          "bn": WithBatchNorm, "tied": Tied, "branchy": Branchy,
          "channels_last": lambda: ChannelsLast().to(memory_format=torch.channels_last),
          "small_lent": SmallLent}
TORCH_HOOKS = {"allreduce": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook}
OUR_HOOKS = {"allreduce": comm_hooks.allreduce, "fp16": comm_hooks.fp16_compress}


def train(world, engine, model="mlp", optim="sgd", accumulate=1, hook=None, seed_per_rank=False,
          set_to_none=True, **ddp_kwargs):
    torch.manual_seed(world.rank if seed_per_rank else 0)  # per-rank: the broadcast must fix it
    module = MODELS[model]()
    dim = module.net[0].in_features if model in ("wide", "small_lent") else DIM
    ddp = wrap(module, engine, **ddp_kwargs)
    if hook:
        ddp.register_comm_hook(None, (TORCH_HOOKS if engine == "torch" else OUR_HOOKS)[hook])
    opt = (torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9) if optim == "sgd"
           else torch.optim.Adam(ddp.parameters(), lr=1e-2))
    x, y = toy_data(8 * world.world_size * STEPS * accumulate, dim, seed=1)
    micro = list(zip(x.chunk(STEPS * accumulate), y.chunk(STEPS * accumulate), strict=True))
    for step in range(STEPS):
        opt.zero_grad(set_to_none=set_to_none)
        for k in range(accumulate):
            xb, yb = micro[step * accumulate + k]
            xb, yb = shard(xb, world.rank, world.world_size), shard(yb, world.rank, world.world_size)
            used = (step + k + world.rank) % 2 == 1  # differs between ranks and micro-steps
            kwargs = {"use_extra": used} if model == "branchy" else {}
            if k < accumulate - 1:
                with ddp.no_sync():
                    nn.functional.cross_entropy(ddp(xb, **kwargs), yb).backward()
            else:
                nn.functional.cross_entropy(ddp(xb, **kwargs), yb).backward()
        opt.step()
    return [t.detach().clone() for t in [*module.parameters(), *module.buffers()]]


CASES = {
    "fullmlp sgd": {},
    "fullmlp adam": {"optim": "adam"},
    "no_sync accumulation": {"accumulate": 3},
    # grads of wide layers are lent views of the bucket: kept by zero_grad, reused in place
    "zero_grad keeps grads": {"model": "wide", "set_to_none": False, "accumulate": 2,
                              "optim": "adam"},
    "small lent grads kept by zero_grad": {"model": "small_lent", "set_to_none": False,
                                           "accumulate": 2},
    "gradient_as_bucket_view": {"gradient_as_bucket_view": True, "accumulate": 2},
    "several buckets after rebuild": {"model": "wide"},
    "small buckets": {"bucket_cap_mb": 0.001, "optim": "adam"},
    "batchnorm": {"model": "bn", "seed_per_rank": True, "accumulate": 2},
    "tied and frozen weights": {"model": "tied"},
    "channels-last weights": {"model": "channels_last", "optim": "adam"},
    "find_unused_parameters": {"model": "branchy", "find_unused_parameters": True},
    "find_unused_parameters with no_sync": {"model": "branchy", "find_unused_parameters": True,
                                            "accumulate": 2},
    "static_graph": {"static_graph": True},
    "allreduce comm hook": {"hook": "allreduce"},
    "fp16 comm hook": {"hook": "fp16", "model": "bn"},
}


def compare_all(world):
    out = {}
    for name, case in CASES.items():
        ours, theirs = train(world, "microddp", **case), train(world, "torch", **case)
        rels = [((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
                for a, b in zip(ours, theirs, strict=True)]
        out[name] = (all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)),
                     max(float("inf") if r != r else r for r in rels))  # a NaN is a failure
    return out


@pytest.mark.filterwarnings("ignore")
def test_bit_identical_to_torch_ddp_on_two_ranks():
    for rank_result in mdp.spawn(compare_all, 2, timeout=180):
        assert {name: same for name, (same, _) in rank_result.items()} == dict.fromkeys(CASES, True)


@pytest.mark.parametrize("world_size", [3, pytest.param(4, marks=pytest.mark.slow)])
def test_matches_torch_ddp_on_three_and_four_ranks(world_size):
    for rank_result in mdp.spawn(compare_all, world_size, timeout=240):
        worst = {name: rel for name, (_, rel) in rank_result.items() if not rel <= 1e-6}
        assert worst == {}
