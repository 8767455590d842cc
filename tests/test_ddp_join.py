"""Uneven inputs: with `ddp.join()` ranks with fewer batches shadow the others; results match
PyTorch's DDP join bit for bit, and throw_on_early_termination fails every rank at once."""

import warnings

import torch
from torch import nn
from torch.distributed.algorithms.join import Join as TorchJoin

import microddp as mdp
from microddp import MicroDDPError
from microddp.dp import wrap
from test_ddp_equivalence import DIM, MODELS

with warnings.catch_warnings():
    # torch.distributed.optim scripts its functional optimizers with torch.jit when imported,
    # which torch itself deprecates: 66 warnings that are torch's, not ours, on every run.
    warnings.filterwarnings("ignore", r"`torch\.jit\.(script|interface)` is deprecated",
                            DeprecationWarning)
    from torch.distributed.optim import ZeroRedundancyOptimizer


def uneven(world, engine, model="mlp", set_to_none=True, **join_kwargs):
    torch.manual_seed(0)
    module = MODELS[model]()
    ddp = wrap(module, engine)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(world.rank)
    dim = module.net[0].in_features if model == "wide" else DIM
    n_batches = 2 + 2 * world.rank  # rank 0 runs out first
    with ddp.join(**join_kwargs):
        for i in range(n_batches):
            opt.zero_grad(set_to_none=set_to_none)
            x, y = torch.randn(6, dim, generator=g), torch.randint(0, 2, (6,), generator=g)
            if i == 1:  # accumulate across one no_sync micro-step as well
                with ddp.no_sync():
                    nn.functional.cross_entropy(ddp(x), y).backward()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
    # the gradients too: shadowing the others must leave a joined rank's own .grad alone
    grads = [p.grad.clone() for p in module.parameters() if p.grad is not None]
    return [t.detach().clone() for t in [*module.parameters(), *module.buffers()]], grads


def join_cases(world):
    out = {}
    for name, kwargs in {"default": {}, "bn": {"model": "bn"},
                         "divide by active ranks": {"divide_by_initial_world_size": False},
                         # lent buckets that are the .grad the joined rank keeps
                         "wide, grads kept": {"model": "wide", "set_to_none": False}}.items():
        (ours, our_grads), (theirs, their_grads) = (uneven(world, "microddp", **kwargs),
                                                    uneven(world, "torch", **kwargs))
        out[name] = all(torch.equal(a, b) for a, b in zip(ours + our_grads,
                                                          theirs + their_grads, strict=True))
    return out, uneven(world, "microddp")[0]


def test_join_matches_torch_and_ends_with_identical_replicas():
    results = mdp.spawn(join_cases, 3, timeout=120)
    for same, _ in results:
        assert same == {"default": True, "bn": True, "divide by active ranks": True,
                        "wide, grads kept": True}
    final = [params for _, params in results]
    assert all(torch.equal(a, b) for other in final[1:] for a, b in zip(final[0], other, strict=True))


def early(world):
    try:
        uneven(world, "microddp", throw_on_early_termination=True)
    except MicroDDPError as e:
        return str(e)
    return "no error"


def test_throw_on_early_termination_fails_every_rank():
    messages = mdp.spawn(early, 2, timeout=60)
    assert "ran out of data" in messages[0] and "ran out of data" in messages[1]


def generic_join(world, engine, model="bn", zero=False, after=False, **join_kwargs):
    """torch's own Join([model, optimizer]) context manager, which torch's docs show for
    uneven inputs with ZeroRedundancyOptimizer."""
    torch.manual_seed(0)
    module = MODELS[model]()
    ddp = wrap(module, engine)
    opt = (ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, lr=0.1) if zero
           else torch.optim.SGD(ddp.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(world.rank)
    with TorchJoin([ddp, opt] if zero else [ddp], **join_kwargs):
        for _ in range(1 + 2 * world.rank):  # rank 0 runs out first
            opt.zero_grad()
            x, y = torch.randn(6, DIM, generator=g), torch.randint(0, 2, (6,), generator=g)
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
    if after:  # a model once joined trains on: every rank, the same number of steps
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(torch.randn(6, DIM, generator=g)),
                                    torch.zeros(6, dtype=torch.long)).backward()
        opt.step()
    return [t.detach().clone() for t in [*module.parameters(), *module.buffers()]]


def generic_join_cases(world):
    out = {}
    for name, kwargs in {"bn": {}, "mlp, after the block": {"model": "mlp", "after": True},
                         "divide by active ranks": {"divide_by_initial_world_size": False},
                         "with ZeroRedundancyOptimizer": {"model": "mlp", "zero": True}}.items():
        ours, theirs = generic_join(world, "microddp", **kwargs), generic_join(world, "torch",
                                                                              **kwargs)
        out[name] = all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    return out


def test_torchs_generic_join_context_manager_works_and_matches_torch():
    for same in mdp.spawn(generic_join_cases, 3, timeout=120):
        assert same == {"bn": True, "mlp, after the block": True, "divide by active ranks": True,
                        "with ZeroRedundancyOptimizer": True}
