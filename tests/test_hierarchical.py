"""The hierarchical all-reduce against torch.distributed's flat one, on made-up hosts (ranks of
this machine grouped as if they sat on several), even and uneven; and DDP's choice of it."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import microddp as mdp
from microddp.collectives import hierarchical as H
from microddp.errors import MicroDDPError

SIZES = (0, 1, 3, 7, 1001, 100_003)
# integers: the sums are exact in any order, so the results must be bit-identical
INT_OPS = ("sum", "max", "min", "product")


def _inputs(rank: int, n: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + n)
    if op == "product":
        return torch.randint(1, 3, (n,), generator=g).to(dtype)
    return torch.randint(-1000, 1000, (n,), generator=g).to(dtype)


def _against_flat(world, hosts, transport="auto"):
    # Read when the host's group attaches its shared memory (in Hierarchy): "gloo" keeps the
    # steps inside a host on gloo's send/recv, "auto" lets them use shared memory (made-up
    # hosts are one real host, so every group of 2+ ranks may).
    os.environ["MICRODDP_TRANSPORT"] = transport
    hierarchy = H.Hierarchy(hosts)
    shared = H.intra_host_path(torch.zeros(1), "sum", hierarchy.intra) is not None
    out = []
    for n in SIZES:
        for op in INT_OPS:
            mine = _inputs(world.rank, n, torch.int64, op)
            ref = mine.clone()
            dist.all_reduce(ref, {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                                  "min": dist.ReduceOp.MIN,
                                  "product": dist.ReduceOp.PRODUCT}[op])
            H.hierarchical_all_reduce(mine, op, hierarchy)
            out.append((n, op, torch.equal(mine, ref)))
        # float avg, and the asynchronous path DDP takes: equal to flat up to rounding
        x = torch.randn(n, generator=torch.Generator().manual_seed(world.rank), dtype=torch.float64)
        ref = x.clone()
        dist.all_reduce(ref)
        got = hierarchy.start(x.clone()).wait()
        out.append((n, "start", torch.allclose(got, ref, rtol=1e-12, atol=1e-12)))
        avg = H.hierarchical_all_reduce(x.clone().view(-1, 1) if n else x.clone(), "avg",
                                        hierarchy)
        out.append((n, "avg", torch.allclose(avg.view(-1), ref / world.world_size,
                                             rtol=1e-12, atol=1e-12)))
    return [case for case in out if not case[2]], (hierarchy.hosts, hierarchy.rails,
                                                   hierarchy.local), shared


@pytest.mark.parametrize("hosts, rails", [
    (["a", "a", "b", "b"], 2),            # 2 hosts x 2 ranks
    (["a", "a", "a", "b"], 1),            # uneven: 3 + 1
    (["a", "b", "a", "b"], 2),            # a host's ranks need not be consecutive
    (["a", "a", "b", "b", "b"], 2),       # uneven: 2 + 3
])
@pytest.mark.parametrize("transport", ["auto", "gloo"])
def test_equals_flat_all_reduce(hosts, rails, transport):
    """Through shared memory inside a host (auto) and through gloo (gloo), the same results."""
    results = mdp.spawn(_against_flat, len(hosts), args=(hosts, transport), timeout=180)
    for rank, (failed, (n_hosts, n_rails, local), shared) in enumerate(results):
        assert failed == [], (rank, failed)
        # a host of one rank has nobody to share memory with
        assert shared == (transport == "auto" and hosts.count(hosts[rank]) > 1), rank
        assert (n_hosts, n_rails) == (len(set(hosts)), rails)
        assert local == [r for r, h in enumerate(hosts) if h == hosts[rank]].index(rank)


def _ddp_steps(world, hosts):
    """A few DDP steps with the hierarchy (made-up hosts) and without; parameters of both."""
    results, started = [], []
    for use in (True, False):
        torch.manual_seed(0)
        H._chosen.clear()
        if use:
            hierarchy = H.Hierarchy(hosts)
            run = hierarchy.start
            hierarchy.start = lambda data, name="sum", run=run: started.append(1) or run(data,
                                                                                         name)
            H._chosen[dist.group.WORLD] = hierarchy
        model = mdp.FullMLP(32, depth=3)
        # several buckets after the first step's rebuild, in flight together
        ddp = mdp.DDP(model, bucket_cap_mb=0.001)
        assert (H.chosen() is not None) == use
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(world.rank)
        for _ in range(3):
            x, y = torch.randn(8, 32, generator=g), torch.randint(0, 2, (8,), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
        assert len(ddp.reducer.buckets) > 1
        results.append([p.detach().clone() for p in model.parameters()])
    H._chosen.clear()
    return results, len(started)


def test_ddp_through_the_hierarchy_matches_flat():
    for (hier, flat), started in mdp.spawn(_ddp_steps, 4, args=(["a", "a", "b", "b"],),
                                           timeout=180):
        assert started >= 1 + 2 * 2  # every bucket of every step went through it
        assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(hier, flat,
                                                                           strict=True))


def _decide(world, per_host, setting):
    os.environ[H.SETTING] = setting if world.rank else "auto"
    H.host_id = lambda: f"host{world.rank // per_host}"  # these ranks, as if on hosts
    H._chosen.clear()
    try:
        found = H.choose()
    except MicroDDPError as e:
        return str(e)
    return None if found is None else (found.hosts, found.rails)


@pytest.mark.parametrize("per_host, setting, expected", [
    (2, "auto", (2, 2)),   # 2 hosts x 2 ranks: hierarchical
    (4, "auto", None),     # one host: flat
    (1, "auto", None),     # one rank per host: nothing to gain inside a host
])
def test_ddp_chooses_it_when_ranks_share_hosts_across_hosts(per_host, setting, expected):
    assert mdp.spawn(_decide, 4, args=(per_host, setting)) == [expected] * 4


def test_a_setting_that_differs_between_ranks_is_one_error():
    for message in mdp.spawn(_decide, 2, args=(1, "0")):
        assert "MICRODDP_HIERARCHICAL differs between ranks" in message
