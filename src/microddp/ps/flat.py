"""A model whose parameters and gradients live in one flat float32 buffer each, as views.

The server and its workers exchange whole models as flat tensors. With the parameters as views
of one buffer, that buffer *is* the message: the server sends it as it stands after the
optimizer's in-place step, and a worker receives straight into it; with the gradients as views
of a second buffer (one slot longer, for the shard's loss), backward accumulates into the
message a worker sends. Without them, each update cost a concatenation of every parameter on
the server, a clone per parameter of the averaged gradient, and on each worker a copy of the
received parameters into the model, a concatenation of the gradients and another to append
the loss.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import MicroDDPError


class FlatModel:
    """`model`'s parameters re-pointed at `self.params`, their gradients at `self.grads`
    (`extra` slots past the last gradient stay free for the caller)."""

    def __init__(self, model: nn.Module, extra: int = 0) -> None:
        params = list(model.parameters())
        bad = [p.dtype for p in params if p.dtype != torch.float32 or p.device.type != "cpu"]
        if bad:
            raise MicroDDPError(f"a parameter-server model must be float32 on the CPU (its "
                                f"messages are flat float32 CPU tensors), found {bad[0]}")
        self.numel = sum(p.numel() for p in params)
        self.params = torch.empty(self.numel, dtype=torch.float32)
        self.grads = torch.zeros(self.numel + extra, dtype=torch.float32)
        offset = 0
        with torch.no_grad():
            for p in params:
                n = p.numel()
                self.params[offset:offset + n].copy_(p.reshape(-1))
                # .data: the same Parameter objects (an optimizer built on them keeps them),
                # now backed by the flat buffers
                p.data = self.params[offset:offset + n].view_as(p)
                p.grad = self.grads[offset:offset + n].view_as(p)
                offset += n

    def zero_grad(self) -> None:
        """Zero every gradient in place: backward then accumulates into the views."""
        self.grads.zero_()
