"""A mesh of 8 and 16 thread ranks (microddp.tp.threads): tensor and sequence parallelism at
sizes two cores cannot run as processes, and their composition with data parallelism, against
one process. TP 8 and TP 16 split a 16-head GPT; DP 2 x TP 4 (TP innermost) trains on a global
batch split over the DP ranks, gradients averaged over each shard's DP group, to one process's
parameters. A rank that never arrives at a collective is an error naming it, not a hang."""

from __future__ import annotations

import pytest
import torch

from microddp import MicroDDPError
from microddp.tp import TensorParallelGPT
from microddp.tp.threads import ThreadGroup, ThreadMesh, _Room, run
from tp_helpers import TOL, batches, config, fresh, reference

CFG = {"n_head": 16, "d_model": 32, "vocab_size": 250, "d_ff": 100}


def _tp_only(n, sp):
    cfg = config(**CFG)
    data = batches(cfg, seq=16)  # 16 positions: sequence parallelism over 8 or 16 ranks
    mesh = ThreadMesh(1, n)
    whole = fresh(cfg)  # made once: torch's global generator is shared by the threads

    def rank(r):
        tp_group, _ = mesh.groups(r)
        model = TensorParallelGPT(whole, tp_group, sp)
        from tp_helpers import train
        logits, losses, grads = train(model, data, finish=model.finish_grads)
        return losses, grads, model.full_state_dict()

    return cfg, data, run(n, rank)


@pytest.mark.parametrize("n,sp", [(8, True), pytest.param(16, False, marks=pytest.mark.slow),
                                  (16, True)])
def test_tp_8_and_16_thread_ranks_equal_one_process(n, sp):
    cfg, data, ranks = _tp_only(n, sp)
    _, r_losses, r_grads, r_state = reference(cfg, data)
    for r, (losses, grads, state) in enumerate(ranks):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(r_losses), **TOL)
        for k in r_state:
            torch.testing.assert_close(grads[k], r_grads[k], **TOL, msg=f"rank {r} grad {k}")
            torch.testing.assert_close(state[k], r_state[k], **TOL, msg=f"rank {r} {k}")


def test_dp2_x_tp4_mesh_trains_to_one_process():
    cfg = config(**CFG, dropout=0.0)  # dropout differs per DP replica's half of the batch
    data = batches(cfg)
    mesh = ThreadMesh(2, 4)
    whole = fresh(cfg)

    def rank(r):
        tp_group, dp_group = mesh.groups(r)
        assert tp_group.ranks == [r // 4 * 4 + i for i in range(4)]  # TP innermost
        model = TensorParallelGPT(whole, tp_group, sequence_parallel=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
        half = slice(dp_group.rank * 2, dp_group.rank * 2 + 2)  # this replica's half
        for x, y in data:
            opt.zero_grad()
            model.loss(x[half], y[half]).backward()
            model.finish_grads()
            for p in model.parameters():  # data parallelism over the other dimension
                dp_group.all_reduce(p.grad)
                p.grad /= dp_group.size
            opt.step()
        return model.full_state_dict()

    states = run(8, rank)
    ref = fresh(cfg)
    opt = torch.optim.SGD(ref.parameters(), lr=0.3, momentum=0.9)
    for x, y in data:
        opt.zero_grad()
        ref.loss(x, y).backward()
        opt.step()
    for r, state in enumerate(states):
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(state[k], v, **TOL, msg=f"rank {r} {k}")


def test_a_rank_that_never_arrives_is_an_error(monkeypatch):
    monkeypatch.setattr("microddp.tp.threads.DEADLINE_S", 0.5)
    room = _Room(2)
    group = ThreadGroup([0, 1], 0, room)
    with pytest.raises(MicroDDPError, match=r"a rank of group \[0, 1\] did not arrive"):
        run(1, lambda r: group.all_reduce(torch.ones(2)))
