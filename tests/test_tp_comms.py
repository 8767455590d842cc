"""What tensor parallelism sends, counted: every layer's stated collectives and bytes equal what
it issues (microddp.tp.counting, as PyTorch's TP tests use CommDebugMode), microddp's
reduce-scatter sends (p-1)/p of the tensor per rank, sequence parallelism keeps less activation
memory, and a sequence it cannot split is refused in one line on every rank."""

from __future__ import annotations

import os

import torch

import microddp as mdp
from microddp.collectives import ring_reduce_scatter, traffic
from microddp.pipeline.activations import ActivationMeter
from microddp.shm.collectives import shared
from microddp.tp import TensorParallelGPT, counting
from tp_helpers import BATCH, SEQ, batches, config, fresh


def _ranks(world):
    p = world.world_size
    cfg = config(vocab_size=250)
    x, y = batches(cfg, 1)[0]
    out = {}
    for sp in (False, True):
        tp = TensorParallelGPT(fresh(cfg), None, sp)
        with counting() as fwd:
            loss = tp.loss(x, y)
        with counting() as bwd:
            loss.backward()
            tp.finish_grads()
        out[sp] = (fwd, bwd, tp.comms(BATCH, SEQ))
        tp.zero_grad()
        tp.seed_dropout(5)  # the same masks as the ring group's step below
        with ActivationMeter(tp.parameters()) as meter:
            tp.loss(x, y).backward()
        out[("memory", sp)] = meter.peak_saved
        tp.finish_grads()
        out[("grads", sp)] = tp.full_grads()
    # The same step on a group that keeps off shared memory: the ring's reduce-scatter and
    # all-gather instead of shared memory's, the same numbers.
    os.environ["MICRODDP_TRANSPORT"] = "gloo"
    ring_group = mdp.comms.new_group(list(range(p)))
    del os.environ["MICRODDP_TRANSPORT"]
    out["paths"] = (shared(None) is not None, shared(ring_group) is not None)
    tp = TensorParallelGPT(fresh(cfg), ring_group, True)
    tp.seed_dropout(5)
    with traffic() as sent:
        tp.loss(x, y).backward()
    tp.finish_grads()
    out["ring"] = (tp.full_grads(), sent.bytes)
    data = torch.arange(p * 4096, dtype=torch.float32)
    mine = torch.empty(4096)
    ring_reduce_scatter(mine, list(data.chunk(p)))  # first call: connections and checks settle
    with traffic() as sent:
        ring_reduce_scatter(mine, list(data.chunk(p)))
    out["reduce_scatter"] = (sent.bytes, data.numel() * 4, mine.clone())
    try:
        TensorParallelGPT(fresh(cfg), None, True).loss(x[:, :5], y[:, :5])
    except mdp.MicroDDPError as e:
        out["refused"] = str(e)
    return out


def test_stated_collectives_equal_issued_and_reduce_scatter_sends_its_share():
    p = 2
    ranks = mdp.spawn(_ranks, p, backend="gloo", timeout=240)
    one = TensorParallelGPT(fresh(config(vocab_size=250)), None, False)
    with ActivationMeter(one.parameters()) as meter:  # TP = 1: the whole model's activations
        one.loss(*batches(one.cfg, 1)[0]).backward()
    for r, out in enumerate(ranks):
        for sp in (False, True):
            fwd, bwd, stated = out[sp]
            assert fwd == stated["forward"], (r, sp, fwd, stated["forward"])
            assert bwd == stated["backward"], (r, sp, bwd, stated["backward"])
            ops = {c.op for c in fwd + bwd}
            # sequence parallelism: reduce-scatter + all-gather instead of the blocks' all-reduces
            assert ops == ({"all_reduce", "all_gather", "reduce_scatter"} if sp else {"all_reduce"})
        # 2 blocks x (attention + MLP) x 1 all-reduce per direction, plus the embedding (fwd),
        # the head's entry (bwd) and the loss's two (fwd)
        assert [c.op for c in out[False][0]].count("all_reduce") == 1 + 4 + 2
        assert [c.op for c in out[False][1]].count("all_reduce") == 4 + 1
        sent, whole, mine = out["reduce_scatter"]
        assert sent == whole * (p - 1) // p, (sent, whole)
        n = mine.numel()
        torch.testing.assert_close(mine, p * torch.arange(r * n, (r + 1) * n, dtype=torch.float32))
        # activation memory: TP splits the attention and MLP insides; SP splits the rest too
        tp_mem, sp_mem = out[("memory", False)], out[("memory", True)]
        assert sp_mem < tp_mem < meter.peak_saved, (sp_mem, tp_mem, meter.peak_saved)
        assert out["paths"] == (True, False)  # shared memory on the world, the ring on the other
        ring_grads, ring_sent = out["ring"]
        assert ring_sent > 0
        for k, g in out[("grads", True)].items():
            torch.testing.assert_close(ring_grads[k], g, atol=1e-6, rtol=1e-5, msg=k)
        assert out["refused"].startswith("sequence parallelism needs the sequence length 5")
