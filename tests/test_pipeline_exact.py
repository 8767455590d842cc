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
    # receives before the first forward, a gradient's right after its forward (GPipe holds
    # all m = 3 micro-batches: its window is 3)
    first, last = (
        [e for e in events if e[0] != "wait"]
        for events in mdp.launch.spawn(_order_of_posts_and_forwards, 2, timeout=120))
    assert last[:4] == [("post", "ACT", 0), ("post", "ACT", 1), ("post", "ACT", 2), ("F", 0)]
    assert first == [("F", 0), ("post", "GRAD", 0), ("F", 1), ("post", "GRAD", 1),
                     ("F", 2), ("post", "GRAD", 2)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_at_most_window_receives_are_posted_ahead_each_in_program_order(name):
    m = 6
    schedule = pipeline.build(name, 2, m)
    # the window is the most micro-batches a rank's program holds at once, at least 2: GPipe
    # all m on each rank, 1F1B p - r = 2 and 1, so 2 and 2 (worked out by hand)
    assert [pipeline.runtime.window(schedule, r) for r in range(2)] == \
        ([m, m] if name == "gpipe" else [2, 2])
    assert [pipeline.runtime.window(pipeline.build("1f1b", 4, 8), r) for r in range(4)] == \
        [4, 3, 2, 2]
    for rank, events in enumerate(mdp.launch.spawn(_order_of_posts_and_forwards, 2,
                                                   args=(m, name), timeout=120)):
        posts = [e[1:] for e in events if e[0] == "post"]
        waits = [e[1:] for e in events if e[0] == "wait"]
        assert posts == waits and len(posts) == m  # each posted once, waited in that order
        outstanding = peak = 0
        for e in events:
            outstanding += {"post": 1, "wait": -1}.get(e[0], 0)
            peak = max(peak, outstanding)
        assert peak == pipeline.runtime.window(schedule, rank)  # reached, never passed


def _sends_and_receipts(world, p=3, m=5):
    """Per schedule, this rank's step as seen from comms: ('received', key, t) when a
    receive's wait returns, ('waited', key, t) when the program waits for one of its sends,
    ('end', None, t) when the runtime starts its end-of-step waits (key: runtime._tag's
    (kind, boundary, micro-batch); t: time.perf_counter, one clock for the host's ranks)."""
    import time

    from microddp import comms
    from microddp.pipeline import runtime

    events: list = []
    real_isend, real_irecv, real_note = comms.isend, comms.irecv, runtime.note

    def key(tag):
        q = tag // m
        return ("GRAD" if q % 2 else "ACT", q // 2, tag % m)

    class Observed:  # the runtime's handle, noting when its wait is called or returns
        def __init__(self, handle, what, before):
            self.handle, self.what, self.before = handle, what, before

        def wait(self):
            if self.before:
                events.append(("waited", self.what, time.perf_counter()))
            out = self.handle.wait()
            if not self.before:
                events.append(("received", self.what, time.perf_counter()))
            return out

    def isend(tensor, *args, tag=0, **kwargs):
        return Observed(real_isend(tensor, *args, tag=tag, **kwargs), key(tag), True)

    def irecv(tensor, *args, tag=0, **kwargs):
        return Observed(real_irecv(tensor, *args, tag=tag, **kwargs), key(tag), False)

    def note(what):
        if isinstance(what, str) and "waiting for its sends" in what:
            events.append(("end", None, time.perf_counter()))
        real_note(what)

    # the modules the runtime calls through; this process only
    runtime.comms.isend, runtime.comms.irecv, runtime.note = isend, irecv, note
    out = {}
    for name in pipeline.BUILDERS:
        schedule = pipeline.build(name, p, m)
        torch.manual_seed(0)
        stages = pipeline.split_model(mdp.FullMLP(4, schedule.stages), schedule.stages)
        mine = {s: stages[s] for s in schedule.stages_of(world.rank)}
        x, y = torch.randn(2 * m, 4), torch.zeros(2 * m, dtype=torch.long)
        mdp.comms.barrier()
        events.clear()
        pipeline.run_schedule(schedule, mine, x, y, torch.nn.functional.cross_entropy)
        out[name] = list(events)
    return out


def test_a_send_is_waited_for_early_only_once_its_receiver_has_it():
    # observed on the running ranks, not worked out again from the schedule: every send is
    # waited for once; one waited for before the step's end is one its receiver had already
    # received (its wait returns at once), and every schedule waits for some that early
    ranks = mdp.launch.spawn(_sends_and_receipts, 3, timeout=180)
    for name in pipeline.BUILDERS:
        received = {k: t for r in ranks for kind, k, t in r[name] if kind == "received"}
        early = 0
        for r in ranks:
            events = r[name]
            end = next(t for kind, _, t in events if kind == "end")
            waited = [(k, t) for kind, k, t in events if kind == "waited"]
            assert len({k for k, _ in waited}) == len(waited), name  # each send once
            for k, t in waited:
                if t < end:
                    assert received[k] <= t, (name, k)  # the receiver had it already
                    early += 1
        sends = sum(a.kind.startswith("SEND") for prog in pipeline.build(name, 3, 5).actions
                    for a in prog)
        assert sum(kind == "waited" for r in ranks for kind, *_ in r[name]) == sends, name
        assert early > 0, name


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
