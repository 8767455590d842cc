"""Shared by the tensor-parallel tests: a tiny GPT, its data, and one process's training as the
reference every tensor-parallel run must reproduce."""

from __future__ import annotations

import copy

import torch

from microddp.gpt import GPT, GPTConfig

SEQ, BATCH, STEPS, LR = 12, 4, 3, 0.3
# float32 sums in another order (the group's all-reduces): a few ulps, carried through 3 SGD steps
TOL = {"atol": 2e-5, "rtol": 1e-4}


def config(**kw) -> GPTConfig:
    base = {"vocab_size": 256, "block_size": 16, "n_layer": 2, "n_head": 4, "d_model": 32,
            "dropout": 0.1}
    return GPTConfig(**{**base, **kw})


def batches(cfg: GPTConfig, n: int = STEPS):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=g),
             torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=g)) for _ in range(n)]


def fresh(cfg: GPTConfig) -> GPT:
    torch.manual_seed(0)
    return GPT(cfg)


def train(model, data, seed: int = 7, finish=None):
    """Eval logits of the first batch, then STEPS SGD steps (momentum 0.9) with dropout seeded: the first
    step's gradients by name, every loss, and the parameters at the end (by `named`)."""
    model.eval()
    with torch.no_grad():
        logits = model(data[0][0]).detach().clone()
    model.train()
    model.seed_dropout(seed)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses, first_grads = [], None
    for x, y in data:
        opt.zero_grad()
        loss = model.loss(x, y)
        loss.backward()
        if finish is not None:
            finish()
        losses.append(loss.item())
        if first_grads is None:
            first_grads = model.full_grads() if hasattr(model, "full_grads") else \
                {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    return logits, losses, first_grads


def reference(cfg: GPTConfig, data):
    model = fresh(cfg)
    logits, losses, grads = train(model, data)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if cfg.tie_embeddings:
        grads["head.weight"] = grads["wte.weight"]
    return logits, losses, grads, state


def copy_of(model):
    return copy.deepcopy(model)


def torch_parallel(world, cfg: GPTConfig, data, sequence_parallel: bool):
    """The same GPT split by PyTorch's parallelize_module (ColwiseParallel for q, k, v, fc and
    the head, RowwiseParallel for the projections and the embedding, SequenceParallel for the
    norms), trained as `train` does: eval logits, losses, first gradients, final parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )
    sp = sequence_parallel
    mesh = init_device_mesh("cpu", (world.world_size,))
    model = fresh(cfg)
    between = Shard(1) if sp else Replicate()
    plan = {"wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=between,
                                   use_local_output=not sp),
            "head": ColwiseParallel(input_layouts=between, output_layouts=Replicate())}
    for i in range(cfg.n_layer):
        b = f"blocks.{i}."
        for m in ("attn.q", "attn.k", "attn.v", "mlp.fc"):
            plan[b + m] = ColwiseParallel()
        for m in ("attn.proj", "mlp.proj"):
            plan[b + m] = RowwiseParallel(output_layouts=between, use_local_output=not sp)
        if sp:
            for m in ("ln1", "ln2"):
                plan[b + m] = SequenceParallel()
            for m in ("attn", "mlp"):
                plan[b + m] = PrepareModuleInput(input_layouts=(Shard(1),),
                                                 desired_input_layouts=(Replicate(),))
    if sp:
        plan["ln_f"] = SequenceParallel()
    parallelize_module(model, mesh, plan)

    def whole(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    def finish():
        # torch leaves the sequence-parallel parameters' gradients Partial (sums still to do),
        # as microddp's finish_grads does: each is redistributed to its parameter's placement.
        for p in model.parameters():
            g = p.grad
            if hasattr(g, "placements") and not hasattr(p, "placements"):
                p.grad = g.full_tensor()
            elif hasattr(g, "placements") and g.placements != p.placements:
                p.grad = g.redistribute(p.device_mesh, p.placements)

    model.full_grads = lambda: {n: whole(p.grad).clone() for n, p in model.named_parameters()}
    with implicit_replication():  # the position embedding stays a plain tensor, replicated
        logits, losses, grads = train(model, data, finish=finish)
    state = {k: whole(v).detach().clone() for k, v in model.state_dict().items()}
    return logits, losses, grads, state
