"""microddp.gpt.GPT split across a tensor-parallel group, as Megatron-LM splits it.

Built from a whole GPT (`TensorParallelGPT(model, group)`), so every rank starts from the same
numbers as one process; each rank keeps its share:
- token embedding and head: vocabulary rows (VocabParallelEmbedding; the head is the same
  shard when tied), the loss vocabulary-parallel (loss.py): the logits are never gathered;
- attention: heads (q, k, v column-parallel, entered once; the output projection
  row-parallel): one all-reduce per direction;
- MLP: hidden units (fc column-parallel, proj row-parallel): one all-reduce per direction;
- norms, position embedding, residual: whole on every rank, or with `sequence_parallel` split
  along the sequence, the all-reduces becoming reduce-scatter + all-gather. Their parameters'
  gradients are then partial sums: `finish_grads()` adds them up over the group in one
  all-reduce (Megatron does the same after backward).
Dropout draws the whole mask from the model's seeded generator and keeps this rank's slice,
so with the same seed it drops what one process drops.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import MicroDDPError
from ..gpt.model import GPT, Block, GPTConfig, SeededDropout, causal_attention
from .comm import (
    Call,
    all_gather,
    all_reduce,
    boundary_calls,
    check_sequence,
    enter,
    rank,
    size,
)
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, shard
from .loss import loss_comms, vocab_parallel_cross_entropy


def check_split(cfg: GPTConfig, p: int) -> None:
    """Refuse, in one line, a split of `cfg` over `p` ranks this model cannot make exactly
    (the vocabulary and the MLP's width are padded instead)."""
    if cfg.n_head % p:
        raise MicroDDPError(f"tensor parallelism splits attention by heads: n_head {cfg.n_head} "
                            f"does not divide by the tensor-parallel size {p}; pick a TP size "
                            f"that divides {cfg.n_head}")


class ParallelAttention(nn.Module):
    """This rank's heads: q, k, v column-parallel (one entry for the three), output row-parallel."""

    def __init__(self, attn, cfg: GPTConfig, group, sequence_parallel: bool) -> None:
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.q, self.k, self.v = (ColumnParallelLinear(m, group, sequence_parallel, enters=False)
                                  for m in (attn.q, attn.k, attn.v))
        self.proj = RowParallelLinear(attn.proj, group, sequence_parallel)
        self.head_dim, self.n_head = cfg.head_dim, cfg.n_head
        self.first_head = rank(group) * (cfg.n_head // size(group))
        self.attn_drop = SeededDropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's heads' share of the attention output, summed over the group by proj."""
        x = enter(x, self.group, self.sequence_parallel)
        y = causal_attention(self.q(x), self.k(x), self.v(x), self.head_dim, self.attn_drop,
                             self.n_head, self.first_head)
        return self.proj(y)

    def comms(self, tokens: int, itemsize: int = 4) -> dict[str, list]:
        """The collectives one forward and one backward issue on `tokens` whole-sequence tokens."""
        if size(self.group) == 1:
            return {"forward": [], "backward": []}
        b = tokens * self.q.in_features * itemsize
        into = {ph: boundary_calls(b, self.sequence_parallel, ph, "enter")
                for ph in ("forward", "backward")}
        out = self.proj.comms(tokens, itemsize)
        # backward runs the projection's gradient before the entry's
        return {"forward": into["forward"] + out["forward"],
                "backward": out["backward"] + into["backward"]}


class ParallelMLP(nn.Module):
    """This rank's hidden units: fc column-parallel, GELU, proj row-parallel."""

    def __init__(self, mlp, group, sequence_parallel: bool) -> None:
        super().__init__()
        self.fc = ColumnParallelLinear(mlp.fc, group, sequence_parallel)
        self.proj = RowParallelLinear(mlp.proj, group, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's hidden units' share of the MLP, summed over the group by proj."""
        return self.proj(torch.nn.functional.gelu(self.fc(x)))

    def comms(self, tokens: int, itemsize: int = 4) -> dict[str, list]:
        """The collectives one forward and one backward issue on `tokens` whole-sequence tokens."""
        a, b = self.fc.comms(tokens, itemsize), self.proj.comms(tokens, itemsize)
        return {"forward": a["forward"] + b["forward"], "backward": b["backward"] + a["backward"]}


class _Positions:
    """Which positions this rank holds, and how to cut a whole-sequence dropout mask to them."""

    def __init__(self, group, sequence_parallel: bool) -> None:
        self.group, self.sequence_parallel = group, sequence_parallel

    def span(self, seq: int) -> slice:
        if not self.sequence_parallel:
            return slice(0, seq)
        check_sequence(seq, self.group)
        n = seq // size(self.group)
        return slice(rank(self.group) * n, (rank(self.group) + 1) * n)

    def drop(self, d: SeededDropout, x: torch.Tensor, b: int, seq: int) -> torch.Tensor:
        return d(x, (b, seq, x.shape[-1]), (slice(None), self.span(seq)))


class ParallelBlock(nn.Module):
    """One pre-norm block with its attention and MLP split over the group."""

    def __init__(self, block: Block, cfg: GPTConfig, group, sequence_parallel: bool) -> None:
        super().__init__()
        self.ln1 = _copy(block.ln1)
        self.attn = ParallelAttention(block.attn, cfg, group, sequence_parallel)
        self.ln2 = _copy(block.ln2)
        self.mlp = ParallelMLP(block.mlp, group, sequence_parallel)
        self.attn_resid_drop = SeededDropout(cfg.dropout)
        self.mlp_resid_drop = SeededDropout(cfg.dropout)
        self.positions = _Positions(group, sequence_parallel)

    def forward(self, x: torch.Tensor, b: int, seq: int) -> torch.Tensor:
        """One block on this rank's residual stream (all positions, or its share with sequence parallelism)."""
        x = x + self.positions.drop(self.attn_resid_drop, self.attn(self.ln1(x)), b, seq)
        return x + self.positions.drop(self.mlp_resid_drop, self.mlp(self.ln2(x)), b, seq)

    def comms(self, tokens: int, itemsize: int = 4) -> dict[str, list]:
        """The collectives one forward and one backward issue on `tokens` whole-sequence tokens."""
        a, m = self.attn.comms(tokens, itemsize), self.mlp.comms(tokens, itemsize)
        return {"forward": a["forward"] + m["forward"], "backward": m["backward"] + a["backward"]}


class TensorParallelGPT(nn.Module):
    """This rank's share of `model` over `group`; `loss(idx, targets)` is the whole model's loss."""

    def __init__(self, model: GPT, group=None, sequence_parallel: bool = False) -> None:
        super().__init__()
        cfg = self.cfg = model.cfg
        check_split(cfg, size(group))
        self.group, self.sequence_parallel = group, sequence_parallel
        self.wte = VocabParallelEmbedding(model.wte, group, sequence_parallel)
        self.wpe = _copy(model.wpe)
        self.drop = SeededDropout(cfg.dropout)
        self.blocks = nn.ModuleList(ParallelBlock(b, cfg, group, sequence_parallel)
                                    for b in model.blocks)
        self.ln_f = _copy(model.ln_f)
        if cfg.tie_embeddings:
            self.head_weight = self.wte.weight
        else:
            self.head_weight = nn.Parameter(shard(model.head.weight, 0, group))
        self.positions = _Positions(group, sequence_parallel)

    @property
    def vocab_start(self) -> int:
        """The first vocabulary id whose logit this rank holds."""
        return rank(self.group) * self.wte.per_rank

    def seed_dropout(self, seed: int) -> None:
        """As GPT.seed_dropout: the same seed gives the same masks as one process."""
        gen = torch.Generator().manual_seed(seed)
        for m in self.modules():
            if isinstance(m, SeededDropout):
                m.generator = gen

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary columns of the logits, (B, S, V_p / p), for every position."""
        b, seq = idx.shape
        if seq > self.cfg.block_size:
            raise MicroDDPError(f"GPT input must be (batch, seq) with seq <= block_size "
                                f"{self.cfg.block_size}, got shape {tuple(idx.shape)}")
        span = self.positions.span(seq)
        pos = torch.arange(seq, device=idx.device)[span]
        x = self.positions.drop(self.drop, self.wte(idx) + self.wpe(pos), b, seq)
        for block in self.blocks:
            x = block(x, b, seq)
        x = self.ln_f(x)
        x = enter(x, self.group, self.sequence_parallel)
        return torch.nn.functional.linear(x, self.head_weight)

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The whole model's mean cross-entropy, from vocabulary-split logits."""
        return vocab_parallel_cross_entropy(self(idx), targets, self.vocab_start,
                                            self.cfg.vocab_size, self.group)

    def sequence_parallel_params(self) -> list[nn.Parameter]:
        """Parameters whose gradient each rank computes from its positions only."""
        if not self.sequence_parallel or size(self.group) == 1:
            return []
        out = [*self.wpe.parameters(), *self.ln_f.parameters()]
        for b in self.blocks:
            out += [*b.ln1.parameters(), *b.ln2.parameters()]
            out += [m.bias for m in (b.attn.proj, b.mlp.proj) if m.bias is not None]
        return out

    def finish_grads(self) -> None:
        """After backward: sum the sequence-parallel parameters' partial gradients (one
        all-reduce of them all, flattened); nothing without sequence parallelism."""
        params = [p for p in self.sequence_parallel_params() if p.grad is not None]
        if not params:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        all_reduce(flat, self.group, "backward")
        for p, g in zip(params, flat.split([p.numel() for p in params]), strict=True):
            p.grad.copy_(g.view_as(p.grad))

    def comms(self, batch: int, seq: int, itemsize: int = 4) -> dict[str, list[Call]]:
        """Every collective one forward and one backward (with finish_grads) issue, in order."""
        tokens = batch * seq
        if size(self.group) == 1:
            return {"forward": [], "backward": []}
        parts = [self.wte.comms(tokens, itemsize)] + [b.comms(tokens, itemsize) for b in self.blocks]
        b = tokens * self.cfg.d_model * itemsize
        parts.append({ph: boundary_calls(b, self.sequence_parallel, ph, "enter")
                      for ph in ("forward", "backward")})
        parts.append(loss_comms(tokens, self.group))
        fwd = [c for part in parts for c in part["forward"]]
        bwd = [c for part in reversed(parts) for c in part["backward"]]
        extra = sum(p.numel() for p in self.sequence_parallel_params()) * itemsize
        if extra:
            bwd.append(Call("all_reduce", extra, "backward"))
        return {"forward": fwd, "backward": bwd}

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole GPT's state_dict (as GPT(cfg).state_dict() names it), gathered from every
        rank's shards and unpadded: what a checkpoint's model.pt holds."""
        return gather_full(self, lambda p: p.detach())

    @torch.no_grad()
    def full_grads(self) -> dict[str, torch.Tensor]:
        """The whole GPT's gradients, by the same names (after finish_grads)."""
        return gather_full(self, lambda p: torch.zeros_like(p) if p.grad is None else p.grad)


def _copy(module: nn.Module) -> nn.Module:
    import copy
    return copy.deepcopy(module)


def _gather(t: torch.Tensor, dim: int, group, whole: int) -> torch.Tensor:
    p = size(group)
    if p == 1:
        return t.clone()
    parts = [torch.empty_like(t) for _ in range(p)]
    all_gather(parts, t.contiguous(), group)
    return torch.cat(parts, dim).narrow(dim, 0, whole)


def gather_full(tp: TensorParallelGPT, pick) -> dict[str, torch.Tensor]:
    """`pick(parameter)` (the parameter, or its gradient) of every parameter, whole."""
    cfg, g = tp.cfg, tp.group
    out = {name: pick(p).clone() for name, p in tp.named_parameters() if name != "head_weight"}
    out["wte.weight"] = _gather(pick(tp.wte.weight), 0, g, cfg.vocab_size)
    out["head.weight"] = (out["wte.weight"] if cfg.tie_embeddings
                          else _gather(pick(tp.head_weight), 0, g, cfg.vocab_size))
    for i, b in enumerate(tp.blocks):
        split = (("attn.q", b.attn.q, cfg.d_model), ("attn.k", b.attn.k, cfg.d_model),
                 ("attn.v", b.attn.v, cfg.d_model), ("mlp.fc", b.mlp.fc, cfg.hidden))
        for path, lin, whole in split:  # column-parallel: output features, weight and bias
            out[f"blocks.{i}.{path}.weight"] = _gather(pick(lin.weight), 0, g, whole)
            if lin.bias is not None:
                out[f"blocks.{i}.{path}.bias"] = _gather(pick(lin.bias), 0, g, whole)
        for path, lin, whole in (("attn.proj", b.attn.proj, cfg.d_model),
                                 ("mlp.proj", b.mlp.proj, cfg.hidden)):  # row-parallel: inputs
            out[f"blocks.{i}.{path}.weight"] = _gather(pick(lin.weight), 1, g, whole)
    return out
