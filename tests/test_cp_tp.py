"""Context parallelism composed with tensor parallelism (cp/tensor_parallel.py), and with data
parallelism on top: TP 2 x CP 2 (4 ranks) and DP 2 x TP 2 x CP 2 (8 ranks, slow) train a small
GPT to one process's losses and parameters (gathered from the TP shards), 3 SGD steps with
momentum. Rank order: TP innermost, then CP, then DP (rank = 4 d + 2 c + t).
Tolerance: float32 sums in another order (blocks, the ring, TP's all-reduces): atol 2e-5, rtol 1e-4."""

import pytest
import torch

import microddp as mdp
from microddp.cp.tensor_parallel import ContextTensorParallelGPT
from microddp.errors import MicroDDPError
from microddp.gpt import GPT, GPTConfig

TOL = {"atol": 2e-5, "rtol": 1e-4}
STEPS, ROWS, SEQ, LR = 3, 4, 24, 0.3


def _config() -> GPTConfig:
    return GPTConfig(vocab_size=64, block_size=SEQ, n_layer=2, n_head=4, d_model=32)


def _data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 64, (ROWS, SEQ), generator=g),
             torch.randint(0, 64, (ROWS, SEQ), generator=g)) for _ in range(STEPS)]


def _fresh() -> GPT:
    torch.manual_seed(0)
    return GPT(_config())


def _reference():
    model = _fresh()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for x, y in _data():
        opt.zero_grad()
        loss = model.loss(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def _groups(world, dp, tp, cp):
    """Every rank makes every group (new_group is collective); returns this rank's three."""
    mine = {}
    for d in range(dp):
        for c in range(cp):
            ranks = [d * tp * cp + c * tp + t for t in range(tp)]
            g = mdp.comms.new_group(ranks)
            if world.rank in ranks:
                mine["tp"] = g
    for d in range(dp):
        for t in range(tp):
            ranks = [d * tp * cp + c * tp + t for c in range(cp)]
            g = mdp.comms.new_group(ranks)
            if world.rank in ranks:
                mine["cp"] = g
    for c in range(cp):
        for t in range(tp):
            ranks = [d * tp * cp + c * tp + t for d in range(dp)]
            g = mdp.comms.new_group(ranks)
            if world.rank in ranks:
                mine["dp"] = g
    return mine


def _rank(world, dp, tp, cp):
    torch.set_num_threads(1)
    groups = _groups(world, dp, tp, cp)
    d = world.rank // (tp * cp)
    model = ContextTensorParallelGPT(_fresh(), groups["tp"], groups["cp"])
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for x, y in _data():
        rows = slice(d * ROWS // dp, (d + 1) * ROWS // dp)  # this replica's share of the batch
        opt.zero_grad()
        share = model.loss(x[rows], y[rows])
        share.backward()
        model.finish_grads()
        loss = torch.tensor(model.global_loss(share))
        if dp > 1:
            for p in model.parameters():
                mdp.comms.all_reduce(p.grad, "avg", groups["dp"])
            mdp.comms.all_reduce(loss, "avg", groups["dp"])
        opt.step()
        losses.append(loss.item())
    return losses, model.tp.full_state_dict()


def _check(ranks, label):
    want_losses, want_state = _reference()
    for r, (losses, state) in enumerate(ranks):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), **TOL,
                                   msg=f"{label} rank {r}: losses")
        for name, want in want_state.items():
            torch.testing.assert_close(state[name], want, **TOL, msg=f"{label} rank {r}: {name}")


def test_tp2_x_cp2_trains_like_one_process():
    _check(mdp.spawn(_rank, 4, (1, 2, 2), backend="gloo", timeout=300), "TP 2 x CP 2")


@pytest.mark.slow  # 8 ranks on 2 cores: the 2 x 2 x 2 mesh
def test_dp2_x_tp2_x_cp2_trains_like_one_process():
    _check(mdp.spawn(_rank, 8, (2, 2, 2), backend="gloo", timeout=600), "DP 2 x TP 2 x CP 2")


def test_dropout_is_refused_in_one_line():
    with pytest.raises(MicroDDPError, match="dropout 0"):
        ContextTensorParallelGPT(GPT(GPTConfig(dropout=0.1)))
