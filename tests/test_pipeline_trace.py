"""A pipeline's messages on the job's timeline (issue 52): `microddp train --strategy pp
--trace` puts every send (posted, on the comm track) and every receive (the time the rank
waited for its data, on the comm_wait track) of every step beside the schedule's compute, each
named by its schedule action, the same count as the schedule has."""

import json

import pytest

import microddp
from microddp import pipeline
from microddp.train import loop
from microddp.train.config import TrainConfig

M, STEPS = 4, 2


def _worker(world, out):
    cfg = TrainConfig(dataset="digits", hidden=32, depth=4, plot=False, batch_size=48,
                      max_steps=STEPS, strategy="pp", schedule="gpipe", microbatches=M,
                      trace=True, out=out)
    loop.train(world, cfg)


@pytest.mark.slow  # a whole traced job on 2 ranks
def test_pipeline_sends_and_receives_on_the_trace(tmp_path):
    microddp.launch.spawn(_worker, 2, args=(str(tmp_path),), timeout=180)
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    schedule = pipeline.build("gpipe", 2, M)
    for rank in (0, 1):
        mine = [e for e in events if e.get("pid") == rank and e.get("ph") == "X"]
        for kind, prefix, cat in (("SEND", "send ", "comm"), ("RECV", "recv ", "comm_wait")):
            wanted = sorted(str(a) for a in schedule.actions[rank] if a.kind.startswith(kind))
            got = [e for e in mine if e["name"].startswith(prefix)]
            assert len(wanted) == M and sorted(e["name"] for e in got) == sorted(
                prefix + a for a in wanted * STEPS), (rank, kind)
            assert {e.get("cat") for e in got} == {cat}, got[:2]
            assert all(e["dur"] >= 0 for e in got)
