"""`microddp train --model gpt --cp C [--tp T]` (train/strategies/context.py) against one process.

- the dp x cp x tp rank order (TP innermost, DP outermost) and its groups, on paper;
- on real ranks: parameters after 4 SGD steps equal `--nproc 1`'s, and model.pt is the whole
  model (dp x cp x tp 1x2x1 and 1x2x2 here; 2x2x1 slow);
- a checkpoint written by a cp 2 run resumes on the tp 2 mesh (no cp) to the uninterrupted
  run's parameters (the shards name whole-parameter elements);
- bad input: one line, exit 2.

Tolerance: test_mesh3d.py's, 2e-6 (ring attention merges blocks in another order, the CP sum of
gradients adds the chunks' terms in another order).
"""

from __future__ import annotations

import pytest
import torch

import microddp
from microddp.commands import main
from microddp.gpt import GPT, GPTConfig
from microddp.train import loop
from microddp.train.config import TrainConfig
from microddp.train.strategies.context import ContextMesh

SMALL = {"model": "gpt", "hidden": 32, "depth": 2, "heads": 4, "plot": False,
         "batch_size": 16, "max_steps": 4, "lr": 0.1}
TOL = 2e-6


def test_rank_order_tp_innermost_dp_outermost():
    mesh = ContextMesh(dp=2, cp=2, tp=2)
    assert [mesh.coords(r) for r in range(8)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    lines = mesh.lines()
    assert lines["tp"][0] == [0, 1] and lines["cp"][1] == [1, 3] and lines["dp"][3] == [3, 7]
    assert sorted(r for ranks in lines["cp"] for r in ranks) == list(range(8))  # each once
    with pytest.raises(microddp.MicroDDPError, match="outside a mesh"):
        mesh.coords(8)


def _worker(world, out, kw):
    res = loop.train(world, TrainConfig(**{**SMALL, "out": str(out), **kw}))
    return {"params": res.params, "step": res.step}


def _spawn(n, out, **kw):
    return microddp.launch.spawn(_worker, n, args=(str(out), kw), timeout=300)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _spawn(1, tmp_path_factory.mktemp("one"))[0]["params"]


def _worst(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


MESHES = [(2, {"cp": 2}),
          pytest.param(4, {"cp": 2}, marks=pytest.mark.slow),
          (4, {"cp": 2, "tp": 2})]


@pytest.mark.parametrize("n, kw", MESHES, ids=["1x2x1", "2x2x1", "1x2x2"])
def test_cp_trains_to_one_process(tmp_path, reference, n, kw):
    """dp x cp x tp as the ids say (dp = n / (cp * tp))."""
    ranks = _spawn(n, tmp_path, **kw)
    assert [r["step"] for r in ranks] == [4] * n
    torch.manual_seed(0)
    start = GPT(GPTConfig(block_size=32, n_layer=2, n_head=4, d_model=32,
                          tie_embeddings=False)).state_dict()
    assert _worst(reference, start) > 1e-3  # the steps moved the weights
    assert _worst(ranks[0]["params"], reference) <= TOL
    saved = torch.load(tmp_path / "model.pt", weights_only=True)
    assert _worst(saved, reference) <= TOL  # model.pt is the whole model


def test_cp_checkpoint_resumes_on_the_tp_mesh(tmp_path, reference):
    """Two steps at cp 2, a checkpoint, two more at tp 2: one process's four steps."""
    first = _spawn(2, tmp_path, cp=2, max_steps=2)
    assert first[0]["step"] == 2
    assert _worst(first[0]["params"], reference) > 1e-4  # not there yet
    second = _spawn(2, tmp_path, tp=2, resume=True)
    assert second[0]["step"] == 4
    assert _worst(second[0]["params"], reference) <= TOL


def test_bad_cp_is_one_line_and_exit_2(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    cases = [
        (["--model", "gpt", "--nproc", "4", "--cp", "2", "--pp", "2"],
         "pipeline stages with context parallelism are not built"),
        (["--model", "gpt", "--nproc", "3", "--cp", "2"], "must divide --nproc 3"),
        (["--model", "gpt", "--nproc", "6", "--cp", "2", "--tp", "2"], "must divide --nproc 6"),
        (["--model", "gpt", "--nproc", "3", "--cp", "3"], "must split into 2 x cp = 6 equal"),
        (["--nproc", "2", "--cp", "2"], "--cp 2 splits a transformer's sequence"),
        (["--model", "gpt", "--nproc", "2", "--cp", "2", "--strategy", "zero2"],
         "--strategy zero2"),
        (["--model", "gpt", "--nproc", "2", "--cp", "2", "--strategy", "async"],
         "--strategy async"),
        (["--nproc", "2", "--cp", "2", "--elastic"], "--elastic does not take --cp"),
        (["--model", "gpt", "--nproc", "2", "--cp", "0"], "--cp"),
        (["--model", "gpt", "--nproc", "2", "--cp", "2", "--amp", "bf16"], "does not take --amp"),
        (["--model", "gpt", "--nproc", "4", "--cp", "2", "--batch-size", "3"],
         "--batch-size 3 is the global batch"),
    ]
    for args, message in cases:
        assert main(["train", *args]) == 2, args
        out, err = capsys.readouterr()
        lines = err.splitlines()
        assert out == "" and len(lines) == 1, (args, err)
        assert message in lines[0], (args, lines[0])
