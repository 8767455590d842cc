"""What crosses a stage boundary: one tensor, or a tuple of them, as torch's PipelineStage.

A stage may return one tensor or a tuple (or list) of tensors; the next stage is called with
them as its positional arguments, as torch.distributed.pipelining does. Inside the
interpreter every boundary value is a tuple, so one code path serves both. Each tensor is its
own message (tag `base + i * TENSOR_TAG_STRIDE`, so the one-tensor case keeps the tags it
always had). Gradients travel back for the floating-point tensors only, in order, whatever
their requires_grad: both ends can tell that from the dtype alone, without another message.
A boundary that carries no floating-point tensor still sends one (a one-element zero), so that
every gradient message the schedule names exists and a rank's sends are surely received where
the schedule's handshake says (runtime.py's `done_after`).
"""

from __future__ import annotations

import torch

from ..errors import MicroDDPError

MAX_TENSORS = 16  # tensors one boundary may carry
TENSOR_TAG_STRIDE = 2**24  # tag offset of a message's i-th tensor; runtime's tags stay below


def as_tuple(value, where: str = "a pipeline stage's output") -> tuple[torch.Tensor, ...]:
    """`value` (a tensor, or a tuple or list of tensors) as a tuple of tensors."""
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, (tuple, list)) and value and \
            all(isinstance(t, torch.Tensor) for t in value):
        if len(value) > MAX_TENSORS:
            raise MicroDDPError(f"{where} has {len(value)} tensors; at most {MAX_TENSORS} "
                                "cross one stage boundary")
        return tuple(value)
    kinds = [type(t).__name__ for t in value] if isinstance(value, (tuple, list)) else None
    raise MicroDDPError(f"{where} must be a tensor or a tuple of tensors to cross a stage "
                        f"boundary, not {kinds or type(value).__name__}; return tensors only")


def floats(values: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """The tensors of a boundary that a gradient comes back for."""
    return [t for t in values if t.is_floating_point()]


def grad_like(values: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Empty buffers for the gradient message of boundary value `values`."""
    carried = floats(values)
    if not carried:
        return (values[0].new_zeros(1, dtype=torch.float32),)
    return tuple(torch.empty_like(t) for t in carried)


def input_grads(inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The gradient message of a stage's received inputs after its backward: each
    floating-point input's gradient (zeros for one the loss did not depend on)."""
    carried = floats(inputs)
    if not carried:
        return (inputs[0].new_zeros(1, dtype=torch.float32),)
    return tuple(t.grad if t.grad is not None else torch.zeros_like(t) for t in carried)


def pairs(outputs: tuple[torch.Tensor, ...], grads: tuple | None) -> tuple[list, list | None]:
    """(outputs, gradients) to hand autograd for a stage's backward: the floating-point
    outputs that are part of the graph, with their gradients (None: the outputs are a loss)."""
    if grads is None:
        return [t for t in outputs if t.requires_grad], None
    kept = [(t, g) for t, g in zip(floats(outputs), grads, strict=False) if t.requires_grad]
    return [t for t, _ in kept], [g for _, g in kept]


def mark_inputs(inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Received inputs as leaves of this stage's graph: floating-point ones need a gradient."""
    for t in inputs:
        if t.is_floating_point():
            t.requires_grad_()
    return inputs
