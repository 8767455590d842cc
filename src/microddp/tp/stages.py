"""microddp.gpt.GPT cut into pipeline stages, each stage split over a tensor-parallel group:
the model a rank of a DP x PP x TP mesh holds.

Stage s of P gets a run of consecutive blocks (equal runs, the first stages one more when
n_layer does not divide by P: pipeline.blocks_per_stage's rule); the first stage also holds the
token and position embedding, the last the final norm and the head, whose output is this rank's
vocabulary columns of the logits (the loss, `loss()`, is vocabulary-parallel: the logits are
never gathered). Inside a stage the split is Megatron's (tp/gpt.py's layers): heads, hidden
units and vocabulary rows. One tensor crosses each stage boundary, the (B, S, d_model) residual
stream, whole on every tensor-parallel rank of the stage; so a stage runs under any of
microddp.pipeline's schedules (PipelineStage(stage, s, P, ...)).

Tied embeddings put one parameter on the first and the last stage; with P > 1 that needs a
gradient sum between them that this module does not make, so it is refused (the training job's
GPT is untied). Dropout draws masks from the model's generator in call order, which a pipeline's
micro-batches change: equality with one process holds for dropout 0.

`layout()` names every local parameter as the whole GPT's state_dict does, with the dimension it
is split along: what gathers the whole model and what a checkpoint's pieces are cut from.
"""

from __future__ import annotations

import copy
import re

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import MicroDDPError
from ..gpt.model import GPT, SeededDropout
from .comm import all_gather, enter, rank, size
from .gpt import ParallelBlock, check_split
from .layers import VocabParallelEmbedding, shard
from .loss import vocab_parallel_cross_entropy

# the whole GPT's parameter names split along a dimension (column-parallel: 0, row-parallel: 1)
SPLIT = ((r"^wte\.weight$", 0), (r"^head\.weight$", 0),
         (r"\.attn\.[qkv]\.(weight|bias)$", 0), (r"\.mlp\.fc\.(weight|bias)$", 0),
         (r"\.(attn|mlp)\.proj\.weight$", 1))


def blocks_per_stage(n_layer: int, stages: int) -> list[int]:
    """Blocks of each of `stages` stages: equal, the first ones one more when uneven."""
    if not isinstance(stages, int) or stages < 1:
        raise MicroDDPError(f"a pipeline needs at least 1 stage, got {stages!r}")
    if n_layer < stages:
        raise MicroDDPError(f"cannot cut a GPT of {n_layer} blocks into {stages} stages: every "
                            f"stage needs at least one block; use --pp {n_layer} or less, or "
                            f"--depth {stages} or more")
    base, extra = divmod(n_layer, stages)
    return [base + (1 if s < extra else 0) for s in range(stages)]


def stage_of(name: str, n_layer: int, stages: int) -> int:
    """The stage that holds the whole GPT's parameter `name`."""
    if name.startswith(("wte.", "wpe.")):
        return 0
    if name.startswith(("ln_f.", "head.")):
        return stages - 1
    block = int(name.split(".")[1])
    bounds, start = [], 0
    for n in blocks_per_stage(n_layer, stages):
        bounds.append(start + n)
        start += n
    return next(s for s, stop in enumerate(bounds) if block < stop)


def split_dim(name: str) -> int | None:
    """The dimension the whole GPT's parameter `name` is split along, None if replicated."""
    return next((dim for pattern, dim in SPLIT if re.search(pattern, name)), None)


class TensorParallelStage(nn.Module):
    """Stage `stage` of `stages` of `model`, this rank's tensor-parallel share over `group`."""

    def __init__(self, model: GPT, stage: int, stages: int, group=None) -> None:
        super().__init__()
        cfg = self.cfg = model.cfg
        check_split(cfg, size(group))
        if cfg.tie_embeddings and stages > 1:
            raise MicroDDPError("a GPT with tied embeddings holds one weight on its first and "
                                "last stage; cutting it into stages is not supported: build it "
                                "with tie_embeddings=False")
        counts = blocks_per_stage(cfg.n_layer, stages)
        self.stage, self.stages, self.group = stage, stages, group
        self.first_block = sum(counts[:stage])
        self.is_first, self.is_last = stage == 0, stage == stages - 1
        if self.is_first:
            self.wte = VocabParallelEmbedding(model.wte, group)
            self.wpe = copy.deepcopy(model.wpe)
            self.drop = SeededDropout(cfg.dropout)
        self.blocks = nn.ModuleList(
            ParallelBlock(model.blocks[i], cfg, group, False)
            for i in range(self.first_block, self.first_block + counts[stage]))
        if self.is_last:
            self.ln_f = copy.deepcopy(model.ln_f)
            if cfg.tie_embeddings:  # one stage: the head is the embedding's shard
                self.head_weight = self.wte.weight
            else:
                self.head_weight = nn.Parameter(shard(model.head.weight, 0, group))
            self.vocab_start = rank(group) * self.head_weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (first stage) or the residual stream in; the residual stream out, or this
        rank's vocabulary columns of the logits (last stage)."""
        if self.is_first:
            if x.dim() != 2 or x.shape[1] > self.cfg.block_size:
                raise MicroDDPError(f"GPT input must be (batch, seq) with seq <= block_size "
                                    f"{self.cfg.block_size}, got shape {tuple(x.shape)}")
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.wte(x) + self.wpe(pos))
        for block in self.blocks:
            x = block(x, x.shape[0], x.shape[1])
        if not self.is_last:
            return x
        x = enter(self.ln_f(x), self.group, False)
        return F.linear(x, self.head_weight)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy of the next token, from the last stage's vocabulary-split
        logits (every tensor-parallel rank of the stage gets the same number)."""
        return vocab_parallel_cross_entropy(logits, targets, self.vocab_start,
                                            self.cfg.vocab_size, self.group)

    def layout(self) -> list[tuple[str, nn.Parameter, int | None, int]]:
        """(whole GPT's name, local parameter, split dimension or None, whole length along it)
        for every parameter of this stage (a tied head is listed as head.weight too)."""
        out = []
        for local, p in self.named_parameters(remove_duplicate=False):
            name = "head.weight" if local == "head_weight" else local
            if name.startswith("blocks."):
                _, i, rest = name.split(".", 2)
                name = f"blocks.{self.first_block + int(i)}.{rest}"
            dim = split_dim(name)
            whole = self._whole_length(name, dim)
            out.append((name, p, dim, whole))
        return out

    def _whole_length(self, name: str, dim: int | None) -> int:
        if dim is None:
            return 0
        cfg = self.cfg
        if name in ("wte.weight", "head.weight"):
            return cfg.vocab_size
        return cfg.hidden if ".mlp." in name else cfg.d_model

    @torch.no_grad()
    def full_state(self) -> dict[str, torch.Tensor]:
        """This stage's parameters whole (unpadded), by the whole GPT's names; every rank of the
        tensor-parallel group calls it and gets them all."""
        return {name: gather(p.detach(), dim, whole, self.group)
                for name, p, dim, whole in self.layout()}


def gather(t: torch.Tensor, dim: int | None, whole: int, group) -> torch.Tensor:
    """The whole tensor from every rank's slice along `dim` (a copy when replicated)."""
    p = size(group)
    if dim is None or p == 1:
        return t.narrow(dim, 0, whole).clone() if dim is not None else t.clone()
    parts = [torch.empty_like(t) for _ in range(p)]
    all_gather(parts, t.contiguous(), group)
    return torch.cat(parts, dim).narrow(dim, 0, whole)
