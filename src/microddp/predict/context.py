"""Predict ring attention's traffic on a context-parallel group of `cp` ranks: the bytes a rank
sends per step, and the part of it the block computation does not hide.

What cp/ring.py does per block and micro-batch: a rank holds S/cp tokens of each sequence and,
under tensor parallelism, 1/tp of the heads; its key/value block (K and V stacked, fp32) is
2 x batch x S/cp x d_model/tp x 4 bytes. The forward pass sends it cp - 1 times (posted before
each ring step's compute, so the hop runs behind that compute); the backward pass sends it cp - 1
times again and the running dK/dV, of the same size, cp times (each dK/dV hop is waited on after
the next step's compute; the last one, to the block's owner, has nothing left to hide behind).

Exposure per hop: max(0, hop time - the compute of the ring step it runs behind), a hop's time
latency + bytes / bandwidth on the CP link, and two hops in flight together (a backward step's
K/V and the previous step's dK/dV) sharing it. A ring step's compute is one cp-th of the block's
attention on this rank: 4 x tokens x S x d_model / tp FLOPs forward per rank, twice that
backward (the formula predict/mesh3d.py's 12 S d per token splits, causal skipping ignored).
"""

from __future__ import annotations

from .step import Hardware


def kv_bytes(sequences: float, seq: int, d_model: int, cp: int, tp: int) -> float:
    """One hop's bytes: this rank's K and V (fp32) for `sequences` sequences of `seq` tokens."""
    return 2 * sequences * (seq / cp) * (d_model / tp) * 4


def ring(sequences: float, seq: int, d_model: int, blocks: int, cp: int, tp: int,
         rate: float, link: Hardware) -> dict:
    """One micro-batch of `sequences` sequences through `blocks` blocks, forward and backward:
    bytes this rank sends around the ring, hops, and seconds of it exposed."""
    if cp == 1:
        return {"bytes": 0.0, "hops": 0, "exposed_s": 0.0, "hop_s": 0.0}
    b = kv_bytes(sequences, seq, d_model, cp, tp)
    hops = (cp - 1) + (cp - 1) + cp  # forward K/V, backward K/V, backward dK/dV
    one = link.latency + b / link.bandwidth
    two = link.latency + 2 * b / link.bandwidth
    attention = 4 * sequences * (seq / cp) * seq * d_model / tp / rate  # forward, this rank
    fwd_step, bwd_step = attention / cp, 2 * attention / cp
    forward = (cp - 1) * max(0.0, one - fwd_step)
    backward = (max(0.0, one - bwd_step)  # step 0: its K/V hop alone
                + (cp - 2) * max(0.0, two - bwd_step)  # K/V beside the previous dK/dV
                + max(0.0, one - bwd_step)  # the last step hides the previous dK/dV hop
                + one)  # the last dK/dV hop, to the block's owner: exposed
    return {"bytes": blocks * hops * b, "hops": blocks * hops,
            "exposed_s": blocks * (forward + backward), "hop_s": one}
