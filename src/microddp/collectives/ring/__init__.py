"""The ring: ranks on a circle, each talking only to its two neighbours, so that every rank
sends 2(p-1)/p of the tensor whatever the world size.

Read it in this order: ring.py (the algorithm: reduce-scatter, then all-gather, and
`ring_all_reduce`, which checks, plans and runs one loop), loops.py (the orders in which a
step's messages can go: plain, lookahead, receive-first, preposted, pipelined, pair),
policy.py (which loop runs, by chunk size and world size) and plan.py (the views a call
needs, cut once per tensor, and the whole call kept for a repeat). The metadata check that
may travel with the ring's first message is collectives/agreement/.
"""

from .loops import (
    pair_all_reduce_,
    pipelined_ring_all_reduce_,
    planned_ring_all_reduce_,
    preposted_ring_all_reduce_,
)
from .policy import (
    PAIR_MIN_CHUNK,
    PAIR_SEGMENT,
    PIPELINE_MIN_CHUNK,
    PIPELINE_SEGMENT,
    PIPELINE_WINDOW,
    PREPOST_MAX_CHUNK,
    posting,
    ring_segments,
)
from .ring import (
    all_gather_flat_,
    reduce_scatter_flat_,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
)

__all__ = ["PAIR_MIN_CHUNK", "PAIR_SEGMENT", "PIPELINE_MIN_CHUNK", "PIPELINE_SEGMENT",
           "PIPELINE_WINDOW", "PREPOST_MAX_CHUNK", "all_gather_flat_", "pair_all_reduce_",
           "pipelined_ring_all_reduce_", "planned_ring_all_reduce_", "posting",
           "preposted_ring_all_reduce_", "reduce_scatter_flat_", "ring_all_gather",
           "ring_all_reduce", "ring_reduce_scatter", "ring_segments"]
