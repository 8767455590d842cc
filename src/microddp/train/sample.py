"""The GPT job's last line: a few bytes the trained model writes, so a learner sees it learn.

Sampled on rank 0 from model.pt's whole state_dict (whatever the strategy that trained it),
from a fixed prompt with a generator seeded by --seed: the same run prints the same sample.
"""

from __future__ import annotations

import torch

from ..data import TEXT_BLOCK
from ..gpt import GPT, TextData
from .build import gpt_config
from .config import TrainConfig

PROMPT = "def "
SAMPLE_BYTES = 120
TEMPERATURE = 0.8


def sample(cfg: TrainConfig, state: dict[str, torch.Tensor], n: int = SAMPLE_BYTES) -> str:
    """`n` bytes the model with `state` writes after PROMPT, as text (one line, escaped)."""
    model = GPT(gpt_config(cfg, TEXT_BLOCK, 256))
    model.load_state_dict({k: v.cpu() for k, v in state.items()})
    idx = torch.tensor([list(PROMPT.encode())])
    gen = torch.Generator().manual_seed(cfg.seed)
    out = model.generate(idx, n, temperature=TEMPERATURE, generator=gen)
    return TextData.decode(out[0])
