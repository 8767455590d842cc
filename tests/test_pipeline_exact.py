"""Every schedule, run for real on 2, 3 and 4 ranks, trains exactly as one process does: the
same gradients at the last of 3 SGD steps and the same parameters after them, for 1, 2, 3 and
5 micro-batches of a batch of 11 (which none of 2, 3, 5 divides; m = 1 and 2 are fewer
micro-batches than stages on 3 and 4 ranks). And the runtime posts its receives ahead, in the
order its docstring gives.

Tolerance: float32 with atol 1e-6 and rtol 1e-5. The pipeline sums each micro-batch's share
of the loss's gradient, where one process sums all samples in one matmul, so the two
round differently, by a few units in the last place.
"""

import pytest
import torch

import microddp as mdp
from microddp import pipeline
from pipeline_helpers import one_process, pipelined

MICROBATCHES = (1, 2, 3, 5)
TOL = {"atol": 1e-6, "rtol": 1e-5}


def every_schedule(world):
    return {(name, m): pipelined(world, name, m) for name in pipeline.BUILDERS
            for m in MICROBATCHES}


@pytest.fixture(scope="module")
def reference():
    return one_process()


@pytest.mark.parametrize("p", [2, 3, 4])
def test_every_schedule_equals_one_process(p, reference):
    ranks = mdp.spawn(every_schedule, p, backend="gloo", timeout=240)
    params, grads, losses = reference
    for case in ranks[0]:
        got_params = {n: t for r in ranks for n, t in r[case][0].items()}
        got_grads = {n: t for r in ranks for n, t in r[case][1].items()}
        assert sorted(got_params) == sorted(params), case  # every layer on exactly one rank
        for n in params:
            torch.testing.assert_close(got_grads[n], grads[n], **TOL, msg=f"{case} grad {n}")
            torch.testing.assert_close(got_params[n], params[n], **TOL, msg=f"{case} {n}")
        last = [r[case][2] for r in ranks][p - 1]  # the last stage's rank reports the loss
        assert last == pytest.approx(losses, rel=1e-5), case
        assert all(loss is None for r in ranks[:p - 1] for loss in r[case][2]), case


def _order_of_posts_and_forwards(world, m=3, name="gpipe"):
    """This rank's step of `name` (m micro-batches) as a list of events: ('post', kind, mb)
    when a receive is posted, ('wait', kind, mb) when the program waits for it, ('F', mb)
    when a forward starts."""
    from microddp import comms
    from microddp.pipeline import runtime

    events, real_irecv = [], comms.irecv

    class Waited:  # the runtime's handle, noting when the program waits for it
        def __init__(self, handle, what):
            self.handle, self.what = handle, what

        def wait(self):
            events.append(("wait", *self.what))
            return self.handle.wait()

    def irecv(tensor, *args, tag=0, **kwargs):
        kind, mb = ("GRAD" if (tag // m) % 2 else "ACT"), tag % m  # runtime._tag's layout
        events.append(("post", kind, mb))
        return Waited(real_irecv(tensor, *args, tag=tag, **kwargs), (kind, mb))

    runtime.comms.irecv = irecv  # the module the runtime calls through; this process only
    schedule = pipeline.build(name, 2, m)
    model = mdp.FullMLP(4, 2)
    stage = pipeline.split_model(model, 2)[world.rank]
    calls = iter(range(m))
    stage.register_forward_pre_hook(lambda *_: events.append(("F", next(calls))))
    x, y = torch.randn(2 * m, 4), torch.zeros(2 * m, dtype=torch.long)
    pipeline.run_schedule(schedule, {world.rank: stage}, x, y, torch.nn.functional.cross_entropy)
    return events


def test_receives_are_posted_ahead_activations_first_gradients_after_their_forward():
    # gloo moves a message only once its receive is posted: the runtime posts the activations'
    # receives before the first forward, a gradient's right after its forward (m = 3: each
    # is within the window of 2 when its turn to be posted comes)
    first, last = (
        [e for e in events if e[0] != "wait"]
        for events in mdp.launch.spawn(_order_of_posts_and_forwards, 2, timeout=120))
    assert last[:4] == [("post", "ACT", 0), ("post", "ACT", 1), ("post", "ACT", 2), ("F", 0)]
    assert first == [("F", 0), ("post", "GRAD", 0), ("F", 1), ("post", "GRAD", 1),
                     ("F", 2), ("post", "GRAD", 2)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_at_most_window_receives_are_posted_ahead_each_in_program_order(name):
    m = 6
    for events in mdp.launch.spawn(_order_of_posts_and_forwards, 2, args=(m, name),
                                   timeout=120):
        posts = [e[1:] for e in events if e[0] == "post"]
        waits = [e[1:] for e in events if e[0] == "wait"]
        assert posts == waits and len(posts) == m  # each posted once, waited in that order
        outstanding = peak = 0
        for e in events:
            outstanding += {"post": 1, "wait": -1}.get(e[0], 0)
            peak = max(peak, outstanding)
        assert peak == pipeline.runtime.WINDOW  # reached, never passed


@pytest.mark.parametrize("name", list(pipeline.BUILDERS))
def test_a_send_is_waited_for_only_after_its_receiver_has_answered(name):
    # the runtime waits for a send early only once a message has arrived that the receiver
    # sent after receiving it (so the wait returns at once); check that order on every rank
    from microddp.pipeline.runtime import _sends_done_after
    from microddp.pipeline.schedules import message_key

    schedule = pipeline.build(name, 3, 5)
    early = 0
    for rank in range(3):
        for reply, sent in _sends_done_after(schedule, rank).items():
            for key in sent:
                peers = [r for r in range(3) if any(
                    message_key(a) == key for a in schedule.actions[r] if a.kind.startswith("RECV"))]
                program = schedule.actions[peers[0]]
                order = [i for i, a in enumerate(program)
                         if a.kind.startswith(("RECV", "SEND")) and message_key(a) in (key, reply)]
                kinds = [program[i].kind[:4] for i in order]
                assert kinds == ["RECV", "SEND"], (rank, key, reply)  # received, then replied
                early += 1
    assert early > 0


def test_a_send_without_its_receive_is_named_not_a_bare_stop_iteration():
    # run_schedule does not validate; a hand-made schedule that drops a receive must still say
    # what is wrong in one MicroDDPError
    from dataclasses import replace

    from microddp.pipeline.runtime import _sends_done_after

    good = pipeline.build("gpipe", 2, 1)
    broken = replace(good, actions=(good.actions[0], tuple(
        a for a in good.actions[1] if a.kind != "RECV_ACT")))
    with pytest.raises(mdp.MicroDDPError, match="has no matching receive on rank 1"):
        _sends_done_after(broken, 0)
    # worked out once per schedule; each call hands out its own copy (a step pops from it)
    first = _sends_done_after(good, 0)  # rank 1 answers rank 0's activation with its gradient
    assert first
    first.clear()
    assert _sends_done_after(good, 0)
