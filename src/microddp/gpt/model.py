"""A GPT-2-shaped decoder-only transformer, small enough to train on a CPU in a course.

Token + position embedding, `n_layer` pre-norm blocks (LayerNorm, causal multi-head attention,
residual; LayerNorm, MLP, residual), a final LayerNorm and a head to vocabulary logits, tied to
the token embedding or not. Every size is an argument (GPTConfig).

Two choices serve tensor parallelism (tp/), which must reproduce this model's numbers:
- q, k and v are three Linear layers, so a column split of each is a split by heads (the split
  PyTorch's `ColwiseParallel` makes), and attention reads its head count from q's width, so the
  same code runs a rank's share of the heads;
- dropout draws its mask for the whole logical tensor from a generator the model seeds
  (`seed_dropout`), so a rank that holds a slice of a tensor (some heads, some positions) can
  take the same slice of the same mask and drop exactly what one process drops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import MicroDDPError


@dataclass(frozen=True)
class GPTConfig:
    """The sizes of a GPT; `d_ff` defaults to 4 * d_model."""

    vocab_size: int = 256
    block_size: int = 16
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 32
    d_ff: int | None = None
    dropout: float = 0.0
    tie_embeddings: bool = True
    bias: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "d_model"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise MicroDDPError(f"GPTConfig {name} must be a positive whole number, got {value!r}")
        if self.d_model % self.n_head:
            raise MicroDDPError(f"GPTConfig d_model {self.d_model} must divide by n_head "
                                f"{self.n_head} (every head has d_model / n_head channels)")
        if self.d_ff is not None and (not isinstance(self.d_ff, int) or self.d_ff < 1):
            raise MicroDDPError(f"GPTConfig d_ff must be a positive whole number, got {self.d_ff!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise MicroDDPError(f"GPTConfig dropout must be in [0, 1), got {self.dropout!r}")

    @property
    def hidden(self) -> int:
        """The MLP's inner width."""
        return 4 * self.d_model if self.d_ff is None else self.d_ff

    @property
    def head_dim(self) -> int:
        """Channels per head."""
        return self.d_model // self.n_head


class SeededDropout(nn.Module):
    """Dropout whose mask is drawn for the whole logical tensor from the model's generator.

    `full_shape` and `index` let a rank holding a slice of the tensor take its slice of the
    mask: the generator advances exactly as in one process, so every rank drops what one
    process drops. Without a generator (`seed_dropout` never called) it draws from torch's.
    """

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p
        self.generator: torch.Generator | None = None

    def forward(self, x: torch.Tensor, full_shape: tuple[int, ...] | None = None,
                index: tuple | None = None) -> torch.Tensor:
        """x with the mask's slice `index` of a `full_shape` mask dropped (scaled by 1/(1-p))."""
        if not self.training or self.p == 0.0:
            return x
        shape = tuple(x.shape) if full_shape is None else tuple(full_shape)
        keep = torch.rand(shape, generator=self.generator, device="cpu") >= self.p
        if index is not None:
            keep = keep[index]
        return x * keep.to(x.device, x.dtype) / (1.0 - self.p)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int,
                     drop: SeededDropout, n_head_total: int | None = None,
                     first_head: int = 0) -> torch.Tensor:
    """Causal self-attention of (B, S, h * head_dim) q, k, v; h is read from q's width.

    A rank with heads [first_head, first_head + h) of `n_head_total` passes them, so the
    probabilities' dropout takes that slice of the whole (B, n_head_total, S, S) mask.
    """
    b, s, width = q.shape
    h = width // head_dim
    q, k, v = (t.view(b, s, h, head_dim).transpose(1, 2) for t in (q, k, v))
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)
    future = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    total = h if n_head_total is None else n_head_total
    probs = drop(probs, (b, total, s, s), (slice(None), slice(first_head, first_head + h)))
    return (probs @ v).transpose(1, 2).reshape(b, s, h * head_dim)


class Attention(nn.Module):
    """Causal multi-head self-attention: q, k, v projections, attention, output projection."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.q, self.k, self.v = (nn.Linear(d, d, bias=cfg.bias) for _ in range(3))
        self.proj = nn.Linear(d, d, bias=cfg.bias)
        self.head_dim = cfg.head_dim
        self.attn_drop = SeededDropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The attention output for (B, S, d_model) inputs."""
        y = causal_attention(self.q(x), self.k(x), self.v(x), self.head_dim, self.attn_drop)
        return self.proj(y)


class MLP(nn.Module):
    """Linear to the hidden width, GELU, Linear back."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.hidden, bias=cfg.bias)
        self.proj = nn.Linear(cfg.hidden, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP of (..., d_model) inputs."""
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """x + drop(attn(ln1(x))), then x + drop(mlp(ln2(x))): pre-norm, as GPT-2."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)
        self.attn_resid_drop = SeededDropout(cfg.dropout)
        self.mlp_resid_drop = SeededDropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One pre-norm block on the residual stream."""
        x = x + self.attn_resid_drop(self.attn(self.ln1(x)))
        return x + self.mlp_resid_drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """The whole model: `forward(idx)` gives (B, S, vocab) logits; `loss(idx, targets)` the mean
    cross-entropy of the next byte."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.block_size, cfg.d_model)
        self.drop = SeededDropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.wte.weight
        self.apply(_init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):  # GPT-2's scaling of the residual projections
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.n_layer))

    def seed_dropout(self, seed: int) -> None:
        """One generator for every dropout of the model, seeded: the masks become a function of
        the seed and the order of the calls, which a tensor-parallel copy repeats."""
        gen = torch.Generator().manual_seed(seed)
        for m in self.modules():
            if isinstance(m, SeededDropout):
                m.generator = gen

    def check_input(self, idx: torch.Tensor) -> None:
        """Refuse, in one line, an input that is not (batch, seq <= block_size)."""
        if idx.dim() != 2 or idx.shape[1] > self.cfg.block_size:
            raise MicroDDPError(f"GPT input must be (batch, seq) with seq <= block_size "
                                f"{self.cfg.block_size}, got shape {tuple(idx.shape)}")

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """The (B, S, vocab) logits of (B, S) token ids."""
        self.check_input(idx)
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy of the next token."""
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, n: int, temperature: float = 1.0,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """`n` more tokens after `idx`, sampled (temperature 0: the most likely each time)."""
        was = self.training
        self.eval()
        for _ in range(n):
            logits = self(idx[:, -self.cfg.block_size:])[:, -1]
            if temperature == 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                probs = (logits / temperature).softmax(-1)
                nxt = torch.multinomial(probs, 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        self.train(was)
        return idx


def _init(m: nn.Module) -> None:
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, 0.0, 0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.Embedding):
        nn.init.normal_(m.weight, 0.0, 0.02)
