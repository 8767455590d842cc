"""Replica drift: an injected rank-dependent update is found, and named like a direct check."""

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import microddp as mdp
from microddp import monitor
from microddp.model import FullMLP
from microddp.monitor.drift import checksum


def test_checksum_sees_one_bit_and_a_swap():
    x = torch.randn(1000)
    y = x.clone()
    y.view(torch.int32)[123] ^= 1  # the lowest mantissa bit of one value
    assert not torch.equal(checksum(x), checksum(y))
    assert torch.equal(checksum(x), checksum(x.clone()))
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([2.0, 1.0])
    assert checksum(a)[0] == checksum(b)[0] and checksum(a)[1] != checksum(b)[1]
    for t in (torch.ones(3, dtype=torch.bfloat16), torch.ones(2, dtype=torch.bool),
              torch.arange(5, dtype=torch.int64), torch.ones(2, dtype=torch.complex128),
              torch.ones(2, dtype=torch.complex64)):
        assert checksum(t).dtype == torch.int64


def test_checksum_of_a_complex_tensor_sees_its_imaginary_part():
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex128)
    w = z.clone()
    w.imag[1] = -4.000000000000001
    assert torch.equal(checksum(z), checksum(torch.view_as_real(z)))
    assert not torch.equal(checksum(z), checksum(w))


def _first_difference(module):
    """The reference answer, straight from torch.distributed: gather every tensor, compare."""
    for name, t in list(module.named_parameters()) + [(f"buffer {n}", b) for n, b in
                                                      module.named_buffers()]:
        everyone = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, t.detach().contiguous())
        if not all(torch.equal(everyone[0], e) for e in everyone):
            return name
    return None


def _drift(world):
    torch.manual_seed(0)
    model = DistributedDataParallel(FullMLP(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    check = monitor.DriftCheck(model.module, every=2)
    seen = []
    for step in range(1, 5):
        x = torch.randn(8, 16) + world.rank
        torch.nn.functional.cross_entropy(model(x), torch.zeros(8, dtype=torch.long)).backward()
        opt.step()
        opt.zero_grad()
        if step == 3 and world.rank == 1:  # a rank-dependent update, after step 2's check
            with torch.no_grad():
                model.module.net[4].weight[1, 2] *= 1.0000001
        try:
            check.check(step)
            seen.append((step, "ok"))
        except mdp.MicroDDPError as e:
            seen.append((step, str(e)))
    return seen, _first_difference(model.module)


def test_injected_drift_is_named():
    for seen, reference in mdp.spawn(_drift, 2, timeout=60):
        assert reference == "net.4.weight"
        assert seen[:3] == [(1, "ok"), (2, "ok"), (3, "ok")]  # step 3 is not a check step
        step, text = seen[3]
        assert step == 4
        assert text.startswith("replica drift at step 4: parameter 'net.4.weight' differs "
                               "between rank 0 and rank(s) 1")


def test_no_check_in_a_world_of_one():
    mdp.init()
    monitor.check_replicas(FullMLP(4, 1))  # nothing to compare with: returns quietly
    with pytest.raises(mdp.MicroDDPError, match="at least 1 step"):
        monitor.DriftCheck(FullMLP(4, 1), every=-3)


def _complex_buffer(world):
    m = torch.nn.Linear(2, 2)
    torch.nn.init.zeros_(m.weight)
    m.register_buffer("phase", torch.zeros(2, dtype=torch.complex128))
    out = []
    for drifted in (False, True):
        if drifted and world.rank == 1:
            m.phase.imag[0] = 1e-300  # only the imaginary part of one element differs
        try:
            monitor.check_replicas(m)
            out.append("ok")
        except mdp.MicroDDPError as e:
            out.append(str(e))
    return out


def test_complex_buffers_are_compared_bit_for_bit():
    for same, drifted in mdp.spawn(_complex_buffer, 2, timeout=60):
        assert same == "ok"
        assert drifted.startswith("replica drift: parameter 'buffer phase' differs between "
                                  "rank 0 and rank(s) 1")
