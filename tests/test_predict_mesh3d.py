"""`microddp predict` for a GPT on a dp x pp x tp mesh (predict/mesh3d.py): it counts the
tensor-parallel bytes the layers' own ledger states, puts TP inside a host at the top of the
ranking of 64 ranks, and refuses a mesh the GPT cannot take in one line."""

from __future__ import annotations

import pytest

from microddp import MicroDDPError
from microddp.commands import main
from microddp.gpt import GPT, GPTConfig
from microddp.predict import mesh3d
from microddp.predict.step import HARDWARE
from microddp.tp import TensorParallelGPT
from microddp.tp.threads import ThreadMesh


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_bytes_are_the_layers_ledger(tp):
    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=3, n_head=4, d_model=32,
                    tie_embeddings=False)
    group, _ = ThreadMesh(1, tp).groups(0)  # shards only: no collective runs
    calls = TensorParallelGPT(GPT(cfg), group).comms(batch=16, seq=32)
    stated = sum(c.bytes for phase in calls.values() for c in phase)
    shape = mesh3d.GPTShape(32, 3, 4, 32, 256, batch=16)
    row = mesh3d.predict_mesh(shape, 1, 1, tp, HARDWARE["a100-nvlink"])
    assert row["tp_bytes"] == pytest.approx(2 * (tp - 1) / tp * stated)
    assert row["pp_bytes"] == row["dp_bytes"] == 0


def test_ranking_of_64_ranks_keeps_tp_inside_a_host():
    shape = mesh3d.GPTShape(2048, 24, 16, 1024, 256, batch=512)
    rows = mesh3d.rank(shape, 64, HARDWARE["a100-nvlink"], microbatches=8, per_host=8,
                       inter=HARDWARE["10gbe"])
    assert all(r["dp"] * r["pp"] * r["tp"] == 64 for r in rows)
    assert len({(r["dp"], r["pp"], r["tp"]) for r in rows}) == len(rows) == 22
    assert rows[0]["tp"] <= 8 and rows[-1]["tp"] == 16  # TP across hosts is the worst
    assert [r["step_s"] for r in rows] == sorted(r["step_s"] for r in rows)
    # more stages, same micro-batches: a larger bubble; more TP: less state per rank
    one = {(r["dp"], r["pp"], r["tp"]): r for r in rows}
    assert one[(8, 8, 1)]["bubble"] > one[(8, 2, 4)]["bubble"]
    assert one[(8, 1, 8)]["state_bytes"] < one[(32, 1, 2)]["state_bytes"]
    with pytest.raises(MicroDDPError, match="cannot take the mesh"):
        mesh3d.predict_mesh(shape, 1, 1, 3, HARDWARE["a100-nvlink"])


def test_predict_cli_mesh(capsys):
    assert main(["predict", "--mesh-world", "8", "--dim", "256", "--depth", "4", "--heads",
                 "4", "--seq", "128", "--batch", "64"]) == 0
    out = capsys.readouterr().out
    assert "dp x pp x tp" in out and len([ln for ln in out.splitlines() if " x " in ln]) > 5
    assert main(["predict", "--tp", "3", "--dim", "32", "--heads", "4"]) == 2
    assert "cannot take the mesh dp 1 x pp 1 x tp 3" in capsys.readouterr().err
