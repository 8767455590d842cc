"""Tensor parallelism (Megatron-LM's intra-layer split) and sequence parallelism.

comm.py: the conjugate communication steps as autograd Functions, and `counting()`, the
ledger of what they issue. layers.py: column- and row-parallel linear layers and the
vocabulary-parallel embedding. loss.py: cross-entropy over vocabulary-split logits. gpt.py:
microddp.gpt.GPT split over a group, with or without sequence parallelism. Every layer takes
its process group, so a mesh can hand each its tensor-parallel sub-group.
"""

from .comm import Call, counting
from .gpt import TensorParallelGPT, check_split
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, padded
from .loss import vocab_parallel_cross_entropy

__all__ = ["Call", "counting", "TensorParallelGPT", "check_split", "ColumnParallelLinear",
           "RowParallelLinear", "VocabParallelEmbedding", "padded", "vocab_parallel_cross_entropy"]
