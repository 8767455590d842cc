"""`microddp train --model gpt [--tp T]`: the GPT on the standard library's text trains to one
process's parameters under dp, ZeRO and tensor parallelism inside dp; the job reports
validation loss and ends with a sample; bad input is one line and exit 2.

Tolerance: the strategies add the same terms in another order (a rank's slice, a shard's
all-reduce, a vocabulary-split loss), so float32 results differ by rounding: over 4 SGD steps
the largest difference measured was 1.2e-7 (tp 2 and tp 4) and 6e-8 (dp, zero1-3, dp 2 x tp 2);
the bound is 2e-6, the one test_train_strategies.py holds the MLP's strategies to.
"""

import json
import subprocess
import sys

import pytest
import torch

import microddp
from microddp.commands import main
from microddp.train import loop
from microddp.train.config import TrainConfig

SMALL = {"model": "gpt", "hidden": 32, "depth": 2, "heads": 4, "plot": False,
         "batch_size": 16, "max_steps": 4, "lr": 0.1}
TOL = 2e-6


def _worker(world, out, kw):
    res = loop.train(world, TrainConfig(**{**SMALL, "out": str(out), **kw}))
    return {"params": res.params, "step": res.step}


def _spawn(n, out, **kw):
    return microddp.launch.spawn(_worker, n, args=(str(out), kw), timeout=180)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _spawn(1, tmp_path_factory.mktemp("one"))[0]["params"]


def _worst(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("n, kw", [(2, {"tp": 2}), (2, {"tp": 1}), (2, {"strategy": "zero3"}),
                                  pytest.param(4, {"tp": 2}, marks=pytest.mark.slow)],
                         ids=["tp2", "dp2", "zero3", "dp2xtp2"])
def test_gpt_job_matches_one_process(tmp_path, reference, n, kw):
    ranks = _spawn(n, tmp_path, **kw)
    assert [r["step"] for r in ranks] == [4] * n
    # the steps moved the weights (else equality would prove nothing)...
    start = GPT_START()
    assert _worst(reference, start) > 1e-3
    # ...and the mesh landed where one process did
    assert _worst(ranks[0]["params"], reference) <= TOL
    saved = torch.load(tmp_path / "model.pt", weights_only=True)
    assert _worst(saved, reference) <= TOL  # model.pt is the whole model


def GPT_START():
    from microddp.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=32, n_layer=2, n_head=4, d_model=32, tie_embeddings=False)).state_dict()


@pytest.mark.parametrize("args", [["--nproc", "2"], pytest.param(
    ["--nproc", "2", "--tp", "2"], marks=pytest.mark.slow)], ids=["dp", "tp2"])
def test_gpt_job_reports_val_loss_and_a_sample(tmp_path, args):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "microddp", "train", "--model", "gpt", *args, "--hidden", "32",
           "--epochs", "1", "--batch-size", "128", "--optimizer", "adam", "--lr", "0.01", "--no-plot",
           "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "val loss " in done.stdout, done.stdout
    sample = next(line for line in done.stdout.splitlines() if "sample: " in line)
    assert sample.split("sample: ", 1)[1][1:5] == "def ", sample  # the prompt, then the model's
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    epoch, final = [r for r in rows if r["kind"] == "epoch"], rows[-1]
    assert final["kind"] == "final" and final["samples_per_s"] > 0
    # one epoch of Adam takes the byte model well below uniform guessing (ln 256 = 5.55)
    assert final["val_loss"] == epoch[-1]["val_loss"] < 4.0, final


def test_bad_input_is_one_line_and_exit_2(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    cases = [
        (["--tp", "2"], "--tp 2 splits a transformer's attention heads"),
        (["--model", "gpt", "--nproc", "3", "--tp", "2"], "--tp 2 must divide --nproc 3"),
        (["--model", "gpt", "--nproc", "3", "--tp", "3"], "n_head 4 does not divide by the "
                                                          "tensor-parallel size 3"),
        (["--model", "gpt", "--strategy", "async"], "--model gpt trains with --strategy dp"),
        (["--model", "gpt", "--strategy", "zero3", "--tp", "2"], "ZeRO-3 over the data-parallel "
                                                                 "ranks of a mesh is not built"),
        (["--model", "gpt", "--dataset", "synthetic"], "--model gpt reads --dataset text"),
        (["--dataset", "text"], "--dataset text is bytes for a language model"),
        (["--model", "gpt", "--tp", "0"], "--tp must be at least 1"),
    ]
    for args, message in cases:
        assert main(["train", *args]) == 2, args
        out, err = capsys.readouterr()
        lines = err.splitlines()
        assert out == "" and len(lines) == 1, (args, err)
        assert message in lines[0], (args, lines[0])
