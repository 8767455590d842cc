"""Reduced gradients are lent to .grad (views of the bucket) instead of copied out: check that
this saves the copy without changing anything a caller can see.

- steady state: one buffer per bucket, reused every step (no allocation, no copy);
- a gradient the caller keeps from an earlier step never changes afterwards (PyTorch's don't);
- with zero_grad(set_to_none=False), p.grad stays the same tensor from step to step, as in PyTorch;
- buckets of small gradients, where a view per parameter costs more than the copy, are copied.
"""

import torch
from torch import nn

import microddp as mdp

WIDE = 512  # 256K-element weights: buckets worth lending


def steps(world, set_to_none, keep_at, dim=WIDE):
    torch.manual_seed(0)
    ddp = mdp.DDP(mdp.FullMLP(dim, 2))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x, y = torch.randn(8, dim), torch.randint(0, 2, (8,))
    buffers, grad_ids, kept = [], [], None
    for step in range(7):
        opt.zero_grad(set_to_none=set_to_none)
        nn.functional.cross_entropy(ddp(x + world.rank), y).backward()
        if step == keep_at:
            kept = [p.grad for p in ddp.parameters()]
            snapshot = [g.clone() for g in kept]
        opt.step()
        buffers.append(tuple(b.flat.data_ptr() for b in ddp.reducer.buckets))
        grad_ids.append(tuple(id(p.grad) for p in ddp.parameters()))
    intact = kept is None or all(torch.equal(a, b) for a, b in zip(kept, snapshot, strict=True))
    flats = {b.flat.untyped_storage().data_ptr() for b in ddp.reducer.buckets}
    lent = all(p.grad.untyped_storage().data_ptr() in flats for p in ddp.parameters())
    return buffers, grad_ids, intact, lent


def test_one_buffer_is_reused_every_step_and_grads_are_views_of_it():
    for set_to_none in (True, False):
        for buffers, grad_ids, _, lent in mdp.spawn(steps, 2, args=(set_to_none, None), timeout=60):
            # step 0 uses the first-iteration bucket, step 1 the rebuilt one: steady from there
            assert len(set(buffers[1:])) == 1
            assert lent
            if not set_to_none:  # the same .grad tensors throughout, as with PyTorch
                assert len(set(grad_ids[2:])) == 1


def test_buckets_of_small_gradients_are_copied_back_as_pytorch_does():
    for buffers, _, intact, lent in mdp.spawn(steps, 2, args=(True, 3, 32), timeout=60):
        assert not lent and intact
        assert len(set(buffers[1:])) == 1


def test_a_gradient_kept_by_the_caller_is_never_overwritten():
    for buffers, _, intact, _ in mdp.spawn(steps, 2, args=(True, 3), timeout=60):
        assert intact
        assert buffers[4] != buffers[3]  # the bucket moved to fresh memory instead
        assert len(set(buffers[4:])) == 1  # and stays there


def retired_lifetime(world):
    import weakref

    torch.manual_seed(0)
    ddp = mdp.DDP(mdp.FullMLP(WIDE, 2))
    x, y = torch.randn(8, WIDE), torch.randint(0, 2, (8,))
    for _ in range(2):  # past the bucket rebuild
        ddp.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
    # the gradients autograd made in that backward were replaced by views of the bucket ...
    replaced = [weakref.ref(g) for g in ddp.reducer.lender.retired if g is not None]
    alive_in_forward = []
    ddp.module.register_forward_pre_hook(
        lambda *_: alive_in_forward.append(sum(r() is not None for r in replaced)))
    ddp.zero_grad()
    ddp(x)
    # ... and are freed as the next forward starts (as PyTorch's are by zero_grad), so they
    # never add to the memory peak of a forward
    return len(replaced), alive_in_forward


def test_replaced_gradients_are_freed_when_the_next_forward_starts():
    for n_replaced, alive_in_forward in mdp.spawn(retired_lifetime, 2, timeout=60):
        assert n_replaced == 6 and alive_in_forward == [0]  # FullMLP(WIDE, 2): 3 weights, 3 biases
