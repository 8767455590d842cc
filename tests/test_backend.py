"""The "microddp" torch.distributed backend against gloo: unchanged torch DDP training, every
op it carries through shared memory, the ops it hands to gloo, a killed rank, /dev/shm clean.

Each rank runs plain torch.distributed code (`mdp.spawn(..., join=False)` gives it torchrun's
environment only): `init_process_group("microddp")`, then the same calls on a gloo group made
beside it, compared bit for bit.
"""

import os
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import microddp as mdp
from killed_rank import survivors
from microddp.backend import MicroDDPProcessGroup
from microddp.shm import segment as transport

SLOT, SMALL = 1024, 256  # bytes: small thresholds, so small tensors cross every path
TIMEOUT = timedelta(seconds=60)


pytestmark = pytest.mark.usefixtures("dev_shm_clean")


@pytest.fixture
def small_buffers(monkeypatch):
    monkeypatch.setenv("MICRODDP_SHM_SLOT_BYTES", str(SLOT))
    monkeypatch.setenv("MICRODDP_SHM_SMALL_BYTES", str(SMALL))


def _init(**kwargs) -> tuple[MicroDDPProcessGroup, dist.ProcessGroup]:
    """The world on the microddp backend, and a gloo group of the same ranks (the reference)."""
    import microddp.backend  # noqa: F401 (registers the backend, as a user's script does)

    dist.init_process_group("microddp", timeout=TIMEOUT, **kwargs)
    world = dist.group.WORLD
    assert isinstance(world, MicroDDPProcessGroup) and dist.get_backend() == "microddp"
    return world, dist.new_group(backend="gloo", timeout=TIMEOUT)


def _steps(pg: MicroDDPProcessGroup) -> int:
    """Collectives this group has run through shared memory."""
    return pg.shared.seq if pg.shared is not None else 0


# -- torch's own DDP, unchanged -------------------------------------------------------------------

def _train(group, rank: int, steps: int = 4, **ddp) -> list[torch.Tensor]:
    torch.manual_seed(0)  # the same start on every rank and both backends
    model = torch.nn.parallel.DistributedDataParallel(mdp.FullMLP(64, 4), process_group=group,
                                                      bucket_cap_mb=0.01, **ddp)  # a few buckets
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        opt.zero_grad()
        x, y = torch.randn(16, 64, generator=g), torch.randint(0, 2, (16,), generator=g)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _ddp(rank: int) -> tuple[bool, float, dict, bool]:
    world, gloo = _init()
    ours = _train(None, rank)  # the default group: the microddp backend
    calls = dict(world.calls)
    ref = _train(gloo, rank)
    diff = max((a - b).abs().max().item() for a, b in zip(ours, ref, strict=True))
    same = all(map(torch.equal, ours, ref))
    # find_unused_parameters: every step also all-reduces which parameters had a gradient
    unused = all(map(torch.equal, _train(None, rank, 2, find_unused_parameters=True),
                     _train(gloo, rank, 2, find_unused_parameters=True)))
    dist.destroy_process_group()
    return same, diff, calls, unused


@pytest.mark.parametrize("n,forced", [(2, False), (3, False), (3, True)])
def test_torch_ddp_on_microddp_ends_with_gloos_parameters(n, forced, monkeypatch):
    if forced:  # float sums on 3 ranks through shared memory too: another order of addition
        monkeypatch.setenv("MICRODDP_TRANSPORT", "shm")
    buckets = "shm" if n == 2 or forced else "gloo"  # 3 ranks: float sums stay on gloo
    for same, diff, calls, unused in mdp.spawn(_ddp, n, join=False, timeout=180):
        assert unused or forced  # (forced: another order of addition, diff checked below)
        # construction: rank 0's state broadcast, every rank's shapes gathered; then buckets
        assert set(calls) == {("broadcast", "shm"), ("allgather", "shm"), ("allreduce", buckets)}
        assert calls["allreduce", buckets] >= 4 * 2  # 4 steps, several buckets each
        if forced:
            assert diff < 1e-5
        else:  # 2 ranks: x0 + x1 is gloo's sum to the bit; 3: gloo's own sums
            assert same, diff


# -- every op it carries, against gloo's ----------------------------------------------------------

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32,
          torch.uint8]
OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "min": dist.ReduceOp.MIN,
       "max": dist.ReduceOp.MAX, "product": dist.ReduceOp.PRODUCT}


def _values(seed: int, numel: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if op == "product":  # factors of 1, 2 and -1 stay in range
        return torch.tensor([1, 2, -1])[torch.randint(0, 2 if dtype == torch.uint8 else 3,
                                                      (numel,), generator=g)].to(dtype)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(0 if dtype == torch.uint8 else -20, 20, (numel,), generator=g).to(dtype)


def _numels(esize: int, n: int) -> list[int]:
    """Around every threshold: the one-synchronisation limit, a slot, several slots."""
    out = {1, n + 1}
    for limit in (SMALL, SLOT, 3 * SLOT, SLOT // n):
        k = limit // esize
        out |= {max(1, k - 1), k, k + 1}
    return sorted(out)


def _every_op(rank: int) -> tuple[list[str], int]:
    world, gloo = _init()
    n = dist.get_world_size()
    wrong = []
    before = _steps(world)
    for dtype in DTYPES:
        esize = torch.empty(0, dtype=dtype).element_size()
        for numel in _numels(esize, n):
            for name, op in OPS.items():
                if name == "avg" and not dtype.is_floating_point:
                    continue
                x = _values(1000 * rank + numel, numel, dtype, name)
                mine, ref = x.clone(), x.clone()
                work = dist.all_reduce(mine, op, async_op=True)
                got = work.get_future().wait()  # DDP's way: the future holds the outputs
                if name == "avg":  # gloo has no AVG: its sum, divided
                    dist.all_reduce(ref, group=gloo)
                    ref.div_(n)
                else:
                    dist.all_reduce(ref, op, group=gloo)
                if not (torch.equal(mine, ref) and got[0] is mine):
                    wrong.append(f"all_reduce {name} {dtype} {numel}")
            x = _values(rank + numel, numel, dtype, "sum")
            for root in range(n):
                mine, ref = x.clone(), x.clone()
                dist.broadcast(mine, root)
                dist.broadcast(ref, root, group=gloo)
                if not torch.equal(mine, ref):
                    wrong.append(f"broadcast {root} {dtype} {numel}")
            mine = [torch.empty_like(x) for _ in range(n)]
            ref = [torch.empty_like(x) for _ in range(n)]
            dist.all_gather(mine, x.view(-1, 1).squeeze(1))
            dist.all_gather(ref, x, group=gloo)
            if not all(map(torch.equal, mine, ref)):
                wrong.append(f"all_gather {dtype} {numel}")
            inputs = [_values(10 * rank + i, numel, dtype, "sum") for i in range(n)]
            mine, ref = torch.empty_like(x), torch.empty_like(x)
            dist.reduce_scatter(mine, inputs, op=dist.ReduceOp.MAX)
            dist.reduce_scatter(ref, [t.clone() for t in inputs], op=dist.ReduceOp.MAX,
                                group=gloo)
            if not torch.equal(mine, ref):
                wrong.append(f"reduce_scatter max {dtype} {numel}")
            if not dtype.is_floating_point or n == 2:  # float sums: gloo's order on 3
                dist.reduce_scatter(mine, inputs)
                dist.reduce_scatter(ref, inputs, group=gloo)
                if not torch.equal(mine, ref):
                    wrong.append(f"reduce_scatter sum {dtype} {numel}")
    dist.barrier()
    used = _steps(world) - before
    dist.destroy_process_group()
    return wrong, used


@pytest.mark.parametrize("n", [2, 3])
def test_every_op_equals_gloos_around_the_thresholds(n, small_buffers):
    for wrong, used in mdp.spawn(_every_op, n, join=False, timeout=240):
        assert wrong == []
        assert used > 500  # they went through shared memory, not gloo


def _defaults(rank: int) -> list[str]:
    """At the default thresholds (a 4 MiB slot): float32 sums and broadcasts around it."""
    world, gloo = _init()
    slot = world.shared.slot // 4
    wrong = []
    for numel in (slot - 1, slot, slot + 1, 2 * slot + 3):
        x = _values(rank, numel, torch.float32, "sum")
        mine, ref = x.clone(), x.clone()
        dist.all_reduce(mine)
        dist.all_reduce(ref, group=gloo)
        b = x.clone()
        dist.broadcast(b, 1)
        wrong += [numel] * (not torch.equal(mine, ref) or not torch.equal(b, x if rank else b))
    dist.destroy_process_group()
    return wrong


def test_default_thresholds_on_two_ranks():
    assert mdp.spawn(_defaults, 2, join=False, timeout=120) == [[], []]


def _asynchronous(rank: int) -> tuple[bool, bool, list[float]]:
    """An async all_reduce returns before its peer has even called it: the call runs on the
    group's lane while this rank goes on (what DDP's overlap needs)."""
    _init()
    store = dist.distributed_c10d._get_default_store()
    t = torch.full((1000,), float(rank + 1))
    pending = done = True
    if rank == 0:
        work = dist.all_reduce(t, async_op=True)
        pending = not work.get_future().done()  # rank 1 has not called it yet: it cannot be
        store.set("go", "1")
        work.wait()
        done = work.get_future().done()
    else:
        store.wait(["go"], TIMEOUT)
        dist.all_reduce(t)
    dist.destroy_process_group()
    return pending, done, t[:2].tolist()


def test_an_async_call_returns_at_once_and_completes_on_wait():
    for pending, done, t in mdp.spawn(_asynchronous, 2, join=False, timeout=120):
        assert pending and done and t == [3.0, 3.0]


# -- what it hands to gloo ------------------------------------------------------------------------

def _fallbacks(rank: int) -> dict[str, bool]:
    world, _ = _init()
    n = dist.get_world_size()
    out = {}
    t = torch.arange(6.0).view(2, 3).t()  # not contiguous: gloo's
    before = _steps(world)
    dist.all_reduce(t)
    out["all_reduce, not contiguous"] = torch.equal(t, n * torch.arange(6.0).view(2, 3).t())
    flags = torch.tensor([rank == 0, True])
    dist.all_reduce(flags, dist.ReduceOp.MAX)  # bool: a dtype shared memory does not carry
    out["all_reduce, bool"] = flags.tolist() == [True, True]
    out["nothing through shared memory"] = _steps(world) == before
    out["both counted as gloo's"] = world.calls == {("allreduce", "gloo"): 2}
    try:  # an op microddp does not know: refused by gloo, as on a gloo group
        dist.all_reduce(torch.ones(2), op=dist._make_nccl_premul_sum(2.0))
        out["PREMUL_SUM refused as gloo refuses it"] = False
    except (RuntimeError, ValueError) as e:
        out["PREMUL_SUM refused as gloo refuses it"] = "PREMUL_SUM" in str(e)
    x = torch.full((4,), float(rank + 1))
    dist.reduce(x, dst=0)
    out["reduce"] = rank != 0 or x.tolist() == [n * (n + 1) / 2] * 4
    gathered = [torch.empty(2) for _ in range(n)] if rank == 0 else None
    dist.gather(torch.full((2,), float(rank)), gathered, dst=0)
    out["gather"] = rank != 0 or [g[0].item() for g in gathered] == list(range(n))
    got = torch.empty(3)
    dist.scatter(got, [torch.full((3,), float(r)) for r in range(n)] if rank == 0 else None, src=0)
    out["scatter"] = got.tolist() == [float(rank)] * 3
    whole = torch.empty(2 * n)
    dist.all_gather_into_tensor(whole, torch.full((2,), float(rank)))
    out["all_gather_into_tensor"] = whole.tolist() == [float(r) for r in range(n) for _ in "ab"]
    part = torch.empty(2)
    dist.reduce_scatter_tensor(part, torch.arange(2.0 * n))
    out["reduce_scatter_tensor"] = part.tolist() == [n * (2.0 * rank), n * (2.0 * rank + 1)]
    a2a = torch.empty(n)
    dist.all_to_all_single(a2a, torch.arange(n, dtype=torch.float32) + 10 * rank)
    out["all_to_all_single"] = a2a.tolist() == [10.0 * r + rank for r in range(n)]
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": rank})
    out["all_gather_object"] = objs == [{"rank": r} for r in range(n)]
    msg = torch.zeros(2)
    if rank == 0:
        dist.send(torch.tensor([4.0, 2.0]), dst=1)
    elif rank == 1:
        dist.recv(msg, src=0)
    out["send/recv"] = rank != 1 or msg.tolist() == [4.0, 2.0]
    pair = dist.new_group([0, 1], backend="microddp")  # a sub-group of the same backend
    if rank < 2:
        y = torch.full((3,), float(rank + 1))
        dist.all_reduce(y, group=pair)
        out["sub-group all_reduce"] = y.tolist() == [3.0] * 3 and _steps(pair) > 0
    dist.barrier()
    dist.destroy_process_group()
    return out


def test_what_shared_memory_does_not_carry_goes_to_gloo():
    for out in mdp.spawn(_fallbacks, 3, join=False, timeout=120):
        assert out and all(out.values()), out


def _gloo_only(rank: int, hosts: bool) -> tuple[bool, list[float], bool]:
    if hosts:  # as if each rank were on a host of its own: a host identity per rank
        transport.host_identity = lambda: f"host-{rank}"
    world, gloo = _init()
    t = torch.ones(3)
    dist.all_reduce(t)
    same = all(map(torch.equal, _train(None, rank, 2), _train(gloo, rank, 2)))
    dist.destroy_process_group()
    return world.shared is None, t.tolist(), same


@pytest.mark.parametrize("why", ["MICRODDP_TRANSPORT=gloo", "ranks on other hosts"])
def test_without_shared_memory_everything_goes_to_gloo(why, monkeypatch):
    if why.startswith("MICRODDP"):
        monkeypatch.setenv("MICRODDP_TRANSPORT", "gloo")
    for no_shm, t, same in mdp.spawn(_gloo_only, 2, args=(why.startswith("ranks"),),
                                     join=False, timeout=120):
        assert no_shm and t == [2.0, 2.0, 2.0] and same


def _twice(rank: int, folder: str) -> list[float]:
    """A world made, destroyed and made again in one process (its groups' names come back)."""
    out = []
    for i in range(2):
        # a store of its own each time: through MASTER_PORT, a rank quick to come back could
        # join the first world's store before its rank 0 has closed it
        world, _ = _init(init_method=f"file://{folder}/store{i}", rank=rank,
                         world_size=int(os.environ["WORLD_SIZE"]))
        t = torch.full((5,), float(rank + i))
        dist.all_reduce(t)
        out.append(t[0].item() if _steps(world) > 0 else -1.0)
        dist.destroy_process_group()
    return out


def test_a_world_made_again_sets_up_fresh_shared_memory(tmp_path):
    assert mdp.spawn(_twice, 2, args=(str(tmp_path),), join=False, timeout=120) == [[1.0, 3.0]] * 2


# -- a killed rank --------------------------------------------------------------------------------

def _doomed(rank: int, world_size: int, store: str, results) -> None:
    import microddp.backend  # noqa: F401

    dist.init_process_group("microddp", init_method=f"file://{store}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=30))
    t = torch.ones(1000, dtype=torch.int64)
    dist.all_reduce(t)
    if rank == world_size - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        dist.all_reduce(t)
        results.put((rank, "ok", ""))
    except Exception as e:  # noqa: BLE001 (what the survivor saw, sent to the test)
        results.put((rank, type(e).__name__, str(e)))
    results.close()
    results.join_thread()
    os._exit(0)  # the group cannot be left cleanly with a rank gone


def test_a_killed_rank_makes_the_survivors_raise(tmp_path):
    codes, out = survivors(_doomed, (3, str(tmp_path / "store")))  # the group's timeout is 30 s
    assert codes[2] == -signal.SIGKILL
    assert sorted(out) == [0, 1], out
    for kind, text in out.values():
        # PeerError: the MicroDDPError for another rank's failure (exit code 1, restartable)
        assert kind == "PeerError" and "rank(s) [2]" in text, (kind, text)


# -- a plain script under the launchers -----------------------------------------------------------

SCRIPT = '''\
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import microddp.backend  # noqa: F401

dist.init_process_group("microddp")
torch.manual_seed(0)
model = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    opt.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
calls = dist.group.WORLD.calls
if dist.get_rank() == 0:
    print("backend", dist.get_backend(), "bucket all-reduces through shm",
          calls["allreduce", "shm"])
dist.destroy_process_group()
'''


@pytest.mark.parametrize("launcher", ["microddp run -n 2", "torchrun --standalone --nproc-per-node 2"])
def test_an_unchanged_script_runs_under_microddp_run_and_torchrun(launcher, tmp_path):
    (tmp_path / "ddp.py").write_text(SCRIPT)
    first, *rest = launcher.split()
    exe = Path(sys.executable).parent / first  # this venv's microddp or torchrun
    out = subprocess.run([str(exe), *rest, "ddp.py"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "backend microddp bucket all-reduces through shm 3" in out.stdout, out.stdout


# -- a future's callback that waits on another call of the group ---------------------------------

def _nested(rank: int, through: str) -> tuple[list, list]:
    """What torch's PowerSGD and quantization hooks do: inside a callback of one async call's
    future, start another call on the same group and wait for it. The callback used to run on
    the group's lane thread, the only thread that could run the second call: both ranks hung
    for good (Future.wait has no timeout)."""
    if through == "backend":
        _init()
        start = lambda t: dist.all_reduce(t, async_op=True)  # noqa: E731
    else:  # microddp.comms on shared memory, as microddp's DDP with a comm hook
        mdp.init(timeout=60, rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
        start = lambda t: mdp.comms.all_reduce(t, async_op=True)  # noqa: E731
    t, t2 = torch.ones(4), torch.full((4,), float(rank))
    got = start(t).get_future().then(lambda f: start(t2).get_future().wait()[0]).wait()
    out = t.tolist(), got.tolist()
    if through == "backend":
        dist.destroy_process_group()
    else:
        mdp.shutdown()
    return out


@pytest.mark.parametrize("through", ["backend", "comms"])
def test_a_callback_may_wait_on_another_call_of_its_group(through):
    for t, got in mdp.spawn(_nested, 2, args=(through,), join=False, timeout=90):
        assert t == [2.0] * 4 and got == [1.0] * 4
