"""A small decoder-only transformer and the text it learns from, both without a download.

model.py is the transformer (GPT-2's shape: token + position embedding, pre-norm blocks of
causal multi-head attention and an MLP, final norm, tied or untied head), written so that
tp/ can cut every layer along the dimension Megatron-LM cuts it and get the same numbers.
text.py is the data: the bytes of Python's own standard-library source, cached once.
"""

from .model import GPT, MLP, Attention, Block, GPTConfig, SeededDropout, causal_attention
from .text import TextData, stdlib_text

__all__ = ["GPT", "GPTConfig", "Attention", "Block", "MLP", "SeededDropout", "causal_attention",
           "TextData", "stdlib_text"]
