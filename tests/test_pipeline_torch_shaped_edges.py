"""The torch-shaped pipeline classes in one process (one rank holding every stage, so no
message is sent): forward-only steps, uneven micro-batches with torch's gradient scaling
computed by hand, and every refusal in one line. Plus the programs the classes run: the
interleaved zero-bubble schedule passes `validate`, and forward-only programs play to the end.
"""

import pytest
import torch

from microddp import MicroDDPError, pipeline
from pipeline_helpers import LR, data, fresh_model, loss_fn

TOL = {"atol": 1e-6, "rtol": 1e-5}


def one_rank(name: str, v: int, m: int, **kw):
    """A model cut into v stages, all on this rank, and schedule `name` over them."""
    model = fresh_model()
    parts = pipeline.split_model(model, v)
    stages = [pipeline.PipelineStage(parts[s], s, v, "cpu") for s in range(v)]
    cls = getattr(pipeline, name)
    schedule = cls(stages[0] if name in ("ScheduleGPipe", "Schedule1F1B") else stages, m, **kw)
    return model, schedule


@pytest.mark.parametrize("name,v", [("ScheduleGPipe", 1), ("Schedule1F1B", 1),
                                    ("ScheduleInterleaved1F1B", 2),
                                    ("ScheduleInterleavedZeroBubble", 3),
                                    ("ScheduleZBVZeroBubble", 2)])
@pytest.mark.parametrize("m", [1, 5])
def test_uneven_microbatches_scale_as_torch(name, v, m):
    """Batch 11 in m micro-batches: the gradient is the mean over micro-batches of each one's
    mean loss's gradient (torch's scale_grads), not the batch mean; losses one per micro-batch."""
    model, schedule = one_rank(name, v, m, loss_fn=loss_fn)
    ref = fresh_model()
    xs, ys = data(11)
    opt, ref_opt = (torch.optim.SGD(mod.parameters(), lr=LR) for mod in (model, ref))
    for x, y in zip(xs, ys, strict=True):
        opt.zero_grad()
        ref_opt.zero_grad()
        losses: list = []
        out = schedule.step(x, target=y, losses=losses)
        parts = [loss_fn(ref(a), b) for a, b in zip(x.tensor_split(m), y.tensor_split(m),
                                                     strict=True)]
        (sum(parts) / m).backward()
        assert [t.item() for t in losses] == pytest.approx([t.item() for t in parts], rel=1e-6)
        torch.testing.assert_close(out, ref(x), **TOL)
        for (n, q), r in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(q.grad, r.grad, **TOL, msg=n)
        opt.step()
        ref_opt.step()


def test_forward_only_and_eval_keep_no_graph_and_no_grads():
    model, schedule = one_rank("ScheduleInterleaved1F1B", 2, 3)  # no loss_fn: forward only
    x, y = (t[0] for t in data(12))
    out = schedule.step(x)
    torch.testing.assert_close(out, model(x), **TOL)
    assert all(q.grad is None for q in model.parameters())
    model, schedule = one_rank("Schedule1F1B", 1, 4, loss_fn=loss_fn)
    losses: list = []
    out = schedule.eval(x, target=y, losses=losses)
    assert not out.requires_grad and all(q.grad is None for q in model.parameters())
    assert [t.item() for t in losses] == pytest.approx(
        [loss_fn(model(a), b).item() for a, b in zip(x.tensor_split(4), y.tensor_split(4),
                                                       strict=True)], rel=1e-6)


def test_sum_loss_without_scaling_is_the_batch_sum():
    def sum_loss(out, y):
        return torch.nn.functional.cross_entropy(out, y, reduction="sum")

    model, schedule = one_rank("ScheduleInterleavedZeroBubble", 2, 4, loss_fn=sum_loss,
                               scale_grads=False)
    ref = fresh_model()
    x, y = (t[0] for t in data(10))
    schedule.step(x, target=y)
    sum_loss(ref(x), y).backward()
    for q, r in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(q.grad, r.grad, **TOL)


def test_refusals_say_what_to_do():
    part = fresh_model()
    with pytest.raises(MicroDDPError, match="out of range"):
        pipeline.PipelineStage(part, 2, 2, "cpu")
    stage = pipeline.PipelineStage(part, 0, 1, "cpu")
    with pytest.raises(MicroDDPError, match="n_microbatches"):
        pipeline.ScheduleGPipe(stage, 0, loss_fn=loss_fn)
    with pytest.raises(MicroDDPError, match="chunk and merge specs"):
        pipeline.ScheduleGPipe(stage, 2, loss_fn=loss_fn, args_chunk_spec=(0,))
    with pytest.raises(MicroDDPError, match="exactly 2 stages per rank"):
        pipeline.ScheduleZBVZeroBubble([stage], 2, loss_fn=loss_fn)
    with pytest.raises(MicroDDPError, match="must hold stages"):
        pipeline.Schedule1F1B(pipeline.PipelineStage(part, 0, 2, "cpu"), 2, loss_fn=loss_fn)
    schedule = pipeline.Schedule1F1B(stage, 4, loss_fn=loss_fn)
    x, y = (t[0] for t in data(12))
    with pytest.raises(MicroDDPError, match="passes the batch"):
        schedule.step(target=y)
    with pytest.raises(MicroDDPError, match="passes the target"):
        schedule.step(x)
    with pytest.raises(MicroDDPError, match="micro-batches"):
        schedule.step(x[:3], target=y[:3])
    with torch.no_grad(), pytest.raises(MicroDDPError, match="eval"):
        schedule.step(x, target=y)
    schedule.step(x, target=y)
    with pytest.raises(MicroDDPError, match="target has 8 samples but the batch 12"):
        schedule.step(x, target=y[:8])
    with pytest.raises(MicroDDPError, match="losses must be a list"):
        schedule.step(x, target=y, losses=())
    # another batch size works: the shapes are learnt again (the multi-rank test is
    # test_pipeline_boundaries.py)
    ref = fresh_model()
    out = schedule.step(x[:8], target=y[:8])
    torch.testing.assert_close(out, ref(x[:8]), **TOL)


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_interleaved_zero_bubble_is_valid_and_forward_only_programs_finish(p):
    for m in (1, 2, 3, 5, 8):
        zbv = pipeline.zbv_zero_bubble(p, m)
        pipeline.validate(zbv)
        assert zbv.stages_of(0) == [0, 2 * p - 1] and zbv.rank_of(2 * p - 1) == 0
        pipeline.simulate(pipeline.forward_only(zbv))
        for v in (2, 3):
            schedule = pipeline.interleaved_zero_bubble(p, m, v)
            pipeline.validate(schedule)
            kinds = [a.kind for a in schedule.actions[0]]
            assert kinds.count("I") == kinds.count("W") == m * v and "B" not in kinds
            pipeline.simulate(pipeline.forward_only(schedule))
        for name in pipeline.BUILDERS:
            forward = pipeline.forward_only(pipeline.build(name, p, m))
            assert {a.kind for prog in forward.actions for a in prog} <= {"F", "SEND_ACT",
                                                                          "RECV_ACT"}
            pipeline.simulate(forward)
    with pytest.raises(MicroDDPError, match="v >= 2"):
        pipeline.interleaved_zero_bubble(p, 2, 1)


def test_metadata_messages_live_where_the_backend_moves_them(monkeypatch):
    import torch.distributed as dist

    from microddp.pipeline import stage as stage_module

    stage = pipeline.PipelineStage(fresh_model(), 0, 1, "cuda:1")  # no CUDA call is made
    assert stage_module._meta_device(stage) == torch.device("cpu")  # no group: gloo's side
    monkeypatch.setattr(stage_module, "distributed", lambda group=None: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    assert stage_module._meta_device(stage) == torch.device("cuda", 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU; this machine has none")
def test_a_stage_on_a_gpu_gives_the_cpus_numbers():
    x, y = (t[0] for t in data(12))
    got = {}
    for device in ("cpu", "cuda"):
        model = fresh_model().to(device)
        parts = pipeline.split_model(model, 2)
        stages = [pipeline.PipelineStage(parts[s], s, 2, device) for s in range(2)]
        schedule = pipeline.ScheduleInterleaved1F1B(stages, 3, loss_fn=loss_fn)
        out = schedule.step(x.to(device), target=y.to(device))
        got[device] = (out.cpu(), [q.grad.cpu() for q in model.parameters()])
    torch.testing.assert_close(got["cuda"][0], got["cpu"][0], atol=1e-5, rtol=1e-4)
    for a, b in zip(got["cuda"][1], got["cpu"][1], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
