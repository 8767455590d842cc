"""`microddp predict` with a context-parallel axis (predict/context.py, predict/mesh3d.py's cp):
the ring's bytes per rank per step are exactly what cp/ring.py's own ledger (`counting()`)
records for one forward and backward on real ranks; the exposed time follows the link; the
ranking of a world includes cp meshes; bad input is one line."""

from __future__ import annotations

import pytest
import torch

import microddp
from microddp import MicroDDPError
from microddp.commands import main
from microddp.cp.ring import counting
from microddp.cp.tensor_parallel import ContextTensorParallelGPT
from microddp.gpt import GPT, GPTConfig
from microddp.predict import mesh3d
from microddp.predict.context import ring
from microddp.predict.step import HARDWARE
from microddp.train.strategies.context import ContextMesh

SEQ, BATCH = 24, 3


def _ledger(world, cp, tp):
    g = ContextMesh(1, cp, tp).groups(world.rank)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=SEQ, n_layer=2, n_head=4, d_model=32,
                          tie_embeddings=False))
    cptp = ContextTensorParallelGPT(model, g["tp"], g["cp"])
    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 256, (BATCH, SEQ), generator=gen) for _ in range(2))
    with counting() as hops:
        cptp.loss(x, y).backward()
    return [(kind, n, phase) for kind, n, phase in hops]


@pytest.mark.parametrize("cp, tp", [(2, 1), (3, 1), (2, 2)])
def test_cp_bytes_are_the_rings_ledger(cp, tp):
    ranks = microddp.launch.spawn(_ledger, cp * tp, args=(cp, tp), timeout=120)
    shape = mesh3d.GPTShape(32, 2, 4, SEQ, 256, batch=BATCH)
    row = mesh3d.predict_mesh(shape, 1, 1, tp, HARDWARE["cpu-loopback"], cp=cp)
    for hops in ranks:
        assert sum(n for _, n, _ in hops) == row["cp_ring_bytes"] > 0
        kinds = [(k, p) for k, _, p in hops]
        blocks = 2
        assert kinds.count(("kv", "forward")) == blocks * (cp - 1)
        assert kinds.count(("kv", "backward")) == blocks * (cp - 1)
        assert kinds.count(("dkv", "backward")) == blocks * cp
    assert row["world"] == cp * tp and row["cp_grad_bytes"] > 0


def test_exposure_follows_the_link_and_activations_fall():
    fast, slow = HARDWARE["a100-nvlink"], HARDWARE["10gbe"]
    a = ring(4, 8192, 2048, 24, 4, 1, fast.flops, fast)
    b = ring(4, 8192, 2048, 24, 4, 1, fast.flops, slow)
    assert a["bytes"] == b["bytes"] and 0 < a["exposed_s"] < b["exposed_s"]
    # the last dK/dV hop of every block has nothing to hide behind: at least that is exposed
    assert a["exposed_s"] >= 24 * a["hop_s"]
    assert ring(4, 8192, 2048, 24, 1, 1, fast.flops, fast)["bytes"] == 0
    shape = mesh3d.GPTShape(2048, 24, 16, 8192, 256, batch=4)
    one = mesh3d.predict_mesh(shape, 1, 1, 1, fast)
    four = mesh3d.predict_mesh(shape, 1, 1, 1, fast, cp=4)
    assert four["activation_bytes"] == pytest.approx(one["activation_bytes"] / 4)
    assert four["state_bytes"] == one["state_bytes"]


def test_ranking_includes_cp_meshes_and_refuses_bad_ones():
    shape = mesh3d.GPTShape(2048, 24, 16, 8192, 256, batch=16)
    rows = mesh3d.rank(shape, 8, HARDWARE["a100-nvlink"], with_cp=True)
    found = {(r["dp"], r["pp"], r["tp"], r["cp"]) for r in rows}
    assert {(4, 1, 1, 2), (1, 1, 1, 8), (2, 1, 2, 2)} <= found
    assert all(r["dp"] * r["pp"] * r["tp"] * r["cp"] == 8 for r in rows)
    assert not any(r["cp"] > 1 and r["pp"] > 1 for r in rows)
    with pytest.raises(MicroDDPError, match="cp 3 needs pp 1"):
        mesh3d.predict_mesh(shape, 1, 1, 1, HARDWARE["a100-nvlink"], cp=3)  # 8192 % 6


def test_predict_cli_cp(capsys):
    assert main(["predict", "--cp", "2", "--tp", "2", "--dim", "32", "--depth", "2", "--heads",
                 "4", "--seq", "32", "--batch", "16", "--hardware", "cpu-loopback"]) == 0
    out = capsys.readouterr().out
    assert "x cp" in out and "CP ring MiB" in out
    for args, message in ((["--cp", "0"], "--cp must be at least 1"),
                          (["--cp", "2", "--pp", "2", "--depth", "2"], "needs pp 1")):
        assert main(["predict", *args, "--dim", "32", "--heads", "4", "--seq", "32"]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and message in err[0], err
