"""Asynchronous training converges without tuning: `microddp train --strategy async` with 2 and 3
workers, fully asynchronous, reaches 90% test accuracy on digits in the 6 epochs in which sync
data parallelism (the reference, run here with the same seed and global batch) reaches it.

Before each asynchronous gradient counted as its share of the global batch (ps/policy.py), the
3-worker run ended at 30-56% (N times sync's step per global batch, with momentum 0.9)."""

import json
import subprocess
import sys

import pytest

EPOCHS = ["--epochs", "6", "--seed", "4", "--no-plot"]
DEADLINE_S = 300
TARGET = 0.90


def _final_accuracy(out, *args):
    done = subprocess.run([sys.executable, "-m", "microddp", "train", *args, *EPOCHS, "--out",
                           str(out)], capture_output=True, text=True, timeout=DEADLINE_S)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "final"][0]["test_accuracy"]


@pytest.fixture(scope="module")
def sync_accuracy(tmp_path_factory):
    return _final_accuracy(tmp_path_factory.mktemp("dp"), "--nproc", "2")


@pytest.mark.slow  # whole 6-epoch jobs: the claim is about convergence in a number of epochs
@pytest.mark.parametrize("nproc", [3, 4])
def test_fully_async_reaches_the_target_in_sync_dps_epochs(nproc, sync_accuracy, tmp_path):
    assert sync_accuracy >= TARGET  # the reference reaches it in these epochs
    accuracy = _final_accuracy(tmp_path, "--strategy", "async", "--nproc", str(nproc),
                               "--staleness", "inf")
    assert accuracy >= TARGET, f"{nproc - 1} async workers: {accuracy:.3f} (sync dp " \
                               f"{sync_accuracy:.3f})"
