"""`microddp train --elastic` under the faults it is built for, many times (slow): 20 jobs of
4 ranks, each losing a random rank (rank 0 included) to SIGKILL at a random step; a rank frozen
by SIGSTOP (fenced out by the heartbeat watch, and when it wakes it stops without writing);
and --min-ranks, below which the job stops with a checkpoint. Each job's parameters are
compared with one process's training of the same seed and global batches."""

import json
import random

import pytest
import torch

from elastic_helpers import (
    ATOL,
    check_samples,
    leftovers,
    max_diff,
    median,
    membership,
    pause_s,
    reference,
    run_elastic,
)
from shm_leftovers import dev_shm_clean  # noqa: F401 (a fixture)

STEPS = 6  # of 12 per epoch at batch 128: the kill lands anywhere in them
TRIALS = 20


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_twenty_jobs_each_lose_a_random_rank_and_finish(tmp_path, dev_shm_clean):  # noqa: F811
    ref = reference(tmp_path / "ref", max_steps=STEPS)
    rng = random.Random(49)
    rows = []
    for trial in range(TRIALS):
        rank = 0 if trial < 4 else rng.randrange(4)  # rank 0, the store's usual host, 4 times
        step = rng.randrange(STEPS)
        out = tmp_path / f"t{trial}"
        job = run_elastic(out, 4, f"kill:{rank}:{step}", settings={"max_steps": STEPS})
        diff = max_diff(out, ref) if (out / "model.pt").exists() else float("inf")
        rows.append({"trial": trial, "killed": rank, "step": step + 1, "exit": job.returncode,
                     "max_diff": diff, "pause_s": pause_s(out) if job.returncode == 0 else None,
                     "changes": len(membership(out)) if job.returncode == 0 else None})
        print(json.dumps(rows[-1]), flush=True)
        assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
        assert diff <= ATOL
        check_samples(out, STEPS)
        assert [c["lost"] for c in membership(out)][-1] == [rank]
        assert leftovers(out) == []
    pauses = [r["pause_s"] for r in rows]
    print(f"20 trials: {sum(r['exit'] == 0 for r in rows)}/20 exit 0, max param difference "
          f"{max(r['max_diff'] for r in rows):.3g}, pause median {median(pauses):.3f} s, "
          f"max {max(pauses):.3f} s")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_frozen_rank_is_fenced_out_and_stops_when_it_wakes(tmp_path, dev_shm_clean):  # noqa: F811
    out = tmp_path / "run"
    job = run_elastic(out, 4, "stop:2:3:6", settings={"epochs": 1})
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    assert max_diff(out, reference(tmp_path / "ref", epochs=1)) <= ATOL
    check_samples(out, steps=12)
    assert [(c["lost"], c["members"]) for c in membership(out)] == [([2], [0, 1, 3])]
    assert "[id 2] fenced out: generation 1 formed without id 2" in job.stderr + job.stdout
    # The woken rank wrote nothing of the new generation.
    woken = [json.loads(x) for x in (out / "samples-2.jsonl").read_text().splitlines()]
    assert [r["step"] for r in woken] == [1, 2, 3] and {r["gen"] for r in woken} == {0}
    print(f"frozen rank: next step {pause_s(out):.3f} s after the SIGSTOP")
    assert leftovers(out) == []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_below_min_ranks_the_job_stops_with_its_checkpoint(tmp_path):
    out = tmp_path / "run"
    job = run_elastic(out, 2, "kill:1:2", "--min-ranks", "2", settings={"epochs": 1})
    assert job.returncode == 1
    assert "1 rank(s) left, fewer than --min-ranks 2; stopping at step 2" in job.stdout
    saved = torch.load(out / "checkpoints" / "ckpt-00000002.pt", weights_only=True)
    ref = reference(tmp_path / "ref", max_steps=2)
    assert saved["step"] == 2
    assert max((saved["model"][k] - ref[k]).abs().max().item() for k in ref) <= ATOL
    assert leftovers(out) == []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_replacement_joins_with_a_live_ranks_state(tmp_path, monkeypatch):
    # Each step sleeps a little, so that the replacement (a new process: torch, the data)
    # is ready while the job still runs.
    monkeypatch.setenv("MICRODDP_ELASTIC_STEP_S", "0.5")
    out = tmp_path / "run"
    job = run_elastic(out, 4, "kill:1:3", "--replacements", "1", settings={"epochs": 4})
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    assert "microddp run: starting id 4 in slot 1" in job.stderr
    changes = membership(out)
    assert [(c["lost"], c.get("joined", [])) for c in changes] == [([1], []), ([], [4])]
    assert changes[-1]["members"] == [0, 2, 3, 4]
    assert "[id 4] joined generation 2 at step" in job.stdout
    joined_at = changes[-1]["step"]
    # The newcomer's first step is the one after it joined: state from a live rank, not disk.
    first = json.loads((out / "samples-4.jsonl").read_text().splitlines()[0])
    assert first["step"] == joined_at + 1 and first["members"] == [0, 2, 3, 4]
    assert max_diff(out, reference(tmp_path / "ref", epochs=4)) <= ATOL
    check_samples(out, steps=48)
    assert leftovers(out) == []
