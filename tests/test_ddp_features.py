"""DDP features beyond plain averaging: one-process worlds, checkpoints, bucket rebuild, comm
hooks (the GradBucket contract, bf16), and the trace of every bucket's all-reduce."""

import torch
import torch.distributed as dist
from torch import nn

import microddp as mdp
from microddp import trace
from microddp.dp import wrap
from microddp.dp.comm_hooks import allreduce, bf16_compress
from microddp.dp.ladder import toy_data


def test_one_process_world_trains_exactly_like_the_bare_model():
    mdp.init()
    results = []
    for wrapped in (False, True):
        torch.manual_seed(0)
        model = mdp.FullMLP(8, 3)
        net = mdp.DDP(model) if wrapped else model
        opt = torch.optim.Adam(net.parameters(), lr=1e-2)
        x, y = toy_data(16, 8)
        for _ in range(3):
            opt.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def checkpoint(world, path):
    torch.manual_seed(world.rank)
    ddp = mdp.DDP(mdp.FullMLP(8, 2))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    nn.functional.cross_entropy(ddp(torch.randn(4, 8)), torch.tensor([0, 1, 0, 1])).backward()
    opt.step()
    if world.rank == 0:
        torch.save(ddp.module.state_dict(), path)
    dist.barrier()
    fresh = mdp.FullMLP(8, 2)
    fresh.load_state_dict(torch.load(path))
    same = all(torch.equal(a, b) for a, b in zip(fresh.parameters(), ddp.module.parameters(), strict=True))
    return list(ddp.module.state_dict()), list(ddp.state_dict()), same


def test_state_dicts_have_torchs_keys_and_load_on_every_rank(tmp_path):
    for inner, outer, same in mdp.spawn(checkpoint, 2, args=(str(tmp_path / "model.pt"),),
                                        timeout=60):
        assert inner[0] == "net.0.weight" and same  # the module's own: what to save
        assert outer == [f"module.{k}" for k in inner]  # the wrapper's, as torch's DDP


def buckets_after_rebuild(world):
    layouts = []
    for engine in ("microddp", "torch"):
        torch.manual_seed(0)
        ddp = wrap(mdp.FullMLP(256, 12), engine, bucket_cap_mb=1)  # 12 x 256 KiB weights
        for _ in range(2):  # the second forward rebuilds in arrival order
            ddp(torch.randn(2, 256)).sum().backward()
        if engine == "torch":
            index = {p: i for i, p in enumerate(ddp.parameters())}
            layouts.append([[index[p] for p in b.parameters()]
                            for b in ddp.reducer._get_zeros_like_grad_buckets()])
        else:
            layouts.append([b.indices for b in ddp.reducer.buckets])
    return layouts


def test_rebuilt_buckets_equal_torchs():
    ours, theirs = mdp.spawn(buckets_after_rebuild, 2, timeout=60)[0]
    assert ours == theirs and len(ours) > 2
    assert ours[0][0] == 25  # the last layer's bias arrives first


def hooks(world):
    seen = []

    def spy(state, bucket):
        flat = bucket.buffer()
        grads = bucket.gradients()
        at = [flat.data_ptr() + o * flat.element_size() for o in bucket.offsets()]
        seen.append((bucket.index(), bucket.is_last(), len(bucket.parameters()), flat.numel(),
                     [g.shape for g in grads] == [p.shape for p in bucket.parameters()]
                     and [g.data_ptr() for g in grads] == at))
        return allreduce(state, bucket)

    torch.manual_seed(0)
    model = mdp.FullMLP(8, 3)
    ddp = mdp.DDP(model, bucket_cap_mb=0.0005)  # 512 bytes: a few buckets
    ddp.register_comm_hook(None, spy)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(world.rank))
    ddp(x).sum().backward()  # the first backward uses a single bucket, then they are rebuilt
    seen.clear()
    ddp(x).sum().backward()

    torch.manual_seed(0)
    plain = mdp.FullMLP(8, 3)
    ddp16 = mdp.DDP(plain)
    ddp16.register_comm_hook(None, bf16_compress)
    plain(x).sum().backward()  # local gradients, no averaging
    local = [p.grad.clone() for p in plain.parameters()]
    plain.zero_grad()
    ddp16(x).sum().backward()
    everyone = [[torch.empty_like(g) for _ in range(2)] for g in local]
    for g, out in zip(local, everyone, strict=True):
        dist.all_gather(out, g)
    expected = [(a.bfloat16() / 2 + b.bfloat16() / 2).float() for a, b in everyone]
    bf16_ok = all(torch.equal(p.grad, e) for p, e in zip(plain.parameters(), expected, strict=True))
    return seen, len(ddp.reducer.buckets), bf16_ok


def test_comm_hooks_see_torchs_gradbucket_api_and_bf16_rounds_as_promised():
    for seen, n_buckets, bf16_ok in mdp.spawn(hooks, 2, timeout=60):
        assert [s[0] for s in seen] == list(range(n_buckets)) and n_buckets > 1
        assert [s[1] for s in seen] == [False] * (n_buckets - 1) + [True]
        assert sum(s[3] for s in seen) == 3 * (8 * 8 + 8) + 8 * 2 + 2
        assert all(s[4] for s in seen)  # gradients(): views of buffer(), shaped as parameters
        assert bf16_ok


def traced(world):
    ddp = mdp.DDP(mdp.FullMLP(8, 3), bucket_cap_mb=0.0005)
    ddp(torch.randn(4, 8)).sum().backward()  # first backward: one bucket; then rebuilt
    trace.start()
    ddp(torch.randn(4, 8)).sum().backward()
    spans = trace.stop().spans
    comm = [(s.name, s.args["bucket"], s.args["bytes"]) for s in spans if s.track == "comm"]
    waits = [s.name for s in spans if s.track == "comm_wait"]
    expected = [(f"allreduce bucket {b.index}", b.index, b.nbytes) for b in ddp.reducer.buckets]
    # a bucket all-reduced at once, inside backward, is a wait of its own (reducer.at_once)
    at_once = [f"wait bucket {k}" for k, now in enumerate(ddp.reducer.now) if now]
    return (sorted(comm) == sorted(expected), waits, at_once,
            all(s.end >= s.start for s in spans))


def test_trace_records_each_bucket_from_launch_to_completion_and_the_final_wait():
    for same, waits, at_once, ordered in mdp.spawn(traced, 2, timeout=60):
        assert at_once  # the last bucket, at least
        assert same and waits == at_once + ["wait comm"] and ordered
