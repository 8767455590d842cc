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


def batches(cfg: GPTConfig, n: int = STEPS, seq: int = SEQ):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, cfg.vocab_size, (BATCH, seq), generator=g),
             torch.randint(0, cfg.vocab_size, (BATCH, seq), generator=g)) for _ in range(n)]


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
    """The same GPT split by PyTorch's parallelize_module (microddp.tp.torch_plan), trained as
    `train` does: eval logits, losses, first gradients, final parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import implicit_replication

    from microddp.tp.torch_plan import finish_grads, parallelize

    mesh = init_device_mesh("cpu", (world.world_size,))
    model = parallelize(fresh(cfg), mesh, sequence_parallel)

    def whole(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    model.full_grads = lambda: {n: whole(p.grad).clone() for n, p in model.named_parameters()}
    with implicit_replication():  # the position embedding stays a plain tensor, replicated
        logits, losses, grads = train(model, data, finish=lambda: finish_grads(model))
    state = {k: whole(v).detach().clone() for k, v in model.state_dict().items()}
    return logits, losses, grads, state
