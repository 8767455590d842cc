"""torch.compile through microddp's DDP, with communication still overlapping backward.

A compiled module's backward is one autograd node: every gradient comes out of it at once, at
its end, so a reducer that starts a bucket's all-reduce when its gradients are ready starts
them all after the whole backward, with nothing left to hide them behind. torch's DDP avoids
that with dynamo's DDPOptimizer: while a DDP's forward runs its module, dynamo splits the
module's graph at bucket boundaries (DDP's bucket_bytes_cap), so the backward runs as one
compiled piece per bucket and each bucket's gradients are out before the earlier pieces run.
dynamo finds the DDP through `DistributedDataParallel._active_ddp_module`, a class attribute
of torch's DDP that only DDPOptimizer reads, and asks it only for `bucket_bytes_cap`.

microddp's DDP sets the same attribute around its module's call (`as_active`), so both
`DDP(torch.compile(model))` and `torch.compile(DDP(model))` are split the same way; and its
forward is not traced (`not_traced`), as torch's is not, so dynamo compiles the module under
it rather than the DDP's own Python (buffer broadcasts, reducer bookkeeping).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.nn.parallel import DistributedDataParallel as TorchDDP

# dynamo runs a function so marked as plain Python, and still compiles what it calls
not_traced = torch._disable_dynamo(recursive=False)


@contextmanager
@not_traced
def as_active(ddp) -> Iterator[None]:
    """Make `ddp` the DDP whose module dynamo is compiling (for DDPOptimizer), as torch's DDP
    makes itself; the previous one comes back after, for nested DDPs."""
    old = TorchDDP._active_ddp_module
    TorchDDP._active_ddp_module = ddp
    try:
        yield
    finally:
        TorchDDP._active_ddp_module = old
