"""The same split done by PyTorch's own tensor parallelism, for the tests and `bench tp`.

`parallelize(model, mesh, sequence_parallel)` applies to a microddp.gpt.GPT the plan Megatron's
split amounts to in torch.distributed.tensor.parallel: ColwiseParallel for q, k, v, the MLP's
fc and the head, RowwiseParallel for the two output projections and the token embedding,
SequenceParallel for the norms (PrepareModuleInput gathering attention's and the MLP's input).
The head gathers full logits (torch's plain loss then runs on them): the untied model only,
as tied weights and seeded dropout are microddp's. `finish_grads` is torch's step that
microddp's TensorParallelGPT.finish_grads mirrors: torch leaves the gradients of
sequence-parallel parameters Partial (sums still to do), and redistributes them here.
"""

from __future__ import annotations

from torch import nn


def parallelize(model: nn.Module, mesh, sequence_parallel: bool) -> nn.Module:
    """`model` (a GPT, untied) split over the 1-D `mesh`, in place; returns it."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )
    sp = sequence_parallel
    between = Shard(1) if sp else Replicate()  # the residual stream's layout
    plan: dict = {"wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=between,
                                         use_local_output=not sp),
                  "head": ColwiseParallel(input_layouts=between, output_layouts=Replicate())}
    for i in range(len(model.blocks)):
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
    return parallelize_module(model, mesh, plan)


def finish_grads(model: nn.Module) -> None:
    """Every gradient to its parameter's placement (Partial sums done; a plain parameter, the
    position embedding, gets its whole gradient)."""
    for p in model.parameters():
        g = p.grad
        if g is None or not hasattr(g, "placements"):
            continue
        if not hasattr(p, "placements"):
            p.grad = g.full_tensor()
        elif g.placements != p.placements:
            p.grad = g.redistribute(p.device_mesh, p.placements)
