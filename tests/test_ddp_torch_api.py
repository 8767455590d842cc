"""What PyTorch users do with a DDP object beyond forward and backward (issue 30), each case run
with microddp's and PyTorch's DistributedDataParallel side by side (same seed, same data), on
2 and 3 ranks: pickling and deep-copying, double backward, _set_static_graph(),
_get_ddp_logging_data(), and the calls Lightning and Accelerate make on the wrapper."""

import copy
import io
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import microddp as mdp
from microddp import MicroDDPError
from microddp.dp.double_backward import DOUBLE_BACKWARD_WARNING
from microddp.dp.refusals import TORCH_NAMES

ENGINES = ("microddp", "torch")


def make(engine, model, **kwargs):
    cls = mdp.DDP if engine == "microddp" else nn.parallel.DistributedDataParallel
    return cls(model, **kwargs)


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3))


def data(world, step):
    g = torch.Generator().manual_seed(100 * step + world.rank)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def train(ddp, world, steps, first=0):
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(first, first + steps):
        x, y = data(world, step)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()


def state(ddp):
    return [t.detach().clone() for p in ddp.module.parameters() for t in (p, p.grad)]


def same(a, b):
    return len(a) == len(b) and all(x is y if x is None or y is None else torch.equal(x, y)
                                    for x, y in zip(a, b, strict=True))


def pickled(world, engine, how):
    ddp = make(engine, mlp())
    train(ddp, world, 2)
    if how == "torch.save":
        buf = io.BytesIO()
        torch.save(ddp, buf)
        buf.seek(0)
        ddp = torch.load(buf, weights_only=False)
    else:
        ddp = copy.deepcopy(ddp)
    train(ddp, world, 3, first=2)  # the copy trains on, with a fresh reducer
    return state(ddp)


def double_backward(world, engine, case):
    if case == "autograd.grad penalty":  # WGAN-GP: penalty on the gradient wrt the inputs
        ddp = make(engine, mlp())
        for step in range(3):
            x, y = data(world, step)
            x.requires_grad_(True)
            out = ddp(x)
            (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
            loss = nn.functional.cross_entropy(out, y) + ((g.norm(dim=1) - 1) ** 2).mean()
            ddp.zero_grad()
            loss.backward()
        return state(ddp), []
    # backward(create_graph=True), then a penalty on the averaged parameter gradients. torch
    # 2.13's DDP runs this only when each bucket holds one parameter (a tiny cap, buckets fixed
    # by find_unused_parameters); with more, it fails in its bucket copy.
    ddp = make(engine, mlp(), find_unused_parameters=True, bucket_cap_mb=1e-6)
    x, y = data(world, 0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        nn.functional.cross_entropy(ddp(x), y).backward(create_graph=True)
    averaged = [p.grad.detach().clone() for p in ddp.parameters()]
    penalty = sum((p.grad ** 2).sum() for p in ddp.parameters())
    ddp.zero_grad(set_to_none=True)
    penalty.backward()
    messages = [str(w.message) for w in seen if "DistributedDataParallel" in str(w.message)]
    return averaged + [p.grad.clone() for p in ddp.parameters()], messages


class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.never = nn.Linear(6, 8), nn.Linear(8, 3), nn.Linear(8, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def static_later(world, engine, late=True):
    ddp = make(engine, WithUnused(), static_graph=not late)
    if late:
        ddp._set_static_graph()
    train(ddp, world, 3)
    return [None if t is None else t.detach().clone() for p in ddp.module.parameters()
            for t in (p, p.grad)]


# Keys whose values both DDPs must agree on (times and the port differ by nature).
LOGGED_ALIKE = ("world_size", "rank", "module_name", "device_ids", "output_device",
                "broadcast_buffers", "bucket_cap_bytes", "find_unused_parameters",
                "gradient_as_bucket_view", "backend_name", "dtypes", "total_parameter_size_bytes",
                "num_parameter_tensors", "is_multi_device_module", "has_sync_bn", "iteration",
                "num_buckets_reduced", "unused_parameter_size", "has_rebuilt_buckets",
                "bucket_sizes", "rebuilt_bucket_sizes", "rebuilt_per_bucket_param_indices",
                "master_addr", "cuda_visible_devices", "gloo_num_threads",
                "prev_iteration_grad_ready_order_indices")
TIMES = ("forward_compute_time", "backward_compute_time", "backward_comm_time",
         "avg_forward_compute_time", "avg_backward_compute_time", "avg_backward_comm_time")


def logged(world, engine):
    ddp = make(engine, mlp(), bucket_cap_mb=0.001)  # several buckets after the rebuild
    ddp._set_ddp_runtime_logging_sample_rate(2)
    train(ddp, world, 3)
    return ddp._get_ddp_logging_data()


def lightning_manual_backward(ddp, output):
    """What Lightning's prepare_for_backward does in manual optimization."""
    if torch.is_grad_enabled() and ddp.require_backward_grad_sync:
        ddp.require_forward_param_sync = True
        ddp.reducer._rebuild_buckets()
        ddp.reducer.prepare_for_backward([])


def frameworks(world, engine):
    """Lightning's manual optimization and Accelerate's trigger_sync_in_backward."""
    ddp = make(engine, mlp())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(4):
        x, y = data(world, step)
        opt.zero_grad()
        if step % 2 == 0:  # Lightning: the forward does not sync, manual_backward prepares
            ddp.require_backward_grad_sync = False
            out = ddp(x)
            ddp.require_backward_grad_sync = True
            lightning_manual_backward(ddp, out)
            nn.functional.cross_entropy(out, y).backward()
        else:  # Accelerate: a forward under no_sync, then a backward forced to sync
            with ddp.no_sync():
                loss = nn.functional.cross_entropy(ddp(x), y)
                ddp.require_backward_grad_sync = ddp.require_forward_param_sync = True
                ddp.reducer.prepare_for_backward([])
                loss.backward()
        opt.step()
    ddp._check_reducer_finalized()
    return state(ddp), (ddp.join_device, ddp.bucket_bytes_cap, ddp.device_type,
                        ddp._distributed_rank, ddp.will_sync_module_buffers())


def builtin_hook(world, engine):
    ddp = make(engine, mlp())
    ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    train(ddp, world, 3)
    return state(ddp)


def every_case(world):
    out = {}
    for how in ("torch.save", "copy.deepcopy"):
        out[f"pickle {how}"] = same(*(pickled(world, e, how) for e in ENGINES))
    for case in ("autograd.grad penalty", "backward(create_graph=True)"):
        (ours, warned), (theirs, _) = (double_backward(world, e, case) for e in ENGINES)
        out[f"double {case}"] = same(ours, theirs)
        out[f"warned {case}"] = warned
    ours, theirs = (static_later(world, e) for e in ENGINES)
    out["_set_static_graph is static_graph=True"] = same(ours, static_later(world, "microddp",
                                                                           late=False))
    out["_set_static_graph vs torch"] = max((a - b).abs().max().item() for a, b in
                                            zip(ours, theirs, strict=True) if a is not None)
    ours, theirs = (logged(world, e) for e in ENGINES)
    out["logging alike"] = {k: (ours.get(k), theirs.get(k)) for k in LOGGED_ALIKE
                            if ours.get(k) != theirs.get(k)}
    out["logging times"] = all(isinstance(ours[k], int) and ours[k] > 0 for k in TIMES)
    (s1, facts1), (s2, facts2) = (frameworks(world, e) for e in ENGINES)
    out["frameworks"] = same(s1, s2) and facts1 == facts2
    out["builtin hook"] = same(*(builtin_hook(world, e) for e in ENGINES))
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_what_users_do_with_a_ddp_object_matches_torch(n):
    for out in mdp.spawn(every_case, n, timeout=240):
        assert out.pop("warned autograd.grad penalty") == []  # no double backward through DDP
        assert out.pop("warned backward(create_graph=True)") == [DOUBLE_BACKWARD_WARNING]
        assert out.pop("logging alike") == {}
        # static_graph=True itself (constructor or _set_static_graph alike) differs from torch by
        # one rounding (4.7e-10 in one weight) on 3 ranks with an unused parameter: not this
        # issue's, left for the static_graph path
        assert out.pop("_set_static_graph vs torch") <= (0 if n == 2 else 1e-9)
        assert out == dict.fromkeys(out, True)
        assert len(out) == 8


def refusals(world):
    ddp = mdp.DDP(mlp())
    bare = []
    for name in sorted(TORCH_NAMES):
        try:
            getattr(ddp, name)
        except MicroDDPError:
            continue
        except AttributeError:
            bare.append(name)
    for name in ("_prepare_for_backward_that_torch_lacks",):
        assert not hasattr(ddp, name)  # an unknown name stays a plain AttributeError
    messages = {}
    for call in ("_module_copies", "logger", "_update_process_group"):
        try:
            getattr(ddp, call)
        except MicroDDPError as e:
            messages[call] = str(e)
    try:
        ddp.reducer._set_static_graph()
    except MicroDDPError as e:
        messages["reducer"] = str(e)
    ddp(data(world, 0)[0]).sum().backward()
    try:
        ddp._set_static_graph()
    except MicroDDPError as e:
        messages["late static"] = str(e)
    try:
        ddp._set_ddp_runtime_logging_sample_rate(0)
    except MicroDDPError as e:
        messages["rate"] = str(e)
    return bare, messages


def test_every_torch_ddp_name_works_or_says_what_to_do():
    for bare, messages in mdp.spawn(refusals, 2, timeout=90):
        assert bare == []
        assert messages["_module_copies"].endswith("use ddp.module")
        assert "ddp._get_ddp_logging_data()" in messages["logger"]
        assert "process_group=new_group" in messages["_update_process_group"]
        assert messages["reducer"].startswith("reducer._set_static_graph exists in PyTorch's")
        assert messages["late static"].startswith("_set_static_graph() should be called before "
                                                  "training loop starts: before the first "
                                                  "forward")
        assert "at least 1" in messages["rate"]
