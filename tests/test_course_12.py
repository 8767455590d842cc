"""Chapter 12's scripts run as a learner runs them and print what the chapter promises: a
Linear's column split concatenates and its row split sums to the whole; the vocabulary-parallel
loss equals torch's cross_entropy on a vocabulary that does not divide; the TP and TP+SP GPT
train to one process's losses and parameters, with the collectives the chapter lists and less
activation memory per rank."""

import re
from pathlib import Path

import pytest

from script_runner import output

CHAPTER = Path(__file__).resolve().parents[1] / "course" / "12_tensor_parallel"


def test_the_two_splits_of_a_linear():
    out = output(CHAPTER / "shapes.py")
    assert "column-parallel outputs side by side == whole hidden: True" in out
    assert "one rank's partial output alone == whole output: False" in out
    assert "sum of the partial outputs (the all-reduce) == whole output: True" in out


def test_vocab_parallel_loss_equals_torchs_with_padding():
    out = output(CHAPTER / "vocab_loss.py", "-n", "3")
    assert "334 columns each, 1 padded" in out
    ref = float(re.search(r"whole logits: (\S+)", out).group(1))
    rows = re.findall(r"vocab-parallel loss (\S+), max \|grad diff\| (\S+), all-reduced (\d+) bytes", out)
    assert len(rows) == 3
    for loss, gdiff, sent in rows:
        assert float(loss) == pytest.approx(ref, abs=1e-5) and float(gdiff) < 1e-6
        assert int(sent) == 64 * 4 + 64 * 8  # the max, then the (tokens, 2) sums


@pytest.mark.slow  # the same proof as tests/test_tp_equality.py (default set), as the chapter prints it
def test_tp_and_sp_train_like_one_process_with_less_memory():
    out = output(CHAPTER / "tensor_parallel.py")
    ref = re.search(r"one process: losses ([\d. ]+), activations saved (\d+) KiB", out)
    rows = re.findall(r"(TP 2(?: \+ SP)?) *: losses ([\d. ]+), max \|loss diff\| (\S+), "
                      r"max \|param diff\| after 3 steps (\S+)", out)
    assert [r[0] for r in rows] == ["TP 2", "TP 2 + SP"]
    for _, losses, ldiff, pdiff in rows:
        assert losses.split() == ref.group(1).split()
        assert float(ldiff) < 1e-5 and float(pdiff) < 1e-5
    assert "forward sends:  7 all_reduce" in out and "backward sends: 5 all_reduce" in out
    assert "forward sends:  5 reduce_scatter (40 KiB), 5 all_gather (40 KiB), 2 all_reduce" in out
    memory = [int(m) for m in re.findall(r"activations saved per rank (\d+) KiB", out)]
    assert memory[1] < memory[0] < int(ref.group(2))


@pytest.mark.slow  # timing runs; test_tp_comms counts the ring's share in the default set
def test_reduce_scatter_three_ways_and_the_rings_share():
    out = output(CHAPTER / "reduce_scatter.py", "--mib", "0.25", "--rounds", "3")
    for name in ("shm", "ring", "gloo", "gloo-2"):
        assert re.search(rf"^{name} +\d+\.\d\d ms +\d+\.\d{{3}}x gloo", out, re.M), name
    assert "the ring sent 131072 bytes per rank: 0.500 of the tensor" in out
