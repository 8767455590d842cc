"""Context parallelism composed with tensor parallelism: a GPT split by heads, MLP units and
vocabulary over a tensor-parallel group (tp/gpt.py) and by the sequence over a context-parallel
group, with the same attention running as ring attention over the second.

Every rank of a TP group holds the same two chunks of the sequence (the zigzag of split.py) and
its share of the heads; ring attention passes its heads' keys and values around the CP group,
so a hop carries 1/TP of what plain CP sends. Nothing else changes: the column- and
row-parallel layers, the vocabulary-parallel embedding and loss work token by token, so they
run on a rank's chunks once the position embedding reads the chunks' global positions. The
loss of a rank is its tokens' share of the batch's mean; `finish_grads` sums each parameter
shard's gradient over the CP group (the ranks holding the same shard saw other tokens).

Sequence parallelism (TP's split of norms along the sequence) and dropout are refused: the
sequence is already split by CP, and ring attention merges blocks exactly only without dropout.
A sequence that does not divide by 2 CP is refused too (the vocabulary-parallel loss counts
every target).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import MicroDDPError
from ..gpt import GPT
from ..tp.comm import enter
from ..tp.gpt import TensorParallelGPT
from ..tp.loss import vocab_parallel_cross_entropy
from . import split
from .gpt import sum_grads, summed
from .ring import ring_attention


class ContextTensorParallelGPT(nn.Module):
    """`model` split over `tp_group` (heads, MLP, vocabulary) and `cp_group` (the sequence).
    `loss(idx, targets)` takes the whole (B, S) batch, the same on every rank of both groups,
    and returns this rank's share of its mean loss."""

    def __init__(self, model: GPT, tp_group=None, cp_group=None) -> None:
        super().__init__()
        if model.cfg.dropout:
            raise MicroDDPError(f"context parallelism needs GPTConfig dropout 0, got "
                                f"{model.cfg.dropout}: ring attention merges blocks exactly only "
                                f"without dropout")
        self.tp = TensorParallelGPT(model, tp_group, sequence_parallel=False)
        self.cp_group = cp_group
        self.p, self.rank = split.size(cp_group), split.rank(cp_group)

    def _attention(self, attn, x: torch.Tensor) -> torch.Tensor:
        x = enter(x, attn.group, False)  # identity forward, TP all-reduce backward
        b, s, _ = x.shape
        heads = attn.q.weight.shape[0] // attn.head_dim  # this rank's heads
        q, k, v = (f(x).view(b, s, heads, attn.head_dim).transpose(1, 2)
                   for f in (attn.q, attn.k, attn.v))
        y = ring_attention(q, k, v, self.cp_group, causal=True)
        return attn.proj(y.transpose(1, 2).reshape(b, s, heads * attn.head_dim))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary columns of the logits of its (B, L) tokens (split.shard)."""
        t = self.tp
        length = idx.shape[1] * self.p
        if length > t.cfg.block_size:
            raise MicroDDPError(f"GPT input must be (batch, seq) with seq <= block_size "
                                f"{t.cfg.block_size}, got a sequence of {length}")
        x = t.wte(idx) + t.wpe(split.positions(length, self.rank, self.p, idx.device))
        for block in t.blocks:
            x = x + self._attention(block.attn, block.ln1(x))
            x = x + block.mlp(block.ln2(x))
        x = enter(t.ln_f(x), t.group, False)
        return F.linear(x, t.head_weight)

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """This rank's share of the mean next-token cross-entropy of the whole (B, S) batch:
        its chunks' mean over its tokens, which are 1/CP of them."""
        split.check_sequence(idx.shape[1], self.p)
        logits = self(split.shard(idx, 1, self.cp_group))
        mine = split.shard(targets, 1, self.cp_group)
        t = self.tp
        return vocab_parallel_cross_entropy(logits, mine, t.vocab_start, t.cfg.vocab_size,
                                            t.group) / self.p

    def global_loss(self, share: torch.Tensor) -> float:
        """The whole batch's mean loss, from every CP rank's share (a collective)."""
        return summed(share, self.cp_group)

    def finish_grads(self) -> None:
        """Sum each shard's gradient over the CP group (its ranks saw other tokens)."""
        sum_grads(self.tp.parameters(), self.cp_group)
