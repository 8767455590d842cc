"""How much of ring attention's communication hides behind its block computation, measured.

Each step of the ring posts the next key/value hop before computing on the block it holds
(ring.py), so the hop runs while the rank computes; what shows in the step is only the wait
that follows, if the hop took longer than the blocks. Two measurements on the same ranks:

- the hops alone: the same number of hops of the same size, each waited at once, nothing to
  hide behind (the ring's communication time);
- a real forward and backward, its waits recorded as spans ("wait kv", "wait dkv" on the
  comm_wait track, microddp.spans): the communication the blocks did not hide.

hidden = 1 - waited / alone. gloo's send/recv give no completion callback (Work::getFuture is
not implemented for them), so the hop's own end cannot be traced directly; its wait can.
"""

from __future__ import annotations

import time

import torch

from .. import spans
from . import split
from .ring import KV_TAG, _pass_on


def hops_alone(kv: torch.Tensor, hops: int, group=None) -> float:
    """Seconds `hops` key/value hops of `kv` around `group` take, each waited at once."""
    t0 = time.perf_counter()
    for _ in range(hops):
        nxt, handles = _pass_on(kv, group, KV_TAG, "alone")
        for h in handles:
            h.wait()
        kv = nxt
    return time.perf_counter() - t0


def ring_hops(n_layer: int, p: int) -> int:
    """Hops of one key/value-sized tensor per forward + backward: per layer, P-1 in the
    forward, P-1 key/value hops and P dK/dV hops in the backward."""
    return n_layer * (3 * p - 2) if p > 1 else 0


def measure(model, x: torch.Tensor, y: torch.Tensor, repeats: int = 3) -> dict[str, float]:
    """A ContextParallelGPT's forward + backward on (x, y), `repeats` times (the median kept):
    the seconds its ring waited, the seconds the same hops take alone, and the share hidden."""
    gpt, group, p = model.model, model.group, model.p
    b, length = x.shape
    length += split.padding(length, p)
    heads, dim = gpt.cfg.n_head, gpt.cfg.d_model // gpt.cfg.n_head
    kv = torch.zeros(2, b, heads, length // p, dim)
    waited, alone = [], []
    for _ in range(repeats):
        with spans.use(spans.Recorder()) as rec:
            model.loss(x, y).backward()
        gpt.zero_grad()
        waited.append(sum(s.end - s.start for s in rec.spans if s.track == "comm_wait"))
        alone.append(hops_alone(kv, ring_hops(gpt.cfg.n_layer, p), group))
    waited_s, alone_s = sorted(waited)[len(waited) // 2], sorted(alone)[len(alone) // 2]
    return {"waited_s": waited_s, "alone_s": alone_s,
            "hidden_pct": 100.0 * max(0.0, 1.0 - waited_s / alone_s) if alone_s > 0 else 0.0}
