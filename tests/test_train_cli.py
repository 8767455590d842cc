"""`microddp train` end to end: bad input, the default job, and surviving a SIGKILLed rank."""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from launch_helpers import rank_pid
from microddp import checkpoint
from microddp.commands import main
from microddp.train import resume
from microddp.train.config import TrainConfig


def _save_run(out, step=1, **settings):
    """A checkpoint of a run with `settings`, as the job writes it (contents beside the point)."""
    state = {k: 0 for k in checkpoint.REQUIRED} | {"format": checkpoint.FORMAT, "step": step}
    state["config"] = TrainConfig(out=str(out), **settings).resume_settings()
    return checkpoint.save(state, out / "checkpoints", step)


def _break(path):
    path.write_bytes(b"\x00" * 999)


def _bad_inputs(tmp_path):
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    empty = tmp_path / "empty"
    empty.mkdir()
    used = tmp_path / "used"
    _save_run(used)
    broken = tmp_path / "broken"
    for step in (1, 2):
        _break(_save_run(broken, step))
    unreadable = "holds 2 checkpoint(s), none of them readable (the newest, ckpt-00000002.pt, is " \
                 "unreadable (damaged, cut short, or not a PyTorch file)); move them away or " \
                 "choose a new --out"
    cases = [
        (["--dataset", "mnist"], "unknown dataset 'mnist'"),
        (["--engine", "fast"], "unknown engine 'fast'"),
        (["--optimizer", "rmsprop"], "unknown optimizer 'rmsprop'"),
        (["--amp", "fp8"], "unknown --amp precision 'fp8'"),
        (["--batch-size", "63"], "must split evenly over 2 ranks"),
        (["--nproc", "100000"], "--nproc must be between 1 and"),
        (["--nproc", "0"], "--nproc must be between 1 and"),
        (["--epochs", "0"], "--epochs must be at least 1"),
        (["--accumulate", "0"], "--accumulate must be at least 1"),
        (["--lr", "-1"], "--lr must be a positive, finite number"),
        (["--lr", "inf"], "--lr must be a positive, finite number, got inf"),
        (["--lr", "nan"], "--lr must be a positive, finite number, got nan"),
        (["--monitor-timeout", "nan"], "--monitor-timeout must be a finite number"),
        (["--monitor-timeout", "inf"], "--monitor-timeout must be a finite number"),
        (["--monitor-timeout", "-1"], "--monitor-timeout must be a finite number"),
        (["--monitor-timeout", "0.001"], "would report healthy ranks as hung"),
        (["--seed", str(10**20)], "--seed must be at most 4294967295"),
        (["--hidden", "10000000"], "more than this host's"),
        (["--straggler", "1:inf"], "is not RANK:FACTOR with a finite FACTOR"),
        (["--out", str(a_file)], "is a file, not a folder"),
        (["--out", str(a_file / "run")], "is not writable"),
        (["--resume"], "--resume needs the run to continue"),
        (["--resume", "--out", str(tmp_path / "nope")], "does not exist"),
        (["--resume", "--out", str(empty)], "no checkpoint in"),
        (["--out", str(used)], "already holds checkpoints of an earlier run"),
        (["--resume", "--out", str(used), "--hidden", "64"],
         "checkpoint ckpt-00000001.pt was made with --hidden 128 (now 64)"),
        (["--out", str(broken)], unreadable),
        (["--resume", "--out", str(broken)], unreadable),
    ]
    if not torch.cuda.is_available():
        cases.append((["--amp", "fp16"], "--amp fp16 needs a CUDA GPU"))
    return cases


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)  # the launching side, not a worker
    for args, message in _bad_inputs(tmp_path):
        assert main(["train", *args]) == 2, args
        out, err = capsys.readouterr()
        assert out == "", args
        lines = err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("microddp train: error: "), (args, err)
        assert message in lines[0], (args, lines[0])


def test_a_restartable_worker_needs_a_fixed_run_folder(capsys, monkeypatch):
    # As under torchrun --max-restarts 2: restarted workers must find the same folder.
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    assert main(["train"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["microddp train: error: with --max-restarts, pass --out DIR: restarted "
                   "workers find the checkpoints to resume from there"]


def test_a_restart_whose_checkpoints_all_broke_starts_over_without_them(tmp_path):
    """The broken files are set aside, so the new run's lower steps are its newest files and
    pruning never deletes what the new run just wrote."""
    cfg = TrainConfig(out=str(tmp_path))
    for step in (10, 20, 30):
        _break(_save_run(tmp_path, step))
    said: list[str] = []
    assert resume.decide(cfg, restarted=True, warn=said.append) == (None, None)
    assert said == [f"none of the 3 checkpoint(s) in {tmp_path / 'checkpoints'} is readable; "
                    "renamed them to *.unreadable and starting this restart from scratch"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "ckpt-00000010.pt.unreadable", "ckpt-00000020.pt.unreadable",
        "ckpt-00000030.pt.unreadable"]
    for step in (5, 6, 7, 8):
        _save_run(tmp_path, step)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path / "checkpoints")] == [
        "ckpt-00000006.pt", "ckpt-00000007.pt", "ckpt-00000008.pt"]
    # A restart that can resume does so, and says which newer file it skipped.
    _break(tmp_path / "checkpoints" / "ckpt-00000008.pt")
    said.clear()
    path, error = resume.decide(cfg, restarted=True, warn=said.append)
    assert error is None and path.endswith("ckpt-00000007.pt")
    assert len(said) == 1 and "ckpt-00000008.pt is unreadable" in said[0]


def _params(path):
    return torch.load(path, weights_only=True)


def _train(*args):
    return [sys.executable, "-m", "microddp", "train", *args]


@pytest.mark.slow  # a full job, a killed rank and a restart: a stress test, for CI's slow run
def test_default_job_learns_and_survives_a_killed_rank(tmp_path):
    ref = subprocess.run(_train("--out", str(tmp_path / "ref")), capture_output=True,
                         text=True, timeout=240)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    rows = [json.loads(x) for x in (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in rows if r["kind"] == "epoch"]
    assert [r["epoch"] for r in epochs] == list(range(1, 9))
    assert rows[-1]["kind"] == "final" and rows[-1]["test_accuracy"] >= 0.90
    assert "batch 64 global = 32 per rank x 2" in ref.stdout
    assert (tmp_path / "ref" / "curves.png").read_bytes()[:4] == b"\x89PNG"

    out = tmp_path / "crash"
    job = subprocess.Popen(_train("--out", str(out), "--max-restarts", "1",
                                  "--checkpoint-every", "5"),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, killed = time.monotonic() + 180, None
        while killed is None and time.monotonic() < deadline and job.poll() is None:
            if checkpoint.list_checkpoints(out / "checkpoints"):
                killed = rank_pid(psutil.Process(job.pid), 1)
                if killed:
                    os.kill(killed, signal.SIGKILL)
            time.sleep(0.01)
        log, _ = job.communicate(timeout=240)
    finally:
        if job.poll() is None:
            job.kill()
    assert killed is not None, log
    assert job.returncode == 0, log
    assert "rank 1 failed (killed by SIGKILL)" in log
    assert "restarting all 2 workers (restart 1 of 1)" in log
    assert "resuming from ckpt-" in log
    a, b = _params(tmp_path / "ref" / "model.pt"), _params(out / "model.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("flag", ["--help"])
def test_help_shows_examples(flag, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["train", flag])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    assert "torchrun" in text and "--max-restarts" in text and "--accumulate" in text


def test_a_run_stopped_before_it_wrote_anything_leaves_no_folder(tmp_path, capsys, monkeypatch):
    import microddp.launch.run

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.chdir(tmp_path)
    outcomes = iter([KeyboardInterrupt, 1])

    def launch(script, script_args, **kwargs):  # what workers leave after an early stop
        out = tmp_path / script_args[script_args.index("--out") + 1]
        (out / "checkpoints").mkdir()
        (out / "metrics.jsonl").write_text("")
        outcome = next(outcomes)
        if outcome is KeyboardInterrupt:
            raise outcome
        return outcome

    monkeypatch.setattr(microddp.launch.run, "launch", launch)
    assert main(["train", "--dataset", "synthetic"]) == 130
    assert main(["train", "--dataset", "synthetic"]) == 1
    assert list((tmp_path / "runs").iterdir()) == []
    err = capsys.readouterr().err
    assert err.count("the run wrote nothing into it") == 2 and "interrupted" in err


def test_done_lists_every_file_the_run_wrote(tmp_path, capsys):
    from microddp import comms
    from microddp.train import train

    cfg = TrainConfig(nproc=1, dataset="synthetic", epochs=1, max_steps=2, hidden=8, depth=1,
                      trace=True, out=str(tmp_path / "run"))
    try:
        train(comms.init(), cfg)
    finally:
        comms.shutdown()
    done = [line for line in capsys.readouterr().out.splitlines() if line.startswith("done:")]
    run = tmp_path / "run"
    assert done[0].endswith(
        f"wrote {run / 'model.pt'}, {run / 'metrics.jsonl'}, {run / 'curves.png'}, "
        f"{run / 'trace.json'}, {run / 'timeline.png'}, {run / 'hta'}/, {run / 'checkpoints'}/")
    assert {p.name for p in run.iterdir()} == {"model.pt", "metrics.jsonl", "curves.png",
                                               "trace.json", "timeline.png", "hta", "checkpoints"}
