"""3-D parallelism: the GPT on a dp x pp x tp mesh (comms/mesh3d.py, tp/stages.py,
train/strategies/mesh3d.py) against one process.

- the mesh's rank order (TP innermost, PP outermost) and its sub-groups, on paper;
- the stages chained by hand on a thread mesh (tp 3 with a padded vocabulary, pp 3 with an
  uneven split): loss, every gradient and the logits equal one GPT's;
- `microddp train --model gpt --tp T --pp P` on real ranks: parameters after 4 SGD steps equal
  `--nproc 1`'s (dp x pp x tp 1x2x1, 1x2x2 and 2x2x1 with ZeRO-2 over dp here; 2x1x2, 2x2x1,
  2x1x2 with ZeRO-1, 2x2x2 and 2x2x2 with ZeRO-2 slow), and model.pt is the whole model;
- a checkpoint saved on one mesh resumes on another (pp 2 -> tp 2 here; tp 2 -> tp 1,
  2x2x2 -> 1x2x2 and ZeRO-2 on 2x2x1 -> 2x1x2 slow) to the uninterrupted run's
  parameters;
- bad input: one line, exit 2.

Tolerance: the mesh adds the same terms in another order (TP's all-reduces, micro-batches'
gradients, the DP average). The largest difference measured over 4 steps was 1.2e-7; the bound
is test_train_gpt.py's, 2e-6.
"""

from __future__ import annotations

import pytest
import torch

import microddp
from microddp.commands import main
from microddp.comms.mesh3d import Mesh3D
from microddp.gpt import GPT, GPTConfig
from microddp.tp.stages import TensorParallelStage, blocks_per_stage, gather, stage_of
from microddp.tp.threads import ThreadMesh, run
from microddp.train import loop
from microddp.train.config import TrainConfig

SMALL = {"model": "gpt", "hidden": 32, "depth": 2, "heads": 4, "plot": False,
         "batch_size": 16, "max_steps": 4, "lr": 0.1}
TOL = 2e-6


def test_rank_order_tp_innermost_pp_outermost():
    mesh = Mesh3D(dp=2, pp=2, tp=2)
    assert [mesh.coords(r) for r in range(8)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert all(mesh.rank(*mesh.coords(r)) == r for r in range(8))
    assert mesh.tp_ranks(1, 0) == [4, 5]      # neighbours: one host
    assert mesh.dp_ranks(0, 1) == [1, 3]      # tp apart
    assert mesh.pp_ranks(0, 1) == [1, 5]      # dp * tp apart
    with pytest.raises(microddp.MicroDDPError, match="outside a mesh"):
        mesh.coords(8)
    with pytest.raises(microddp.MicroDDPError, match="tp >= 1"):
        Mesh3D(1, 1, 0)
    g = Mesh3D(1, 1, 1).groups(0)  # a world of one: no groups
    assert (g.stage, g.replica, g.tp_rank, g.tp_group, g.dp_group, g.pp_group) == (0, 0, 0,
                                                                                  None, None, None)


def test_stage_split_covers_every_parameter_once():
    assert blocks_per_stage(4, 3) == [2, 1, 1]  # uneven: the first stages one more
    cfg = GPTConfig(n_layer=4, tie_embeddings=False)
    names = list(GPT(cfg).state_dict())
    got = sorted(n for s in range(3)
                 for n, *_ in TensorParallelStage(GPT(cfg), s, 3).layout())
    assert got == sorted(names)
    assert [stage_of(n, 4, 3) for n in ("wte.weight", "blocks.1.ln1.bias", "blocks.2.mlp.fc.weight",
                                       "blocks.3.attn.q.bias", "head.weight")] == [0, 0, 1, 2, 2]
    with pytest.raises(microddp.MicroDDPError, match="tied embeddings"):
        TensorParallelStage(GPT(GPTConfig(tie_embeddings=True)), 0, 2)
    with pytest.raises(microddp.MicroDDPError, match="at least one block"):
        blocks_per_stage(2, 3)


def test_stages_on_a_thread_mesh_equal_one_gpt():
    """tp 3 (vocabulary 256 padded to 258) x pp 3 (blocks 2, 1, 1), chained by hand."""
    cfg = GPTConfig(vocab_size=256, block_size=8, n_layer=4, n_head=6, d_model=24,
                    tie_embeddings=False)
    torch.manual_seed(0)
    whole = GPT(cfg)
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 256, (3, 8), generator=g) for _ in range(2))
    loss = whole.loss(x, y)
    loss.backward()
    mesh = ThreadMesh(1, 3)

    def rank(r):
        tp_group, _ = mesh.groups(r)
        stages = [TensorParallelStage(whole, s, 3, tp_group) for s in range(3)]
        inputs, outs, h = [], [], x
        for st in stages:  # a pipeline's boundaries: each stage its own graph
            inp = h.detach().requires_grad_() if h.is_floating_point() else h
            inputs.append(inp)
            h = st(inp)
            outs.append(h)
        mine = stages[-1].loss(h, y)
        mine.backward()
        for s in (1, 0):
            outs[s].backward(inputs[s + 1].grad)
        grads = {name: gather(p.grad, dim, full, tp_group)
                 for st in stages for name, p, dim, full in st.layout()}
        return mine.item(), grads

    ranks = run(3, rank)
    for loss_r, grads in ranks:
        assert abs(loss_r - loss.item()) < 1e-6
        for name, p in whole.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, atol=1e-6, rtol=1e-5, msg=name)


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


MESHES = [(2, {"pp": 2}), (4, {"tp": 2, "pp": 2}), (4, {"pp": 2, "strategy": "zero2"}),
          pytest.param(4, {"tp": 2}, marks=pytest.mark.slow),
          pytest.param(4, {"pp": 2}, marks=pytest.mark.slow),
          pytest.param(4, {"tp": 2, "strategy": "zero1"}, marks=pytest.mark.slow),
          pytest.param(8, {"tp": 2, "pp": 2}, marks=pytest.mark.slow),
          pytest.param(8, {"tp": 2, "pp": 2, "strategy": "zero2"}, marks=pytest.mark.slow)]


@pytest.mark.parametrize("n, kw", MESHES, ids=["1x2x1", "1x2x2", "2x2x1-zero2", "2x1x2",
                                               "2x2x1", "2x1x2-zero1", "2x2x2", "2x2x2-zero2"])
def test_mesh_trains_to_one_process(tmp_path, reference, n, kw):
    """dp x pp x tp as the ids say (dp = n / (tp * pp)); zero1/2: ZeRO over the mesh's DP."""
    ranks = _spawn(n, tmp_path, **kw)
    assert [r["step"] for r in ranks] == [4] * n
    torch.manual_seed(0)
    start = GPT(GPTConfig(block_size=32, n_layer=2, n_head=4, d_model=32,
                          tie_embeddings=False)).state_dict()
    assert _worst(reference, start) > 1e-3  # the steps moved the weights
    assert _worst(ranks[0]["params"], reference) <= TOL
    saved = torch.load(tmp_path / "model.pt", weights_only=True)
    assert _worst(saved, reference) <= TOL  # model.pt is the whole model


RESUMES = [((2, {"pp": 2}), (2, {"tp": 2})),
           pytest.param((4, {"tp": 2, "pp": 2}), (2, {"pp": 2}), marks=pytest.mark.slow),
           pytest.param((8, {"tp": 2, "pp": 2}), (4, {"tp": 2, "pp": 2}),
                        marks=pytest.mark.slow),
           pytest.param((4, {"pp": 2, "strategy": "zero2"}), (4, {"tp": 2, "strategy": "zero2"}),
                        marks=pytest.mark.slow)]


@pytest.mark.parametrize("saved, resumed", RESUMES,
                         ids=["1x2x1-to-1x1x2", "1x2x2-to-1x2x1", "2x2x2-to-1x2x2",
                              "2x2x1-zero2-to-2x1x2-zero2"])
def test_checkpoint_resumes_on_another_mesh(tmp_path, reference, saved, resumed):
    """Two steps on one mesh, a checkpoint, two more on another: one process's four steps
    (SGD's momentum travels in the shards too)."""
    (n1, kw1), (n2, kw2) = saved, resumed
    first = _spawn(n1, tmp_path, **kw1, max_steps=2)
    assert first[0]["step"] == 2
    assert _worst(first[0]["params"], reference) > 1e-4  # not there yet
    second = _spawn(n2, tmp_path, **kw2, resume=True)
    assert second[0]["step"] == 4
    assert _worst(second[0]["params"], reference) <= TOL


def test_bad_mesh_is_one_line_and_exit_2(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    cases = [
        (["--nproc", "2", "--tp", "2", "--pp", "2"], "= 4 ranks per replica, more than --nproc 2"),
        (["--nproc", "6", "--tp", "2", "--pp", "2"], "must divide --nproc 6"),
        (["--nproc", "2", "--pp", "2", "--depth", "1"], "--pp 2 stages need at least 2 blocks"),
        (["--nproc", "2", "--pp", "2", "--schedule", "interleaved"],
         "the GPT's pipeline runs gpipe | 1f1b"),
        (["--nproc", "2", "--pp", "2", "--microbatches", "9", "--batch-size", "8"],
         "--microbatches 9 is more than the 8 samples"),
        (["--nproc", "4", "--pp", "2", "--strategy", "zero3"], "ZeRO-3 over the data-parallel"),
        (["--nproc", "4", "--pp", "2", "--strategy", "pp"], "--strategy pp is one pipeline"),
    ]
    for args, message in cases:
        assert main(["train", "--model", "gpt", *args]) == 2, args
        out, err = capsys.readouterr()
        lines = err.splitlines()
        assert out == "" and len(lines) == 1, (args, err)
        assert message in lines[0], (args, lines[0])
