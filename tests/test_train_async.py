"""`microddp train --strategy async` end to end, through the command line: bad input is one line
and exit 2; staleness 0 trains to the parameters of one process with the same global batch; a
worker killed mid-run is dropped, recorded and the run exits 0; a killed server restarts from
its checkpoint to the same parameters; the final record, trace and --straggler for dp."""

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

SMALL = ["--hidden", "32", "--depth", "1", "--batch-size", "48", "--seed", "3", "--no-plot"]
ASYNC = ["--strategy", "async", "--nproc", "3"]
DEADLINE_S = 240
PER_EPOCH = 30  # steps: the digits' 1438 training samples in global batches of 48


def _train(*args):
    return [sys.executable, "-m", "microddp", "train", *args]


def _run(*args):
    done = subprocess.run(_train(*args), capture_output=True, text=True, timeout=DEADLINE_S)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def _rows(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _params(out):
    return torch.load(out / "model.pt", weights_only=True)


@pytest.mark.parametrize("args,message", [
    (["--strategy", "async", "--nproc", "1"], "--strategy async needs --nproc of at least 2"),
    (ASYNC + ["--staleness", "-1"], "staleness must be >= 0"),
    (ASYNC + ["--staleness", "soon"], "staleness 'soon' is neither"),
    (ASYNC + ["--straggler", "3:4"], "straggler rank 3 is not a worker: workers are ranks 1..2"),
    (ASYNC + ["--straggler", "0:4"], "rank 0 is the server"),
    (ASYNC + ["--straggler", "2"], "is not RANK:FACTOR"),
    (ASYNC + ["--backup-workers", "2"], "backup workers must be between 0 and 1 with 2 workers"),
    (ASYNC + ["--staleness", "2", "--backup-workers", "1"], "use them with staleness 0"),
    (ASYNC + ["--accumulate", "2"], "--accumulate is for the data-parallel strategies"),
    (ASYNC + ["--batch-size", "1"], "use at least 2"),
    (["--straggler", "2:4"], "--straggler 2:4: the rank must be one of 0..1"),
    (["--staleness", "3"], "add --strategy async"),
    (["--servers", "2"], "add --strategy async"),
    (ASYNC + ["--servers", "3"], "--servers 3: between 1 and 2 with --nproc 3"),
    (ASYNC + ["--servers", "2", "--resume"], "--resume is not supported with --servers 2"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert main(["train", *args]) == 2
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert out == "" and len(lines) == 1 and lines[0].startswith("microddp train: error: "), err
    assert message in lines[0]


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
    """A synchronous (S=0) async run: the reference of the equality and restart tests."""
    out = tmp_path_factory.mktemp("sync") / "run"
    log = _run(*ASYNC, *SMALL, "--epochs", "2", "--out", str(out))
    return out, log


def test_staleness_0_trains_to_the_parameters_of_one_process(sync_run, tmp_path):
    out, log = sync_run
    one = tmp_path / "one"
    _run("--nproc", "1", *SMALL, "--epochs", "2", "--out", str(one))
    a, b = _params(out), _params(one)
    assert a.keys() == b.keys()
    for k in a:  # the same sums in another order: equal to float rounding
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    final = _rows(out)[-1]
    assert final["kind"] == "final" and final["strategy"] == "async"
    steps = 2 * PER_EPOCH
    assert final["step"] == steps and final["updates"] == steps
    assert final["gradients_applied"] == 2 * steps and final["staleness_histogram"] == {
        "0": 2 * steps}
    assert final["samples_per_s"] > 0 and final["lost"] == []
    assert [r["rank"] for r in final["memory"]] == [0, 1, 2]
    epochs = [r for r in _rows(out) if r["kind"] == "epoch"]
    assert [r["epoch"] for r in epochs] == [1, 2]
    assert final["test_accuracy"] == epochs[-1]["test_accuracy"]
    assert "a parameter server (rank 0) and 2 worker(s), sync (S=0)" in log
    assert "epoch 2/2: train loss" in log and "done: test accuracy" in log


@pytest.mark.slow  # a whole job, stopped and resumed, against an uninterrupted one
def test_resume_continues_the_server_to_the_same_parameters(sync_run, tmp_path):
    out = tmp_path / "resumed"
    _run(*ASYNC, *SMALL, "--epochs", "1", "--out", str(out))
    log = _run(*ASYNC, *SMALL, "--epochs", "2", "--resume", "--out", str(out))
    assert f"resuming from ckpt-{PER_EPOCH:08d}.pt: step {PER_EPOCH}, {PER_EPOCH} updates" in log
    a, b = _params(sync_run[0]), _params(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = _rows(out)
    assert [r["epoch"] for r in rows if r["kind"] == "epoch"] == [1, 2]
    assert [r["kind"] for r in rows].count("final") == 1
    # a dp run cannot continue a server's checkpoint, nor another number of workers
    for args, message in ((["--nproc", "3"], "made with --strategy async (now dp)"),
                          (["--strategy", "async", "--nproc", "4"],
                           "made with --nproc 3 (now 4)")):
        done = subprocess.run(_train(*args, *SMALL, "--epochs", "3", "--resume", "--out",
                                     str(out)), capture_output=True, text=True,
                              timeout=DEADLINE_S)
        assert done.returncode == 2 and message in done.stderr, done.stderr


def _kill_after_first_checkpoint(args, out, rank):
    """Start `microddp train ARGS`, SIGKILL `rank` once a checkpoint exists; (log, killed)."""
    job = subprocess.Popen(_train(*args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    try:
        deadline, killed = time.monotonic() + DEADLINE_S, None
        while killed is None and time.monotonic() < deadline and job.poll() is None:
            if checkpoint.list_checkpoints(out / "checkpoints"):
                killed = rank_pid(psutil.Process(job.pid), rank)
                if killed:
                    os.kill(killed, signal.SIGKILL)
            time.sleep(0.01)
        log, _ = job.communicate(timeout=DEADLINE_S)
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    assert killed is not None, log
    return job.returncode, log


@pytest.mark.slow  # a whole job and a killed worker (tests/test_ps_faults.py covers the rule in the default set)
def test_a_killed_worker_is_dropped_and_recorded_and_the_run_exits_0(tmp_path):
    out = tmp_path / "lost"
    # rank 1 straggles so that the run lasts long enough to lose rank 2 midway
    code, log = _kill_after_first_checkpoint(
        [*ASYNC, *SMALL, "--epochs", "3", "--checkpoint-every", "3", "--straggler", "1:20",
         "--trace", "--out", str(out)], out, rank=2)
    assert code == 0, log
    assert "rank 2 failed (killed by SIGKILL); it is expendable" in log
    assert "worker rank 2 lost at step" in log
    rows = _rows(out)
    final = rows[-1]
    lost = [r for r in rows if r["kind"] == "lost"]
    assert len(lost) == 1 and lost[0]["rank"] == 2 and lost[0]["step"] >= 3
    assert [r["rank"] for r in final["lost"]] == [2] and final["lost"][0]["step"] == lost[0][
        "step"]
    steps = 3 * PER_EPOCH
    assert final["step"] == steps and final["gradients_applied"] == 2 * steps
    # Synchronous: two gradients per update until the loss, one after; but a gradient the
    # worker sent just before it died is still applied, with the survivor's, in one update.
    assert final["updates"] in (2 * steps - lost[0]["step"], 2 * steps - lost[0]["step"] - 1)
    trace = json.loads((out / "trace.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1}  # the lost worker left no spans
    assert not list(out.glob(".spans-*"))


@pytest.mark.slow  # a whole job, a killed server and a restart
def test_a_killed_server_restarts_from_its_checkpoint_to_the_same_parameters(sync_run,
                                                                            tmp_path):
    out = tmp_path / "restart"
    # the straggler changes only the timing: at S=0 the parameters are the same, bit for bit
    code, log = _kill_after_first_checkpoint(
        [*ASYNC, *SMALL, "--epochs", "2", "--checkpoint-every", "5", "--straggler", "2:10",
         "--max-restarts", "1", "--out", str(out)], out, rank=0)
    assert code == 0, log
    assert "rank 0 failed (killed by SIGKILL)" in log
    assert "restarting all 3 workers (restart 1 of 1)" in log
    assert "resuming from ckpt-" in log
    a, b = _params(sync_run[0]), _params(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = _rows(out)
    assert [r["epoch"] for r in rows if r["kind"] == "epoch"] == [1, 2]
    assert sum(1 for r in rows if r["kind"] == "final") == 1


@pytest.mark.slow  # a whole asynchronous job with a straggler
def test_fully_async_with_a_straggler_reports_its_staleness(tmp_path):
    out = tmp_path / "async"
    log = _run(*ASYNC, *SMALL, "--epochs", "1", "--staleness", "inf", "--staleness-lr",
               "--straggler", "2:4", "--trace", "--out", str(out))
    final = _rows(out)[-1]
    hist = {int(k): v for k, v in final["staleness_histogram"].items()}
    # one gradient per update, each applied as it arrives: exactly the budget
    assert sum(hist.values()) == final["gradients_applied"] == final["updates"] == 2 * PER_EPOCH
    assert final["mean_staleness"] == pytest.approx(
        sum(k * v for k, v in hist.items()) / sum(hist.values()))
    assert {e["pid"] for e in json.loads((out / "trace.json").read_text())["traceEvents"]} == {
        0, 1, 2}
    assert "async (S=inf), staleness-aware lr, rank 2 x4 slower" in log
    assert "staleness of the" in log and "trace: mean over" in log


@pytest.mark.slow  # three whole jobs with a slowed rank
@pytest.mark.parametrize("strategy", ["dp", "zero2", "pp"])
def test_a_straggler_sleeps_only_on_its_rank_in_every_strategy(strategy, tmp_path):
    """--straggler works for the synchronous strategies too (the issue: "for every strategy,
    dp included"): the slowed rank, and only it, records straggle spans in training."""
    out = tmp_path / strategy
    _run("--strategy", strategy, "--nproc", "2", *SMALL, "--depth", "2", "--epochs", "1",
         "--max-steps", "4", "--straggler", "1:3", "--trace", "--out", str(out))
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    straggles = [e for e in events if e.get("name") == "straggle"]
    assert straggles and {e["pid"] for e in straggles} == {1}


@pytest.mark.slow  # a whole job on two servers against the one-server run
def test_two_servers_at_staleness_0_train_to_the_one_server_parameters(sync_run, tmp_path):
    out = tmp_path / "sharded"
    log = _run("--strategy", "async", "--nproc", "4", "--servers", "2", *SMALL, "--epochs",
               "2", "--out", str(out))
    a, b = _params(sync_run[0]), _params(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    epochs = [r for r in _rows(out) if r["kind"] == "epoch"]
    one = [r for r in _rows(sync_run[0]) if r["kind"] == "epoch"]
    # every epoch scored on the whole model (the other shard sent to server 0): the same
    assert [r["test_accuracy"] for r in epochs] == [r["test_accuracy"] for r in one]
    final = _rows(out)[-1]
    assert final["gradients_applied"] == 2 * 2 * PER_EPOCH
    assert [m["rank"] for m in final["memory"]] == [0, 1, 2, 3]
    assert "done: test accuracy" in log
