"""Bad input ends in seconds with one clear MicroDDPError on every rank that can tell, never a
hang and never a silently wrong gradient."""

import pytest
import torch
from torch import nn

import microddp as mdp
from microddp import MicroDDPError
from microddp.dp import wrap
from test_ddp_equivalence import DIM, Branchy


class Small(nn.Module):
    def __init__(self, width=4, dtype=torch.float32):
        super().__init__()
        self.a = nn.Linear(4, width).to(dtype)
        self.b = nn.Linear(width, 2).to(dtype)

    def forward(self, x):
        return self.b(self.a(x))


def mismatched(world):
    out = []
    for kwargs in ({"width": 5} if world.rank == 1 else {}, {"dtype": torch.float64} if world.rank == 2 else {}):
        try:
            mdp.DDP(Small(**kwargs))
            out.append("built")
        except MicroDDPError as e:
            out.append(str(e))
    return out


def test_a_different_model_on_one_rank_fails_every_rank_naming_it():
    results = mdp.spawn(mismatched, 3, timeout=60)
    shape, dtype = results[0]
    assert ("parameter 'a.weight' is not the same everywhere (ranks 0, 2: shape (4, 4) float32; "
            "rank 1: shape (5, 4) float32)") in shape
    assert ("parameter 'a.weight' is not the same everywhere (ranks 0, 1: shape (4, 4) float32; "
            "rank 2: shape (4, 4) float64)") in dtype
    assert all(r == results[0] for r in results)


def unused(world, rank_dependent):
    torch.manual_seed(0)
    ddp = mdp.DDP(Branchy())
    ref = wrap(Branchy(), "torch", find_unused_parameters=True)
    ref.module.load_state_dict(ddp.module.state_dict())
    out = []
    for step in range(3):
        use = (world.rank == 0) if rank_dependent else False
        use = use or step == 2  # the last step uses everything everywhere
        x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(step + 10 * world.rank))
        for m in (ddp, ref):
            m.zero_grad(set_to_none=True)
        ref(x, use_extra=use).sum().backward()
        try:
            ddp(x, use_extra=use).sum().backward()
            same = all(torch.equal(p.grad, q.grad) for p, q in zip(ddp.parameters(), ref.parameters(), strict=True)
                       if q.grad is not None)
            out.append(f"ok, grads equal torch's: {same}")
        except MicroDDPError as e:
            out.append(str(e))
    return out


@pytest.mark.filterwarnings("ignore")
def test_unused_parameters_without_find_unused_fail_clearly_on_each_affected_rank():
    message = ("2 parameter(s) got no gradient in this backward pass on rank {r}: 'extra.weight', "
               "'extra.bias'. Pass find_unused_parameters=True")
    everywhere = mdp.spawn(unused, 2, args=(False,), timeout=60)
    for r, steps in enumerate(everywhere):
        assert steps[0].startswith(message.format(r=r)) and steps[1].startswith(message.format(r=r))
        assert steps[2] == "ok, grads equal torch's: True"  # and the model still works after
    # Used on rank 0 only: rank 1 fails; rank 0 gets the right average (zero from rank 1), no hang.
    one_side = mdp.spawn(unused, 2, args=(True,), timeout=60)
    assert one_side[0] == ["ok, grads equal torch's: True"] * 3
    assert one_side[1][0].startswith(message.format(r=1)) and one_side[1][1].startswith(message.format(r=1))
    assert one_side[1][2] == "ok, grads equal torch's: True"


def test_bad_arguments_are_named():
    with pytest.raises(MicroDDPError, match="bucket_cap_mb must be a positive"):
        mdp.DDP(Small(), bucket_cap_mb=0)
    with pytest.raises(MicroDDPError, match="device_ids must be None for a module on the CPU"):
        mdp.DDP(Small(), device_ids=[0])
    with pytest.raises(MicroDDPError, match="no parameter that requires a gradient"):
        mdp.DDP(Small().requires_grad_(False))
    with pytest.raises(MicroDDPError, match="wraps an nn.Module, got function"):
        mdp.DDP(lambda x: x)
    ddp = mdp.DDP(Small())
    with pytest.raises(MicroDDPError, match="unknown built-in hook 'gzip'"):
        ddp.register_comm_hook(None, "gzip")
    ddp.register_comm_hook(None, "fp16_compress")
    with pytest.raises(MicroDDPError, match="can only be called once"):
        ddp.register_comm_hook(None, "allreduce")


def test_no_sync_is_restored_even_when_the_block_raises():
    ddp = mdp.DDP(Small())
    with pytest.raises(ZeroDivisionError):
        with ddp.no_sync():
            assert ddp.require_backward_grad_sync is False
            _ = 1 / 0
    assert ddp.require_backward_grad_sync is True


def test_ddp_benchmark_rejects_bad_options_before_starting_ranks():
    import argparse

    from microddp.bench import ddp as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    with pytest.raises(MicroDDPError, match="unknown engine"):
        bench.run(parser.parse_args(["--engines", "microddp", "ring"]))
    with pytest.raises(MicroDDPError, match="at least 2 ranks"):
        bench.run(parser.parse_args(["-n", "1"]))


def test_ddp_benchmark_control_prints_an_a_a_ratio(capsys):
    import argparse

    from microddp.bench import ddp as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    with pytest.raises(MicroDDPError, match="include torch"):
        bench.run(parser.parse_args(["--engines", "microddp", "--control"]))
    assert bench.run(parser.parse_args(["--dims", "16", "--depth", "2", "--repeats", "3",
                                        "--warmup", "1", "--engines", "microddp", "torch",
                                        "--control"])) == 0
    out = capsys.readouterr().out
    row = next(line.split() for line in out.splitlines() if line.strip().startswith("16 "))
    # dim, three times (microddp, torch, torch-2), microddp/torch and A/A, each with its
    # 90% interval
    assert len(row) == 8 and row[-2].endswith("x") and float(row[-2][:-1]) > 0
    for cell in (row[-3], row[-1]):
        lo, hi = (float(x) for x in cell.split("-"))
        assert 0 < lo <= hi
    assert "torch-2" in out and "A/A" in out and "90% interval" in out
