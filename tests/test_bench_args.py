"""The benchmarks' arguments: bad input is one line and exit 2 before any rank starts, and
what the header promises (steps timed, global batch) is what is measured."""

import pytest

from microddp import commands as cli
from microddp.bench import scaling
from microddp.errors import MicroDDPError

BAD = [
    (["ddp", "--dims", "0", "--repeats", "2", "--warmup", "0"], "--dims must be at least 1, got 0"),
    (["ddp", "--dims", "8", "--depth", "-1"], "--depth must be at least 0, got -1"),
    (["ddp", "--repeats", "0"], "--repeats must be at least 1, got 0"),
    (["ddp", "--warmup", "-1"], "--warmup must be at least 0, got -1"),
    (["ddp", "--batch", "0"], "--batch must be at least 1, got 0"),
    (["ddp", "--dims", "8", "8"], "--dims gives 8 more than once"),
    (["ddp", "--engines", "torch", "torch"], "--engines gives torch more than once"),
    (["ddp", "--engines", "fast"], "unknown engine(s) fast"),
    (["ddp", "--bucket-cap-mb", "0"], "--bucket-cap-mb must be a positive, finite number"),
    (["ddp", "--bucket-cap-mb", "nan"], "--bucket-cap-mb must be a positive, finite number"),
    (["ddp", "-n", "1"], "needs at least 2 ranks"),
    (["allreduce", "--timeout", "nan"], "--timeout must be a positive, finite number, got nan"),
    (["allreduce", "--timeout", "0"], "--timeout must be a positive, finite number, got 0"),
    (["allreduce", "--warmup", "-1"], "--warmup must be 0 or more"),
    (["allreduce", "--repeats", "0"], "--repeats and --min-repeats must be at least 1"),
    (["allreduce", "--sizes", "3"], "not a whole number of float32 elements"),
    (["scaling", "--engines", "bogus"], "unknown engine(s) bogus"),
    (["scaling", "--modes", "weak", "--batch", "0"], "--batch must be at least 1, got 0"),
    (["scaling", "--dim", "0"], "--dim must be at least 1, got 0"),
    (["scaling", "--depth", "-2"], "--depth must be at least 0, got -2"),
    (["scaling", "--ranks", "1", "0"], "--ranks must be at least 1, got 0"),
    (["scaling", "--warmup", "-1"], "--warmup must be at least 0, got -1"),
    (["scaling", "--repeats", "2", "--rounds", "3"],
     "--repeats 2 cannot give each of --rounds 3 a timed step"),
    (["scaling", "--ranks", "2", "4"], "include 1 in --ranks"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_bench_input_is_one_line_and_exit_2(args, message, capsys):
    assert cli.main(["bench", *args]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("microddp bench: error: "), err
    assert message in lines[0]


def test_bench_out_must_be_a_folder(tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for bench in ("allreduce", "scaling"):
        assert cli.main(["bench", bench, "--out", str(a_file)]) == 2
        assert capsys.readouterr().err.strip().endswith("is a file, not a folder; give a folder "
                                                        "path")


def test_scaling_times_exactly_repeats_steps_spread_over_the_rounds(monkeypatch):
    assert scaling.round_repeats(20, 3) == [7, 7, 6]  # 20, not 3 x 6 = 18
    assert scaling.round_repeats(3, 3) == [1, 1, 1]
    assert scaling.round_repeats(5, 1) == [5]
    timed: dict[tuple[int, int], int] = {}

    def fake_measure(n, per_rank, engines, dim, depth, repeats, warmup):
        timed[(n, per_rank)] = timed.get((n, per_rank), 0) + repeats
        return {}

    monkeypatch.setattr(scaling, "measure", fake_measure)
    monkeypatch.setattr(scaling, "summarize", lambda *a: [])
    scaling.sweep(["strong", "weak"], [1, 2], ["torch"], 8, 1, 64, 20, 0, 3)
    assert timed == {(1, 64): 20, (2, 32): 20, (2, 64): 20}
    with pytest.raises(MicroDDPError, match="at least as many repeats as rounds"):
        scaling.round_repeats(2, 3)


def test_strong_scaling_says_where_the_global_batch_shrinks():
    notes = scaling.strong_batch_notes(["strong", "weak"], [1, 2, 3, 4], 63)
    assert len(notes) == 1
    assert "global batch of 63 only where it splits evenly" in notes[0]
    assert "2 ranks 62 (31 each), 4 ranks 60 (15 each)" in notes[0]
    assert "3 ranks" not in notes[0]  # 63 = 3 x 21: nothing left out
    assert scaling.strong_batch_notes(["strong"], [1, 2, 4], 64) == []
    assert scaling.strong_batch_notes(["weak"], [1, 2, 4], 63) == []


def test_scaling_prints_the_shrunk_batch_and_the_steps_it_times(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no --out: a new folder under runs/
    assert cli.main(["bench", "scaling", "--ranks", "1", "2", "--modes", "strong", "--batch", "5",
                     "--dim", "8", "--depth", "1", "--repeats", "2", "--rounds", "2",
                     "--warmup", "0", "--engines", "torch"]) == 0
    out = capsys.readouterr().out.splitlines()
    [run] = (tmp_path / "runs").iterdir()
    assert run.name.startswith("bench-scaling-2")
    assert out[-1] == f"wrote {run.relative_to(tmp_path) / 'scaling.csv'}, " \
                      f"{run.relative_to(tmp_path) / 'scaling.png'}"
    assert {p.name for p in run.iterdir()} == {"scaling.csv", "scaling.png"}  # no temporaries
    assert "2 interleaved steps per engine in 2 rounds" in out[0]
    assert out[1].startswith("note: strong scaling keeps the global batch of 5 only where it "
                             "splits evenly; elsewhere a step trains fewer samples: 2 ranks 4 "
                             "(2 each)")
    rows = (run / "scaling.csv").read_text().splitlines()
    assert [r.split(",")[:4] for r in rows[1:]] == [["strong", "1", "1 process", "5"],
                                                     ["strong", "2", "torch", "2"]]


def test_an_interrupted_benchmark_leaves_no_empty_folder(tmp_path, monkeypatch):
    from microddp.bench import allreduce

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(allreduce, "spawn", interrupted)
    assert cli.main(["bench", "allreduce", "--sizes", "4K"]) == 130
    assert list((tmp_path / "runs").iterdir()) == []
