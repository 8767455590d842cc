"""`microddp train --elastic`: a rank SIGKILLed mid-step (rank 0 here, the hardest one) and the
job goes on in place: exit 0, the same parameters as one process's training within float
rounding, every sample used exactly once in the epoch, the change recorded, nothing left
behind. Refusals are one line. (20 random trials and a frozen rank: test_elastic_trials.py.)"""

import pytest

from elastic_helpers import (
    ATOL,
    check_samples,
    leftovers,
    max_diff,
    membership,
    pause_s,
    reference,
    run_elastic,
)
from launch_helpers import microddp
from microddp.errors import MicroDDPError
from microddp.train.config import TrainConfig
from microddp.train.validate import validate
from shm_leftovers import dev_shm_clean  # noqa: F401 (a fixture)


def test_rank_0_killed_mid_step_the_others_finish_the_epoch(tmp_path, dev_shm_clean):  # noqa: F811
    out = tmp_path / "run"
    job = run_elastic(out, 4, "kill:0:4", settings={"epochs": 1})
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    ref = reference(tmp_path / "ref", epochs=1)
    assert max_diff(out, ref) <= ATOL
    check_samples(out, steps=12)  # digits: 1437 training samples, 12 global batches of 128
    changes = membership(out)
    assert [(c["lost"], c["members"], c["step"]) for c in changes] == [([0], [1, 2, 3], 5)]
    assert changes[0]["pause_s"] >= 0
    assert "lost id(s) [0] at step 5" in job.stdout
    assert pause_s(out) > 0
    assert leftovers(out) == []


def test_elastic_with_zero_is_refused_in_one_line(tmp_path):
    job = microddp("train", "--elastic", "--strategy", "zero1", "--nproc", "4", "--out",
                   str(tmp_path / "r"))
    assert job.returncode == 2
    lines = job.stderr.strip().splitlines()
    assert len(lines) == 1 and "--elastic works with --strategy dp only" in lines[0], job.stderr


@pytest.mark.parametrize("settings,message", [
    ({"strategy": "async"}, "--elastic works with --strategy dp only"),
    ({"strategy": "pp"}, "--elastic works with --strategy dp only"),
    ({"accumulate": 2}, "--elastic does not take --accumulate"),
    ({"engine": "torch"}, "--elastic does not take --engine"),
    ({"min_ranks": 5}, "--min-ranks must be between 1 and the 4 ranks"),
    ({"elastic_timeout": 0.0}, "--elastic-timeout must be a positive number"),
    ({"replacements": -1}, "--replacements must be 0 or more"),
    ({"elastic": False, "replacements": 1}, "--replacements needs --elastic"),
])
def test_what_elastic_is_not_built_for_is_refused(settings, message):
    cfg = TrainConfig(**{"elastic": True, "nproc": 4, **settings})
    with pytest.raises(MicroDDPError, match=message.replace("-", r"\-")):
        validate(cfg)
