"""Cross-entropy over vocabulary-split logits, without ever gathering the logits.

Each rank holds logits for its slice of the vocabulary, (tokens, V_p / p). The loss of a token
is log(sum_j exp(z_j)) - z_target; the group gets it from three numbers per token, each summed
(or maxed) over ranks: the largest logit (for a stable exp), the sum of exp, and the target's
logit (which exactly one rank holds). Two all-reduces of (tokens,) floats forward: the max,
then the sum of exp and the target logit fused into one (tokens, 2) tensor; none backward: the
gradient softmax - onehot is local. The gathered alternative moves tokens x V floats.

Padded vocabulary columns (V not dividing by p) are masked to -inf before anything else, so
the loss is exactly the unpadded vocabulary's and their gradient is zero.
"""

from __future__ import annotations

import torch

from .comm import Call, all_reduce, size


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, start, vocab_size, group):
        logits = logits.float()
        width = logits.shape[-1]
        valid = (torch.arange(width, device=logits.device) + start) < vocab_size
        logits = logits.masked_fill(~valid, float("-inf"))
        biggest = logits.max(dim=-1).values
        all_reduce(biggest, group, "forward", op="max")
        shifted = logits - biggest.unsqueeze(-1)
        exp = shifted.exp()
        local = target - start
        mine = (local >= 0) & (local < width)
        picked = shifted.gather(-1, local.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1)
        both = torch.stack([exp.sum(-1), torch.where(mine, picked, 0.0)], dim=-1)
        all_reduce(both, group, "forward")
        sum_exp, target_logit = both.unbind(-1)
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local, mine)
        return (sum_exp.log() - target_logit).mean()

    @staticmethod
    def backward(ctx, grad):
        softmax, local, mine = ctx.saved_tensors
        g = softmax.clone()
        rows = torch.arange(g.shape[0], device=g.device)[mine]
        g[rows, local[mine]] -= 1.0
        return g * (grad / g.shape[0]), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, start: int,
                                 vocab_size: int, group=None) -> torch.Tensor:
    """The mean cross-entropy of (..., V_p / p) logits holding columns [start, start + width) of
    a `vocab_size` vocabulary, against whole-vocabulary `target` ids."""
    flat = logits.reshape(-1, logits.shape[-1])
    return _VocabParallelCrossEntropy.apply(flat, target.reshape(-1), start, vocab_size, group)


def loss_comms(tokens: int, group) -> dict[str, list]:
    """What the loss issues: the max of `tokens` float32, then the (tokens, 2) sums."""
    if size(group) == 1:
        return {"forward": [], "backward": []}
    return {"forward": [Call("all_reduce", tokens * 4, "forward"),
                        Call("all_reduce", tokens * 8, "forward")], "backward": []}
