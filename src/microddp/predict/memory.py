"""Model-state memory per rank, by ZeRO stage: what plain data parallelism and ZeRO-1/2/3 keep.

The ZeRO paper's accounting (Rajbhandari et al. 2020, section 3.1 and Fig. 1): with mixed
precision Adam, a parameter costs 2 bytes (fp16 weights) + 2 bytes (fp16 gradients) + K = 12
bytes of optimizer state (an fp32 master copy and two fp32 moments): 16 bytes on every rank
under plain data parallelism. Over N ranks, ZeRO-1 shards the K bytes, ZeRO-2 the gradients
too, ZeRO-3 the parameters too:

    plain DP  (2 + 2 + K) x params
    ZeRO-1    (2 + 2) x params + K x params / N
    ZeRO-2    2 x params + (2 + K) x params / N
    ZeRO-3    (2 + 2 + K) x params / N

Activations, buffers and fragmentation come on top; this is the model state only. For fp32
Adam as microddp's chapter 9 trains it, the split is 4 + 4 + 8 (`FP32_ADAM`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import MicroDDPError

STAGES = {0: "plain DP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}


@dataclass(frozen=True)
class BytesPerParam:
    """Bytes one parameter costs: its value, its gradient, its optimizer state (K)."""

    params: float = 2.0
    grads: float = 2.0
    optimizer_state: float = 12.0
    note: str = "mixed precision Adam: fp16 parameters and gradients, fp32 master copy and moments"


MIXED_ADAM = BytesPerParam()
FP32_ADAM = BytesPerParam(4.0, 4.0, 8.0, "fp32 Adam: parameters, gradients, two moments")


def per_rank(params: float, world: int, stage: int,
             b: BytesPerParam = MIXED_ADAM) -> dict[str, float]:
    """Bytes of parameters, gradients and optimizer state on one of `world` ranks at ZeRO
    `stage` (0: plain data parallelism), and their total."""
    if stage not in STAGES:
        raise MicroDDPError(f"ZeRO stage must be 0 (plain DP), 1, 2 or 3, got {stage!r}")
    if world < 1 or params <= 0:
        raise MicroDDPError(f"parameters and world size must be positive, got {params:g} and "
                            f"{world}")
    shard = {0: (1, 1, 1), 1: (1, 1, world), 2: (1, world, world), 3: (world, world, world)}
    p, g, o = shard[stage]
    out = {"params": params * b.params / p, "grads": params * b.grads / g,
           "optimizer_state": params * b.optimizer_state / o}
    out["total"] = sum(out.values())
    return out


def table(params: float, world: int, b: BytesPerParam = MIXED_ADAM) -> str:
    """Every stage's bytes per rank, in GB (10^9 bytes, as the paper counts)."""
    lines = [f"model state per rank: {params:.3g} parameters on {world} ranks, {b.note} "
             f"({b.params:g} + {b.grads:g} + {b.optimizer_state:g} bytes per parameter)",
             f"{'stage':10}{'params':>10}{'grads':>10}{'optimizer':>11}{'total GB':>10}"]
    for stage, name in STAGES.items():
        m = per_rank(params, world, stage, b)
        lines.append(f"{name:10}{m['params'] / 1e9:>10.2f}{m['grads'] / 1e9:>10.2f}"
                     f"{m['optimizer_state'] / 1e9:>11.2f}{m['total'] / 1e9:>10.1f}")
    return "\n".join(lines)
