"""Finding parameters a forward pass did not use: they will never get a gradient, so waiting
for them would stall their bucket forever."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


def accumulators(params: Sequence[torch.Tensor]) -> list:
    """Each parameter's AccumulateGrad node: the graph node that writes its .grad.

    Holding a reference keeps the node alive, so every forward reuses this same node.
    """
    return [p.view_as(p).grad_fn.next_functions[0][0] for p in params]


def output_tensors(obj) -> Iterable[torch.Tensor]:
    """Every tensor inside a forward's output (tensors, lists, tuples, dicts, dataclasses...)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from output_tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from output_tensors(item)
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            yield from output_tensors(getattr(obj, name))


def find_unused(outputs, accs: Sequence) -> list[int]:
    """Indices of the parameters whose AccumulateGrad node the outputs' graph never reaches."""
    seen: set = set()
    stack = [t.grad_fn for t in output_tensors(outputs) if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return [i for i, acc in enumerate(accs) if acc not in seen]


def no_gradient(names: Sequence[str], params: Sequence[torch.Tensor], missing: list[int],
                rank: int) -> str:
    """The error for parameters that got no gradient without find_unused_parameters."""
    frozen = [names[i] for i in missing if not params[i].requires_grad]
    if frozen:
        return (f"parameter '{frozen[0]}' required a gradient when the model was wrapped, and "
                "no longer does; wrap the model again after changing requires_grad, or pass "
                "find_unused_parameters=True")
    listed = ", ".join(f"'{names[i]}'" for i in missing[:10]) + (" ..." if len(missing) > 10
                                                                 else "")
    return (f"{len(missing)} parameter(s) got no gradient in this backward pass on rank "
            f"{rank}: {listed}. "
            "Pass find_unused_parameters=True to DistributedDataParallel if some parameters "
            "are legitimately unused, or make every forward output contribute to the loss")
