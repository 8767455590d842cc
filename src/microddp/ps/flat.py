"""A model whose parameters and gradients live in flat message buffers, as views, one frame per
server shard, each frame an int64 header followed by the shard's float32 values.

The server and its workers exchange whole shards as single messages. With the parameters as
views of a frame's body, that frame *is* the message: a server writes the header in front and
sends the frame as the optimizer's in-place step left it, and a worker receives header and
parameters in one receive, straight into the model; with the gradients as views of a second
frame per shard (one slot longer, for the shard's loss), backward accumulates into the message
a worker sends. One frame per message, because a message costs a round of gloo's bookkeeping
and a thread wake-up on each side whatever its size: a header sent apart doubled them.

With S shards the parameters are cut at parameter boundaries into S runs of about equal size
(a parameter's view must be contiguous, and a header sits between two frames' bodies), so the
model must have at least S parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import MicroDDPError

HEADER_LEN = 5  # int64 fields: kind, sender, version, clock, samples
HEADER_BYTES = 8 * HEADER_LEN


@dataclass
class Frame:
    """One message: `buf` (what goes on the wire) = `head` (int64) then `body` (float32)."""

    buf: torch.Tensor
    head: torch.Tensor
    body: torch.Tensor


def frame(floats: int) -> Frame:
    """A zeroed message buffer with room for the header and `floats` float32 values."""
    buf = torch.zeros(HEADER_BYTES + 4 * floats, dtype=torch.uint8)
    return Frame(buf, buf[:HEADER_BYTES].view(torch.int64), buf[HEADER_BYTES:].view(torch.float32))


def cuts(sizes: list[int], shards: int) -> list[int]:
    """Parameter indices where shards 1..S-1 start: contiguous runs of parameters whose sizes
    are as close as parameter boundaries allow to 1/S of the total each, none empty."""
    if not 1 <= shards <= len(sizes):
        raise MicroDDPError(f"{shards} parameter-server shards need a model of at least "
                            f"{shards} parameters (a shard holds whole parameters), this one "
                            f"has {len(sizes)}; use fewer servers")
    prefix = [0]
    for n in sizes:
        prefix.append(prefix[-1] + n)
    out: list[int] = []
    for k in range(1, shards):
        # after the previous cut, leaving a parameter for each shard still to come
        allowed = range((out[-1] if out else 0) + 1, len(sizes) - (shards - k) + 1)
        out.append(min(allowed, key=lambda j: abs(prefix[j] - prefix[-1] * k / shards)))
    return out


class FlatModel:
    """`model`'s parameters re-pointed at the bodies of `param_frames` (one per shard), their
    gradients at those of `grad_frames` (`extra` slots past each shard's last gradient stay
    free for the caller). With one shard, `params` and `grads` are the two whole bodies."""

    def __init__(self, model: nn.Module, extra: int = 0, shards: int = 1) -> None:
        params = list(model.parameters())
        bad = [p.dtype for p in params if p.dtype != torch.float32 or p.device.type != "cpu"]
        if bad:
            raise MicroDDPError(f"a parameter-server model must be float32 on the CPU (its "
                                f"messages are flat float32 CPU tensors), found {bad[0]}")
        starts = [0, *cuts([p.numel() for p in params], shards), len(params)]
        self.shard_params = [params[a:b] for a, b in zip(starts, starts[1:], strict=False)]
        self.sizes = [sum(p.numel() for p in run) for run in self.shard_params]
        self.numel = sum(self.sizes)
        self.param_frames = [frame(n) for n in self.sizes]
        self.grad_frames = [frame(n + extra) for n in self.sizes]
        with torch.no_grad():
            for run, pf, gf in zip(self.shard_params, self.param_frames, self.grad_frames,
                                   strict=True):
                offset = 0
                for p in run:
                    n = p.numel()
                    pf.body[offset:offset + n].copy_(p.reshape(-1))
                    # .data: the same Parameter objects (an optimizer built on them keeps
                    # them), now backed by the flat buffers
                    p.data = pf.body[offset:offset + n].view_as(p)
                    p.grad = gf.body[offset:offset + n].view_as(p)
                    offset += n
        if shards == 1:
            self.params, self.grads = self.param_frames[0].body, self.grad_frames[0].body

    def zero_grad(self) -> None:
        """Zero every gradient in place: backward then accumulates into the views."""
        for f in self.grad_frames:
            f.body.zero_()
