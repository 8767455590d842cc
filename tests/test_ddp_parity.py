"""Where a drop-in DDP is easy to get subtly wrong: each case runs microddp's and PyTorch's
DistributedDataParallel side by side on 2 ranks and checks the same numbers (or the same
refusal, in clearer words).

- a process group the script formed itself (torchrun style, and mp.spawn style);
- a forward that does not sync (no_grad, no_sync) between a forward and its backward;
- buffers synced by a forward that an earlier forward saved for backward;
- an output left out of the loss, under find_unused_parameters;
- static_graph: a parameter never used, and reentrant activation checkpointing;
- the buffer flags of torch 2.13, init_sync=False, and options microddp refuses.
"""

import gc
import os
import warnings
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import microddp as mdp
from microddp import MicroDDPError


def ddp_class(engine):
    return mdp.DDP if engine == "microddp" else nn.parallel.DistributedDataParallel


def one_step(engine, rank):
    torch.manual_seed(rank)  # each rank starts different: wrapping must copy rank 0's
    ddp = ddp_class(engine)(nn.Linear(4, 2))
    ddp(torch.randn(3, 4) + rank).sum().backward()
    return ddp.module.weight.detach().clone(), ddp.module.weight.grad.clone()


def torchrun_style(rank):
    dist.init_process_group("gloo")  # from the launcher's environment, not microddp's init
    out = {engine: one_step(engine, rank) for engine in ("torch", "microddp")}
    dist.destroy_process_group()
    return out


def mp_spawn_style(rank, path):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):  # nothing but the call's own arguments
        os.environ.pop(name, None)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    out = {engine: one_step(engine, rank) for engine in ("torch", "microddp")}
    world = mdp.comms.get_world()
    dist.destroy_process_group()
    return out, (world.rank, world.world_size, world.backend)


@pytest.mark.parametrize("style", ["torchrun", "mp.spawn"])
def test_a_group_the_script_formed_itself_is_used(style, tmp_path):
    if style == "torchrun":
        results = mdp.spawn(torchrun_style, 2, join=False, timeout=90)
    else:
        ranks = mdp.spawn(mp_spawn_style, 2, args=(str(tmp_path / "rdv"),), join=False,
                          timeout=90)
        assert [seen for _, seen in ranks] == [(0, 2, "gloo"), (1, 2, "gloo")]
        results = [out for out, _ in ranks]
    for out in results:
        assert all(torch.equal(a, b) for a, b in zip(out["torch"], out["microddp"], strict=True))
    # averaged: both ranks hold the same weight and the same gradient
    assert all(torch.equal(a, b) for a, b in zip(results[0]["microddp"], results[1]["microddp"],
                                                strict=True))


class WithBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.bn, self.aux = nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)

    def forward(self, x):
        h = self.bn(self.a(x))
        return h, self.aux(h)


def between(world, engine, case):
    """A forward, then something else, then the first forward's backward."""
    torch.manual_seed(0)
    kwargs = {"find_unused_parameters": True} if case == "unused output" else {}
    ddp = ddp_class(engine)(WithBN(), **kwargs)
    x = torch.randn(6, 4) + world.rank
    if case == "eval batchnorm":
        ddp.eval()  # running statistics are saved for backward, and synced by every forward
    out, aux = ddp(x)
    loss = out.sum() if case == "unused output" else out.sum() + aux.sum()
    if case == "no_grad forward":
        with torch.no_grad():
            ddp(x)
    elif case == "no_sync forward":
        with ddp.no_sync():
            ddp(x)
    elif case == "eval batchnorm":
        loss = loss + ddp(x)[0].sum()  # a second forward: the buffers are synced again
    loss.backward()
    return [None if p.grad is None else p.grad.clone() for p in ddp.module.parameters()]


CASES = ["no_grad forward", "no_sync forward", "eval batchnorm", "unused output"]


def all_between(world):
    return {case: (between(world, "microddp", case), between(world, "torch", case))
            for case in CASES}


@pytest.mark.filterwarnings("ignore")
def test_what_happens_between_forward_and_backward_matches_torch():
    ranks = mdp.spawn(all_between, 2, timeout=120)
    for rank in ranks:
        for case, (ours, theirs) in rank.items():
            assert [g is None for g in ours] == [g is None for g in theirs], case
            assert all(a is None or torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    for case in CASES:  # and averaged: the ranks agree
        assert all(a is None or torch.equal(a, b)
                   for a, b in zip(ranks[0][case][0], ranks[1][case][0], strict=True)), case
    # aux.weight, aux.bias: unused on every rank, so left as None (as torch leaves them)
    assert ranks[0]["unused output"][0][-2:] == [None, None]


class Static(nn.Module):
    """`never` is never used; `a` and `b` run under reentrant activation checkpointing."""

    def __init__(self, checkpointed):
        super().__init__()
        self.a, self.b, self.never = nn.Linear(4, 8), nn.Linear(8, 2), nn.Linear(4, 4)
        self.checkpointed = checkpointed

    def forward(self, x):
        if self.checkpointed:
            h = checkpoint(lambda t: torch.relu(self.a(t)), x, use_reentrant=True)
        else:
            h = torch.relu(self.a(x))
        return self.b(h)


def static_training(world, engine, checkpointed):
    torch.manual_seed(0)
    ddp = ddp_class(engine)(Static(checkpointed), static_graph=True)
    opt = torch.optim.AdamW(ddp.parameters(), lr=0.1, weight_decay=0.1)
    for step in range(4):
        opt.zero_grad()
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(10 * step + world.rank))
        ddp(x.requires_grad_(checkpointed)).pow(2).mean().backward()
        opt.step()
    return [p.detach().clone() for p in ddp.module.parameters()], ddp.module.never.weight.grad


def both_static(world):
    return {checkpointed: (static_training(world, "microddp", checkpointed),
                           static_training(world, "torch", checkpointed))
            for checkpointed in (False, True)}


@pytest.mark.filterwarnings("ignore")
def test_static_graph_learns_unused_parameters_and_checkpointing_as_torch_does():
    for rank in mdp.spawn(both_static, 2, timeout=120):
        for checkpointed, ((ours, our_grad), (theirs, their_grad)) in rank.items():
            assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)), checkpointed
            # never used: no gradient, so AdamW's weight decay leaves it alone in both
            assert our_grad is None and their_grad is None


def buffer_flags(world):
    out = {}
    for name, kwargs in {"default": {}, "forward_sync_buffers=False":
                         {"forward_sync_buffers": False},
                         "broadcast_buffers=False": {"broadcast_buffers": False}}.items():
        model = nn.BatchNorm1d(2)
        model.running_mean.fill_(world.rank)
        ddp = mdp.DDP(model, **kwargs)
        at_start = model.running_mean.clone()
        model.running_mean.fill_(10 + world.rank)
        ddp(torch.zeros(3, 2))  # train mode: the forward syncs first, then updates the stats
        out[name] = (at_start[0].item(), round(model.running_mean[0].item(), 4))
    return out


def test_buffer_flags_follow_torch_2_13():
    ranks = mdp.spawn(buffer_flags, 2, timeout=60)
    # momentum 0.1 over a zero batch: the statistic becomes 0.9 of what the forward started with
    assert [r["default"] for r in ranks] == [(0.0, 9.0), (0.0, 9.0)]
    # forward_sync_buffers=False still copies rank 0's buffers at the start, then never again
    assert [r["forward_sync_buffers=False"] for r in ranks] == [(0.0, 9.0), (0.0, 9.9)]
    # broadcast_buffers=False copies them at neither point
    assert [r["broadcast_buffers=False"] for r in ranks] == [(0.0, 9.0), (1.0, 9.9)]


def no_init_sync(world):
    torch.manual_seed(world.rank)
    model = nn.Linear(2, 2)
    before = model.weight.detach().clone()
    mdp.DDP(model, init_sync=False)
    kept = torch.equal(model.weight, before)
    # A rank-local buffer may have any shape when buffers are not synced: no error.
    model.register_buffer("local", torch.zeros(world.rank + 1))
    mdp.DDP(model, broadcast_buffers=False)
    return kept, model.local.shape[0]


def test_init_sync_false_leaves_each_rank_its_own_weights():
    assert mdp.spawn(no_init_sync, 2, timeout=60) == [(True, 1), (True, 2)]


def mismatch(world, what):
    if what == "strides":
        model = nn.Conv2d(3, 4, 2)
        if world.rank == 1:
            model = model.to(memory_format=torch.channels_last)
    else:  # a comm hook that breaks torch's contract
        model = nn.Linear(2, 2)
    try:
        ddp = mdp.DDP(model)
        ddp.register_comm_hook(None, lambda state, bucket: bucket.buffer())
        ddp(torch.randn(1, 2)).sum().backward()
    except MicroDDPError as e:
        return str(e)
    return "no error"


def test_parameters_in_different_memory_formats_fail_every_rank():
    for message in mdp.spawn(mismatch, 2, args=("strides",), timeout=60):
        assert "parameter 'weight' is not the same everywhere (rank 0: strides (12, 4, 2, 1); " \
               "rank 1: strides (12, 1, 6, 3))" in message and "channels_last" in message


def test_a_comm_hook_that_returns_no_future_is_named():
    for message in mdp.spawn(mismatch, 2, args=("hook",), timeout=60):
        assert message.startswith("callback must return a torch.futures.Future object, "
                                  "but got Tensor: comm hook <lambda> returned Tensor;")


def test_options_microddp_does_not_have_are_refused_by_name():
    mdp.init()
    with pytest.raises(MicroDDPError, match="mixed_precision is an option of torch's DDP"):
        mdp.DDP(nn.Linear(2, 2), mixed_precision=object())
    with pytest.raises(MicroDDPError, match="unexpected argument 'find_unused_parameter'"):
        mdp.DDP(nn.Linear(2, 2), find_unused_parameter=True)
    mdp.DDP(nn.Linear(2, 2), device_mesh=None, batched_grad_copy=False)  # torch's defaults: fine
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ddp = mdp.DDP(nn.Linear(2, 2), broadcast_buffers=False, forward_sync_buffers=True)
    assert ddp.broadcast_buffers is True and "broadcast_buffers is ignored" in str(seen[0].message)


def test_a_model_wrapped_again_lets_the_old_reducer_go():
    mdp.init()
    model = nn.Linear(2, 2)
    old = mdp.DDP(model)
    gone = weakref.ref(old.reducer)
    new = mdp.DDP(model)
    del old
    gc.collect()
    assert gone() is None  # its hooks, which held it, went with it
    assert len(model.weight._post_accumulate_grad_hooks) == 1  # the new reducer's only
    new(torch.ones(1, 2)).sum().backward()
    assert torch.equal(model.bias.grad, torch.ones(2))
