"""`microddp trace`: a traced run end to end, summarising a trace file, errors in one line."""

import json
import re

from microddp import commands as cli
from microddp.trace import Span
from microddp.trace import report as trace_report
from microddp.trace import steps as trace_cli


def test_summarise_existing_trace(tmp_path, capsys):
    by_rank = {r: [Span("forward", 10 * s + r, 10 * s + 4, step=s),
                   Span("backward", 10 * s + 4, 10 * s + 8, step=s),
                   Span("allreduce bucket 0", 10 * s + 6, 10 * s + 9, "comm", s)]
               for r in (0, 1) for s in (0,)}
    by_rank[0] += [Span("forward", 20, 27, step=1), Span("allreduce bucket 0", 25, 28, "comm", 1)]
    (tmp_path / "trace.json").write_text(json.dumps(trace_report.chrome_trace(by_rank)))
    assert cli.main(["trace", str(tmp_path / "trace.json")]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)%$", out, re.M)
    # step 0: rank 0 computes 0..8, rank 1 1..8, comm 6..9 on both: hidden 2 s, exposed 1 s
    assert rows[0] == ("0", "8500.00", "7500.00", "3000.00", "1000.00", "67")
    assert rows[1] == ("1", "8000.00", "7000.00", "3000.00", "1000.00", "67")
    assert "2 rank(s); timeline redrawn" in out and (tmp_path / "timeline.png").is_file()


def test_traced_run_end_to_end(tmp_path, capsys):
    code = cli.main(["trace", "-n", "2", "--steps", "3", "--dim", "64", "--depth", "2",
                     "--batch", "8", "--out", str(tmp_path)])
    assert code == 0
    out = capsys.readouterr().out
    assert re.findall(r"^\s+(\d+)\s+[\d.]+", out, re.M) == ["0", "1", "2"]
    assert "overlap" in out and (tmp_path / "trace.json").is_file()
    # the run drew its timeline once, and says so once: not "redrawn" as for an old trace
    assert "redrawn" not in out
    assert out.rstrip().endswith(f"wrote {tmp_path / 'trace.json'}, {tmp_path / 'timeline.png'}"
                                 f", {tmp_path / 'metrics.jsonl'} (open trace.json in "
                                 "https://ui.perfetto.dev)")
    assert (tmp_path / "timeline.png").is_file()
    doc = json.loads((tmp_path / "trace.json").read_text())
    assert {e["pid"] for e in doc["traceEvents"]} == {0, 1}


def test_errors_are_one_line(tmp_path, capsys):
    assert cli.main(["trace", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("microddp trace: error: no trace at") and err.count("\n") == 1
    assert cli.main(["trace", "--steps", "0"]) == 2
    assert "--steps must be at least 1, got 0" in capsys.readouterr().err
    assert cli.main(["trace", "-n", "1", "--engine", "torch"]) == 2
    assert "needs at least 2 ranks" in capsys.readouterr().err


def test_overhead_names_its_rows(capsys):
    assert cli.main(["trace", "--overhead", "-n", "1", "--steps", "3", "--dim", "16",
                     "--depth", "1", "--batch", "4"]) == 0
    out = capsys.readouterr().out
    assert [m for m in re.findall(r"^  (\w+)\s+[\d.]+ ms vs plain", out, re.M)] == [
        "traced", "monitored", "control"]
    assert out.rstrip().endswith("control = plain timed again (A/A): a gap no larger than "
                                 "control's is noise")


def test_each_run_gets_a_new_dated_folder_and_an_interrupted_one_leaves_none(tmp_path, capsys,
                                                                             monkeypatch):
    monkeypatch.chdir(tmp_path)
    small = ["trace", "-n", "1", "--steps", "2", "--dim", "16", "--depth", "1", "--batch", "4"]
    assert cli.main(small) == 0 and cli.main(small) == 0
    runs = sorted((tmp_path / "runs").iterdir())
    assert len(runs) == 2 and all(r.name.startswith("trace-2") for r in runs)
    assert all({p.name for p in r.iterdir()} == {"trace.json", "timeline.png", "metrics.jsonl", "hta"}
               for r in runs)
    assert f"wrote {runs[1].relative_to(tmp_path) / 'trace.json'}, " in capsys.readouterr().out

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(trace_cli, "spawn", interrupted)
    assert cli.main(small) == 130
    assert sorted((tmp_path / "runs").iterdir()) == runs  # no third, empty folder
