"""Context parallelism: the sequence split over the ranks of a group, attention by ring.

split.py: which chunks of the sequence a rank holds (the causal load balance) and their
positions; ring.py: ring attention, exact attention with key/value blocks passed around the ring,
forward and backward; gpt.py: a GPT whose attention runs as ring attention; overlap.py: how
much of the ring's communication the block computation hides, measured; tensor_parallel.py:
the same GPT split by heads over a tensor-parallel group too.
"""

from .gpt import ContextParallelGPT
from .ring import (
    RingAttention,
    block_attention,
    counting,
    merge,
    pair_kind,
    ring_attention,
)
from .split import check_sequence, chunks_of, positions, shard, unshard
from .tensor_parallel import ContextTensorParallelGPT

__all__ = ["ContextParallelGPT", "ContextTensorParallelGPT", "RingAttention", "block_attention",
           "check_sequence", "chunks_of", "counting", "merge", "pair_kind", "positions",
           "ring_attention", "shard", "unshard"]
