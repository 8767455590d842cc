"""Run folders: a new one per run, never shared, removed when a stopped run wrote nothing;
files written whole or not at all."""

import pytest

from microddp import outputs
from microddp.errors import MicroDDPError


def test_runs_started_in_the_same_second_get_folders_of_their_own(tmp_path, monkeypatch):
    monkeypatch.setattr(outputs.time, "strftime", lambda fmt: "20250101-120000")
    made = [outputs.new_run_dir("trace", tmp_path / "runs") for _ in range(3)]
    assert [p.name for p in made] == ["trace-20250101-120000", "trace-20250101-120000-2",
                                      "trace-20250101-120000-3"]
    assert all(p.is_dir() for p in made)


def test_default_folder_is_a_new_dated_one_under_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first, created = outputs.claim(None, "bench-scaling")
    second, _ = outputs.claim(None, "bench-scaling")
    assert created and first != second
    assert first.parent.name == "runs" and first.name.startswith("bench-scaling-2")


def test_a_failed_run_removes_the_folder_it_made_only_if_nothing_is_in_it(tmp_path):
    with pytest.raises(KeyboardInterrupt), outputs.run_folder(str(tmp_path / "a"), "x") as a:
        (a / "checkpoints").mkdir()
        (a / "metrics.jsonl").write_text("")  # what an interrupted start leaves
        raise KeyboardInterrupt
    assert not a.exists()

    with pytest.raises(RuntimeError), outputs.run_folder(str(tmp_path / "b"), "x") as b:
        (b / "metrics.jsonl").write_text('{"step": 1}\n')  # worth keeping: a failed run's log
        raise RuntimeError
    assert (b / "metrics.jsonl").is_file()

    (tmp_path / "mine").mkdir()  # the user's own folder is never removed
    with pytest.raises(RuntimeError), outputs.run_folder(str(tmp_path / "mine"), "x"):
        raise RuntimeError
    assert (tmp_path / "mine").is_dir()


def test_out_that_is_a_file_is_one_clear_error(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(MicroDDPError, match="is a file, not a folder"):
        outputs.claim(str(tmp_path / "f"), "x")


def test_a_write_that_fails_leaves_neither_half_a_file_nor_its_temporary(tmp_path):
    target = tmp_path / "trace.json"
    outputs.write_text(target, "old")
    with pytest.raises(ValueError), outputs.atomic(target) as tmp:
        tmp.write_text("half")
        raise ValueError
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.json"]


def test_the_closing_line_lists_every_file(tmp_path):
    assert outputs.wrote([tmp_path / "a.png", None, "b.json"]) == f"wrote {tmp_path / 'a.png'}, b.json"
