"""Chapter 12: cross-entropy over a vocabulary split across ranks, without gathering the logits,
and a vocabulary that does not divide: padded, masked, the loss exactly the unpadded one.

    python course/12_tensor_parallel/vocab_loss.py        # 2 ranks
    python course/12_tensor_parallel/vocab_loss.py -n 3

Each rank holds logits for its slice of the 1001 ids (padded to the next multiple of the
ranks); the loss needs three numbers per token from the group: the largest logit, the sum of
exp, the target's logit. The script compares the loss and its gradient with
torch.nn.functional.cross_entropy on the whole logits, and counts the bytes.
"""

import argparse

import torch
import torch.nn.functional as F

import microddp as mdp
from microddp.tp import counting, padded, vocab_parallel_cross_entropy

VOCAB, TOKENS = 1001, 64


def whole():
    g = torch.Generator().manual_seed(0)
    return torch.randn(TOKENS, VOCAB, generator=g) * 3, torch.randint(0, VOCAB, (TOKENS,), generator=g)


def rank(world):
    p, r = world.world_size, world.rank
    logits, target = whole()
    width = padded(VOCAB, p) // p
    mine = torch.zeros(TOKENS, width)
    lo, hi = r * width, min((r + 1) * width, VOCAB)
    mine[:, :hi - lo] = logits[:, lo:hi]
    mine.requires_grad_()
    with counting() as calls:
        loss = vocab_parallel_cross_entropy(mine, target, lo, VOCAB)
    loss.backward()
    return loss.item(), mine.grad[:, :hi - lo], lo, hi, sum(c.bytes for c in calls)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=2, help="ranks (default: 2)")
    p = parser.parse_args().n
    logits, target = whole()
    logits.requires_grad_()
    ref = F.cross_entropy(logits, target)
    ref.backward()
    ranks = mdp.spawn(rank, p, backend="gloo")
    print(f"vocabulary {VOCAB} over {p} ranks: {padded(VOCAB, p) // p} columns each, "
          f"{padded(VOCAB, p) - VOCAB} padded")
    print(f"torch cross_entropy on whole logits: {ref.item():.6f}")
    for r, (loss, grad, lo, hi, sent) in enumerate(ranks):
        gdiff = (grad - logits.grad[:, lo:hi]).abs().max().item()
        print(f"rank {r}: ids {lo}..{hi - 1}, vocab-parallel loss {loss:.6f}, "
              f"max |grad diff| {gdiff:.1e}, all-reduced {sent} bytes")
    print(f"gathering the logits instead: {TOKENS * VOCAB * 4 * (p - 1) // p} bytes received per rank")
