"""Chapter 12: a Linear split two ways, by hand, in one process: which dimension is cut, and
what the pieces need to become the whole output again.

    python course/12_tensor_parallel/shapes.py

y = x W^T with W of shape (out, in). Cut W's rows (column-parallel: each piece computes some
output features from the whole x): the pieces' outputs side by side are y. Cut W's columns
(row-parallel: each piece reads some input features): the pieces' outputs are partial sums,
and y is their sum: the all-reduce. Column then row needs nothing in between: the first
layer's split output is exactly the second layer's split input.
"""

import torch

P = 2
torch.manual_seed(0)
x = torch.randn(4, 8)               # (tokens, d)
w1 = torch.randn(32, 8)             # an MLP's fc: d -> 4d
w2 = torch.randn(8, 32)             # and its proj: 4d -> d
whole = torch.relu(x @ w1.T) @ w2.T

cols = w1.chunk(P, dim=0)           # column-parallel: each rank has 32/P output features
rows = w2.chunk(P, dim=1)           # row-parallel: each rank reads 32/P input features
for r in range(P):
    print(f"rank {r}: fc weight {tuple(cols[r].shape)}, proj weight {tuple(rows[r].shape)}")

hidden = [torch.relu(x @ c.T) for c in cols]            # no communication: x is whole
print(f"column-parallel outputs side by side == whole hidden: "
      f"{torch.allclose(torch.cat(hidden, 1), torch.relu(x @ w1.T))}")
partial = [h @ r.T for h, r in zip(hidden, rows, strict=True)]  # split input, whole width out
print(f"one rank's partial output alone == whole output: {torch.allclose(partial[0], whole)}")
summed = sum(partial)                                   # the all-reduce
print(f"sum of the partial outputs (the all-reduce) == whole output: "
      f"{torch.allclose(summed, whole, atol=1e-5)}")
print(f"bytes all-reduced per MLP: {summed.numel() * 4} (tokens x d x 4), "
      f"never the {hidden[0].numel() * 4 * P} bytes of the hidden activations")
