"""Every ZeRO stage trains to the parameters of one process and of plain data parallelism
(microddp's DDP), on 2 and 3 ranks, for SGD with momentum, Adam and AdamW, on a model with
sizes no world size divides, a frozen layer, a zero-sized parameter and two parameter groups
with their own lr; with gradient accumulation; and under bf16 autocast."""

import pytest
import torch

import microddp as mdp
from microddp import zero
from zero_helpers import (
    OPTIMIZERS,
    STEPS,
    Awkward,
    data,
    fresh,
    groups,
    local,
    loss_fn,
    max_diff,
    plain_dp,
    single,
    zero_run,
)

TOL = 1e-6  # float32 rounding of a sum taken in another order


def every_case(world):
    out = {}
    for name in OPTIMIZERS:
        ref = single(name)
        out[name, "dp"] = max_diff(plain_dp(world, name), ref)
        for stage in zero.STAGES:
            out[name, stage] = max_diff(zero_run(world, name, stage), ref)
            out[name, stage, "one bucket"] = max_diff(zero_run(world, name, stage,
                                                               bucket_cap_mb=25), ref)
    for stage in zero.STAGES:
        out["accumulate x2", stage] = max_diff(zero_run(world, "adam", stage, micro=2),
                                               single("adam"))
        # accumulating with a reduction in every backward: each must add only its own share
        # (ZeRO-1 keeps .grad, which by the second backward holds the first one's too)
        out["accumulate x2, reduced each time", stage] = max_diff(
            zero_run(world, "adam", stage, micro=2, sync_each=True), single("adam"))
    dp_bf16 = plain_dp(world, "adam", amp=True)
    for stage in zero.STAGES:
        out["bf16", stage] = max_diff(zero_run(world, "adam", stage, amp=True), dp_bf16)
    frozen = fresh().frozen.weight
    finals = {stage: zero_run(world, "adamw", stage) for stage in zero.STAGES}
    names = [n for n, _ in Awkward().named_parameters()]
    untouched = all(torch.equal(finals[s][names.index("frozen.weight")], frozen)
                    for s in zero.STAGES)
    return out, untouched, finals


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_stage_equals_one_process_and_plain_dp(world_size):
    ranks = mdp.spawn(every_case, world_size, backend="gloo", timeout=240)
    for out, untouched, _ in ranks:
        assert untouched
        for case, diff in out.items():
            tol = 2e-3 if case[0] == "bf16" else TOL
            assert diff <= tol, (case, diff)
    # and the ranks agree with each other exactly
    for stage in zero.STAGES:
        for other in ranks[1:]:
            assert max_diff(ranks[0][2][stage], other[2][stage]) == 0


def accumulation_traffic(world):
    """Bytes sent by each micro-step of one step of 3 micro-batches."""
    out = {}
    for stage in zero.STAGES:
        model = fresh()
        z = zero.Zero(model, torch.optim.Adam, stage=stage, param_groups=groups(model), lr=0.01)
        sent = []
        for k in range(3):
            before = z.sent.total
            x, y = local(world, 0, 3, k)
            if k < 2:
                with z.no_sync():
                    loss_fn(z(x), y).backward()
            else:
                loss_fn(z(x), y).backward()
            sent.append(z.sent.total - before)
        full_grads = [p.grad is not None for p in model.parameters() if p.requires_grad]
        z.step()
        out[stage] = sent, full_grads
    return out


def test_accumulation_sends_nothing_until_the_last_micro_step():
    for out in mdp.spawn(accumulation_traffic, 2, backend="gloo", timeout=120):
        for stage in (1, 2):
            assert out[stage][0][:2] == [0, 0], stage
            assert out[stage][0][2] > 0, stage  # the last backward reduce-scatters
        # ZeRO-3 gathers the parameters once, at the first micro-step's forward, then keeps them
        first, second, last = out[3][0]
        assert first > 0 and second == 0 and last > 0
        # after the last backward ZeRO-2/3 hold no full gradient; ZeRO-1 holds them until step
        assert not any(out[2][1]) and not any(out[3][1]) and all(out[1][1])


def test_a_world_of_one_trains_like_the_optimizer_alone():
    ref = single("adam")
    for stage in zero.STAGES:
        model = fresh()
        z = zero.Zero(model, torch.optim.Adam, stage=stage, param_groups=groups(model), lr=0.01)
        for step in range(STEPS):
            loss_fn(z(data(step)[0]), data(step)[1]).backward()
            z.step()
            z.zero_grad()
        assert max_diff(list(z.full_state_dict().values()), ref) <= TOL
        assert z.memory()["sent_per_step"] == 0
