"""`microddp bench tp`: bad input is one line and exit 2 before any rank starts; a short run
prints every contender with its ratio to torch's and the memory it measured."""

from __future__ import annotations

import re

import pytest

from microddp import commands as cli

BAD = [
    (["-n", "3"], "n_head 4 does not divide by the tensor-parallel size 3"),
    (["-n", "1"], "needs at least 2 ranks"),
    (["--seq", "63"], "--seq 63 must divide by -n 2"),
    (["--repeats", "0"], "--repeats must be at least 1, got 0"),
    (["--d-model", "30"], "d_model 30 must divide by n_head 4"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_bench_tp_input_is_one_line_and_exit_2(args, message, capsys):
    assert cli.main(["bench", "tp", *args]) == 2
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert out == "" and len(lines) == 1 and lines[0].startswith("microddp bench: error: "), err
    assert message in lines[0]


@pytest.mark.slow
def test_bench_tp_prints_ratios_and_memory(capsys):
    assert cli.main(["bench", "tp", "--d-model", "32", "--seq", "16", "--batch", "2",
                     "--repeats", "3", "--warmup", "1", "--control"]) == 0
    out = capsys.readouterr().out
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^(microddp-sp|microddp|torch-sp|torch-2|torch) .*$",
                                                         out, re.M)}
    assert set(rows) == {"microddp", "torch", "microddp-sp", "torch-sp", "torch-2"}, out
    for name in ("microddp", "microddp-sp", "torch-2"):
        assert re.search(r"\d\.\d{3}x +\d\.\d{3}-\d\.\d{3}", rows[name]), rows[name]
    saved = {n: float(rows[n].split()[-2]) for n in rows}
    assert saved["microddp-sp"] < saved["microddp"], saved  # sequence parallelism saves less
