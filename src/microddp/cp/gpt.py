"""A GPT trained with context parallelism: every rank holds the whole model and two chunks of
every sequence (split.py); attention runs as ring attention, everything else token by token.

Every layer but attention treats each token alone, so it runs unchanged on a rank's chunks once the
position embedding reads the tokens' global positions. The loss of a rank is its tokens' share of
the whole batch's mean (summed cross-entropy over the global token count), so the gradients of the
ranks sum to one process's: `finish_grads` all-reduces them (sum) over the group, in one flat
buffer. Parameters are replicated, so the same optimizer step on every rank keeps them equal.
The wrapped model's own modules do the work (no copy of its code), so `cp.model.state_dict()`
is the GPT's, the same keys as one process's. A sequence that does not divide by 2P is padded at
its end: the causal mask keeps every real token from seeing a pad, and the pads' targets are
ignored, so the loss and gradients are exactly the unpadded ones.

Dropout is refused: its masks would have to be drawn for the whole sequence and sliced, and the
attention-probability mask cannot be applied to blocks merged by the online softmax exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import comms
from ..errors import MicroDDPError
from ..gpt import GPT
from . import split
from .ring import ring_attention

IGNORE = -100  # F.cross_entropy's ignore_index: the target of a pad, as of any ignored token


class ContextParallelGPT(nn.Module):
    """`model` (a GPT) over the context-parallel `group`; `loss(idx, targets)` takes the whole
    (B, S) batch, the same on every rank, and returns this rank's share of its mean loss."""

    def __init__(self, model: GPT, group=None) -> None:
        super().__init__()
        if model.cfg.dropout:
            raise MicroDDPError(f"context parallelism needs GPTConfig dropout 0, got "
                                f"{model.cfg.dropout}: ring attention merges blocks exactly only "
                                f"without dropout")
        self.model, self.group = model, group
        self.p, self.rank = split.size(group), split.rank(group)

    def _attention(self, block, x: torch.Tensor) -> torch.Tensor:
        attn = block.attn
        b, s, width = x.shape
        heads = width // attn.head_dim
        q, k, v = (f(x).view(b, s, heads, attn.head_dim).transpose(1, 2)
                   for f in (attn.q, attn.k, attn.v))
        y = ring_attention(q, k, v, self.group, causal=True)
        return attn.proj(y.transpose(1, 2).reshape(b, s, width))

    def forward(self, idx: torch.Tensor, length: int | None = None) -> torch.Tensor:
        """The (B, L, vocab) logits of this rank's (B, L) tokens (split.shard of the batch);
        `length`: the real sequence length when the sequence was padded (pads sit past it)."""
        m = self.model
        padded = idx.shape[1] * self.p
        length = padded if length is None else length
        m.check_input(torch.empty(idx.shape[0], length, dtype=torch.long, device="meta"))
        pos = split.positions(padded, self.rank, self.p, idx.device)
        pos = pos.clamp(max=m.cfg.block_size - 1)  # a pad past block_size: seen by no real token
        x = m.wte(idx) + m.wpe(pos)
        for block in m.blocks:
            x = x + self._attention(block, block.ln1(x))
            x = x + block.mlp(block.ln2(x))
        return m.head(m.ln_f(x))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """This rank's share of the mean next-token cross-entropy of the whole (B, S) batch
        (targets of -100 ignored, as in GPT.loss); S need not divide by 2P (padded)."""
        length = idx.shape[1]
        counted = (targets != IGNORE).sum().clamp(min=1)
        pad = split.padding(length, self.p)
        if pad:
            idx = F.pad(idx, (0, pad))
            targets = F.pad(targets, (0, pad), value=IGNORE)
        logits = self(split.shard(idx, 1, self.group), length)
        mine = split.shard(targets, 1, self.group)
        total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), mine.reshape(-1),
                                reduction="sum", ignore_index=IGNORE)
        return total / counted

    def global_loss(self, share: torch.Tensor) -> float:
        """The whole batch's mean loss, from every rank's share (a collective)."""
        return summed(share, self.group)

    def finish_grads(self) -> None:
        """Sum the ranks' gradients (each saw only its tokens), so each holds one process's."""
        sum_grads(self.model.parameters(), self.group)


def summed(share: torch.Tensor, group) -> float:
    """The sum of every CP rank's loss share: the whole batch's mean loss (a collective)."""
    t = share.detach().clone()
    if split.size(group) > 1:
        comms.all_reduce(t, "sum", group)
    return t.item()


def sum_grads(params, group) -> None:
    """Sum each parameter's gradient over the CP group, in one flat all-reduce: its ranks saw
    other tokens of the same sequences."""
    grads = [p.grad for p in params if p.grad is not None]
    if split.size(group) == 1 or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    comms.all_reduce(flat, "sum", group)
    for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(part.view_as(g))
