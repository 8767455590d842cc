"""The shared-memory transport against gloo: every op and dtype, around every threshold, on 2, 3
and 4 ranks; many calls back to back; groups at once; a killed rank; nothing left in /dev/shm.

Small thresholds (MICRODDP_SHM_SLOT_BYTES, MICRODDP_SHM_SMALL_BYTES) let small tensors cross
every path: one synchronisation, reduce-scatter then gather, chunks beyond the buffer. One test
keeps the defaults, at sizes around them.
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist

import microddp as mdp
from killed_rank import survivors
from microddp import collectives as C
from microddp import comms
from microddp.shm import attach as shm_attach
from microddp.shm import collectives as shm
from microddp.shm import group as shm_group
from microddp.shm import segment as transport
from shm_leftovers import PLANTED

SLOT, SMALL = 1024, 256  # bytes, for the threshold tests
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64,
          torch.int8, torch.uint8]
OPS = ["sum", "avg", "product", "min", "max"]


# Nothing left in /dev/shm after each test (shm_leftovers.py); the segments the sweep tests
# below plant on purpose end in PLANTED, which that check ignores: with xdist, a test on
# another worker may plant one while this test runs (a killed-rank test once failed on one).
pytestmark = pytest.mark.usefixtures("dev_shm_clean")


@pytest.fixture
def small_buffers(monkeypatch):
    monkeypatch.setenv("MICRODDP_SHM_SLOT_BYTES", str(SLOT))
    monkeypatch.setenv("MICRODDP_SHM_SMALL_BYTES", str(SMALL))


def _values(rank: int, numel: int, dtype: torch.dtype, op: str, exact: bool) -> torch.Tensor:
    """Per-rank inputs. `exact`: small integers (any summation order gives the same bits);
    else random floats (the order matters: only 2 ranks are compared bit for bit)."""
    g = torch.Generator().manual_seed(1000 * rank + numel)
    if op == "product":  # stay in range: factors of 1 and 2 and -1
        return torch.tensor([1, 2, -1], dtype=torch.float64)[
            torch.randint(0, 3 if dtype != torch.uint8 else 2, (numel,), generator=g)].to(dtype)
    if dtype.is_floating_point and not exact:
        return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)
    low = 0 if dtype == torch.uint8 else -20
    return torch.randint(low, 20, (numel,), generator=g).to(dtype)


def _numels(esize: int, slot: int, small: int, n: int) -> list[int]:
    """Around every threshold: the small path's limit, a slot, several slots, fewer elements
    than ranks."""
    out = {1, max(1, n - 1)}
    for limit in (small, slot, 3 * slot, slot // n):
        k = limit // esize
        out |= {max(1, k - 1), k, k + 1}
    return sorted(out)


def _against_gloo(world, exact: bool, dtypes, ops, slot=SLOT, small=SMALL):
    """(case, equal bit for bit, max relative error) for every case, shm vs gloo."""
    n = world.world_size
    out = []
    for dtype in dtypes:
        esize = torch.empty(0, dtype=dtype).element_size()
        for op in ops:
            if op == "avg" and not dtype.is_floating_point:
                continue
            for numel in _numels(esize, slot, small, n):
                x = _values(world.rank, numel, dtype, op, exact)
                ref = x.clone()
                if op == "avg":
                    dist.all_reduce(ref)
                    ref.div_(n)
                else:
                    dist.all_reduce(ref, comms.REDUCE_OPS[op])
                mine = x.clone()
                if n == 2:
                    comms.all_reduce(mine, op)  # the default path: shared memory on one host
                else:  # on 3+ ranks comms keeps gloo for float sums: the algorithm itself
                    C.shm_all_reduce(mine, op)
                d = (mine.double() - ref.double()).abs().max().item()
                scale = max(ref.double().abs().max().item(), 1e-30)
                out.append((f"{dtype} {op} {numel}", torch.equal(mine, ref), d / scale,
                            dtype in (torch.float16, torch.bfloat16)))
    state = shm.shared(None)
    return out, state is not None and state.group.seq > 0


def _every_case(world, exact):
    return _against_gloo(world, exact, DTYPES, OPS)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_equal_to_gloo_every_op_and_dtype_around_thresholds(n, small_buffers):
    for cases, used in mdp.spawn(_every_case, n, args=(True,), timeout=240):
        assert used, "comms.all_reduce did not take the shared-memory path"
        assert [c for c, same, _, _ in cases if not same] == []


def test_bit_identical_to_gloo_for_random_floats_on_two_ranks(small_buffers):
    for cases, _ in mdp.spawn(_every_case, 2, args=(False,), timeout=240):
        assert [c for c, same, _, _ in cases if not same] == []


def test_random_floats_on_three_ranks_match_gloo_to_rounding(small_buffers):
    for cases, _ in mdp.spawn(_every_case, 3, args=(False,), timeout=240):
        # in another order, each addition rounds differently: to float16's or bfloat16's
        # precision there, float32's or better elsewhere
        bad = [(c, rel) for c, _, rel, half in cases if rel > (2e-2 if half else 1e-6)]
        assert bad == []


def _results(world):
    """Every float op's result at sizes around the thresholds, through shared memory."""
    out = {}
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        esize = torch.empty(0, dtype=dtype).element_size()
        for op in OPS:
            for numel in _numels(esize, SLOT, SMALL, world.world_size):
                x = _values(world.rank, numel, dtype, op, exact=False)
                C.shm_all_reduce(x, op)
                out[f"{dtype} {op} {numel}"] = x
    return out


@pytest.mark.parametrize("n", [3, 4])
def test_every_rank_gets_the_same_bits_for_random_floats(n, small_buffers):
    # Ranks 0 and 1 add in place, starting from their own input (x1 + x0 on rank 1), later
    # ranks from x0 + x1: the same bits only because addition, multiplication, min and max
    # commute exactly, which this checks on every path.
    first, *others = mdp.spawn(_results, n, timeout=240)
    for rank, results in enumerate(others, start=1):
        assert [k for k, v in first.items() if not torch.equal(v, results[k])] == [], rank


def _defaults(world):
    slot = shm_group.SLOT_BYTES
    return _against_gloo(world, False, [torch.float32], ["sum"], slot, slot)


def test_default_thresholds_on_two_ranks():
    for cases, used in mdp.spawn(_defaults, 2, timeout=180):
        assert used and [c for c, same, _, _ in cases if not same] == []


def _which_path(world):
    """What comms.all_reduce takes on this group, by dtype and op: did shared memory move it?"""
    out = {}
    for dtype, op in ((torch.float32, "sum"), (torch.float32, "avg"), (torch.float32, "max"),
                      (torch.int64, "sum"), (torch.bfloat16, "product")):
        before = shm.shared(None).group.seq
        t = torch.ones(4, dtype=dtype)
        comms.all_reduce(t, op)
        out[f"{dtype} {op}"] = shm.shared(None).group.seq > before
    return out


@pytest.mark.parametrize("n,forced", [(2, False), (3, False), (3, True)])
def test_comms_keeps_gloo_where_shared_memory_would_change_the_bits(n, forced, monkeypatch):
    if forced:
        monkeypatch.setenv("MICRODDP_TRANSPORT", "shm")
    everywhere = n == 2 or forced  # x0 + x1 is gloo's result; on 3+ ranks only if asked
    for out in mdp.spawn(_which_path, n, timeout=60):
        assert out == {"torch.float32 sum": everywhere, "torch.float32 avg": everywhere,
                       "torch.float32 max": True, "torch.int64 sum": True,
                       "torch.bfloat16 product": everywhere}


def _other_collectives(world):
    n, r = world.world_size, world.rank
    out = {}
    for numel in (1, 7, SLOT // 4 - 1, 3 * SLOT // 4 + 5):
        x = _values(r, numel, torch.float32, "sum", True)
        inputs = [_values(r + 10 * i, numel, torch.float32, "sum", True) for i in range(n)]
        got, ref = torch.empty(numel), torch.empty(numel)
        C.shm_reduce_scatter(got, inputs)
        dist.reduce_scatter(ref, [t.clone() for t in inputs])
        out[f"reduce_scatter {numel}"] = torch.equal(got, ref)
        gathered, ref_list = [torch.empty(numel) for _ in range(n)], [torch.empty(numel) for _ in range(n)]
        C.shm_all_gather(gathered, x)
        dist.all_gather(ref_list, x)
        out[f"all_gather {numel}"] = all(map(torch.equal, gathered, ref_list))
        b, ref_b = x.clone(), x.clone()
        C.shm_broadcast(b, src=n - 1)
        dist.broadcast(ref_b, src=n - 1)
        out[f"broadcast {numel}"] = torch.equal(b, ref_b)
        a = x.clone()
        C.shm_all_reduce(a, "max", async_op=True).wait()
        ref_a = x.clone()
        dist.all_reduce(ref_a, dist.ReduceOp.MAX)
        out[f"async all_reduce {numel}"] = torch.equal(a, ref_a)
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_reduce_scatter_all_gather_broadcast_equal_gloo(n, small_buffers):
    for out in mdp.spawn(_other_collectives, n, timeout=120):
        assert out and all(out.values()), out


def _back_to_back(world):
    n, r = world.world_size, world.rank
    wrong = 0
    handles = []
    for i in range(1000):
        t = torch.full((1 + i % 300,), float(r + i))
        if i % 3 == 0:  # some asynchronous, waited later: they must keep their order
            handles.append((comms.all_reduce(t, async_op=True), t, i))
        else:
            comms.all_reduce(t)
            wrong += not torch.equal(t, torch.full_like(t, n * i + n * (n - 1) / 2))
    for h, t, i in handles:
        h.wait()
        wrong += not torch.equal(t, torch.full_like(t, n * i + n * (n - 1) / 2))
    return wrong, shm.shared(None).group.seq


def test_a_thousand_calls_back_to_back(small_buffers):
    for wrong, steps in mdp.spawn(_back_to_back, 2, timeout=120):
        assert wrong == 0 and steps >= 1000


def _groups_at_once(world):
    r = world.rank
    pairs = [comms.new_group([0, 1]), comms.new_group([2, 3])]
    odd = comms.new_group([1, 3])
    mine = pairs[r // 2]
    out = []
    names = set()
    for i in range(50):
        a = torch.full((300,), float(r + i))  # 1200 bytes: more than a slot
        b = torch.full((5,), float(10 * r + i))
        ha = comms.all_reduce(a, group=mine, async_op=True)
        comms.all_reduce(b)  # the world's, while the pair's is in flight
        c = torch.full((70,), float(r))
        if r in (1, 3):
            comms.all_reduce(c, group=odd)
        ha.wait()
        partner = r ^ 1
        out.append(torch.equal(a, torch.full_like(a, r + partner + 2.0 * i))
                   and torch.equal(b, torch.full_like(b, 60.0 + 4 * i))
                   and (r not in (1, 3) or torch.equal(c, torch.full_like(c, 4.0))))
    for g in (None, mine, odd if r in (1, 3) else None):
        state = shm.shared(g)
        names.add(state.group.segment.name)
        assert not os.path.exists(state.group.segment.path)  # unlinked once all attached
    return all(out), len(names)


def test_groups_and_sub_groups_at_once_never_share_a_buffer(small_buffers):
    results = mdp.spawn(_groups_at_once, 4, timeout=120)
    assert all(ok for ok, _ in results)
    assert [k for _, k in results] == [2, 3, 2, 3]  # world, its pair, and {1, 3} for ranks 1, 3


def _forced_gloo(world):
    t = torch.ones(3)
    comms.all_reduce(t)
    return shm.shared(None) is None, t.tolist()


def test_microddp_transport_gloo_keeps_gloo(monkeypatch):
    monkeypatch.setenv("MICRODDP_TRANSPORT", "gloo")
    for gloo, t in mdp.spawn(_forced_gloo, 2, timeout=60):
        assert gloo and t == [2.0, 2.0, 2.0]


def test_the_decision_is_by_host_identity_and_the_variable():
    here = {"host": "boot/1:2/3", "want": "auto"}
    assert shm_attach.decide([here, here]) == (True, "")
    assert shm_attach.decide([here, {**here, "host": "other"}]) == (
        False, "the ranks are on different hosts")
    assert shm_attach.decide([here, {**here, "want": "gloo"}])[0] is False
    with pytest.raises(mdp.MicroDDPError, match="MICRODDP_TRANSPORT=shm, but the ranks are on "
                                                "different hosts"):
        shm_attach.decide([{**here, "want": "shm"}, {**here, "host": "other", "want": "shm"}])
    with pytest.raises(mdp.MicroDDPError, match="differs between ranks"):
        shm_attach.decide([{**here, "want": "shm"}, {**here, "want": "gloo"}])
    with pytest.raises(mdp.MicroDDPError, match="settings differ"):
        shm_attach.decide([{**here, "settings": "a"}, {**here, "settings": "b"}])


def test_a_bad_microddp_transport_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("MICRODDP_TRANSPORT", "fast")
    with pytest.raises(mdp.MicroDDPError, match="MICRODDP_TRANSPORT='fast' is not one of"):
        shm_attach.wanted()


def test_sweep_removes_segments_of_dead_processes_only(tmp_path):
    # in a folder of its own: a sweep run by another worker's test cannot take the plant first
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    ns = transport.segment_name().split("-")[2]
    stale = f"{transport.PREFIX}{ns}-{dead.pid}-{PLANTED}00"
    live = f"{transport.PREFIX}{ns}-{os.getpid()}-{PLANTED}01"
    for name in (stale, live):
        (tmp_path / name).touch()
    removed = transport.sweep(str(tmp_path))
    assert stale in removed and live not in removed
    assert not (tmp_path / stale).exists()
    assert (tmp_path / live).exists()


# -- a killed rank: the survivors raise, within the deadline ------------------------------------

def _tolerant_rank(rank, world_size, store, monitor, results):
    os.environ["MICRODDP_SHM_SLOT_BYTES"] = str(SLOT)
    os.environ["MICRODDP_SHM_SMALL_BYTES"] = str(SMALL)
    mdp.init(backend="gloo", init_method=f"file://{store}", rank=rank,
             world_size=world_size, timeout=30, monitor=monitor)
    # integers: shared memory on 3 ranks too (float sums stay on gloo there); 8000 bytes,
    # several chunks of the large path
    t = torch.ones(1000, dtype=torch.int64)
    comms.all_reduce(t)
    if rank == world_size - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        comms.all_reduce(t)
        results.put((rank, "ok", ""))
    except mdp.MicroDDPError as e:
        results.put((rank, "error", str(e)))
    results.close()
    results.join_thread()  # sent before the exit below
    os._exit(0)  # the group cannot be left cleanly with a rank gone


@pytest.mark.parametrize("monitor", [False, True])
def test_a_killed_rank_makes_the_survivors_raise(tmp_path, monitor):
    codes, out = survivors(_tolerant_rank, (3, str(tmp_path / "store"), monitor))  # the group's timeout is 30 s
    assert codes[2] == -signal.SIGKILL
    assert sorted(out) == [0, 1], out
    for status, text in out.values():
        assert status == "error"
        assert "rank(s) [2]" in text, text
        if monitor:
            assert "microddp hang report" in text and "rank 2 did not answer" in text, text


def _ring_and_shm_hooks(world):
    from microddp.dp import wrap

    out = {}
    for hook in ("default", "ring", "shm"):
        params = []
        steps = shm.shared(None).group.seq
        for engine in ("microddp", "torch"):
            torch.manual_seed(0)
            model = wrap(mdp.FullMLP(16, 3), engine)
            if engine == "microddp" and hook != "default":
                model.register_comm_hook(None, hook)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            g = torch.Generator().manual_seed(world.rank)
            for _ in range(3):
                opt.zero_grad()
                model(torch.randn(8, 16, generator=g)).sum().backward()
                opt.step()
            params.append([p.detach().clone() for p in model.parameters()])
        # through shared memory: by default and with "shm"; the ring sends through gloo
        out[hook] = (all(map(torch.equal, *params)), shm.shared(None).group.seq > steps)
    return out


def test_ddp_default_and_ring_and_shm_hooks_match_torch_ddp_bit_for_bit():
    for out in mdp.spawn(_ring_and_shm_hooks, 2, timeout=120):
        assert out == {"default": (True, True), "ring": (True, False), "shm": (True, True)}


def test_the_cost_model_of_the_shm_path_and_its_fit():
    from microddp.collectives.cost import CostModel
    from microddp.predict.calibrate import fit_shm

    m = CostModel(alpha=5e-6, beta=1e-10, gamma=2e-10)
    # small: one synchronisation, one copy in, p-1 reductions of the whole tensor
    assert m.predict("shm_all_reduce", 4096, 2) == pytest.approx(5e-6 + 4096e-10 + 4096 * 2e-10)
    # large: two synchronisations per chunk (of 1 MiB here), copies in and out, p-1 adds of n/p
    n = 3 << 20
    assert m.predict("shm_all_reduce", n, 4, slot=1 << 20) == pytest.approx(
        6 * 5e-6 + 2 * n * 1e-10 + 3 * n / 4 * 2e-10)
    sizes = [1 << 20, 2 << 20, 4 << 20, 8 << 20]
    times = [CostModel(4e-6, 1e-10).shm_all_reduce(s, 2, slot=1 << 30) for s in sizes]
    alpha, bandwidth = fit_shm(sizes, times)
    assert alpha == pytest.approx(4e-6) and bandwidth == pytest.approx(1e10)


def _raise_after_setup(world):
    comms.all_reduce(torch.ones(3))
    if world.rank == 1:
        raise ValueError("boom")
    comms.all_reduce(torch.ones(3))  # rank 0 waits here until spawn stops it


def test_an_exception_leaves_nothing_in_dev_shm():
    # the fixture checks /dev/shm after the job
    with pytest.raises(mdp.MicroDDPError, match="boom"):
        mdp.spawn(_raise_after_setup, 2, timeout=60)


def _sweeps_in(rank, folder):
    # SHM_DIR set before this rank's set-up: its segments and its sweep use a folder no other
    # process sweeps (any microddp job on this machine sweeps /dev/shm, another test's too)
    transport.SHM_DIR = folder
    mdp.init(backend="gloo")
    t = torch.ones(3)
    comms.all_reduce(t)
    taken = shm.shared(None) is not None
    mdp.shutdown()
    return taken, t.tolist(), shm_attach._swept


def test_the_first_set_up_sweeps_away_a_dead_jobs_segment():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    ns = transport.segment_name().split("-")[2]
    folder = tempfile.mkdtemp(prefix="microddp-test-", dir=transport.SHM_DIR)  # tmpfs, as ours
    stale = f"{transport.PREFIX}{ns}-{dead.pid}-{PLANTED}02"
    open(os.path.join(folder, stale), "w").close()
    try:
        # MICRODDP_TRANSPORT unset: shared memory, and its first set-up (rank 0's) sweeps
        (taken, t, swept), (_, _, swept1) = mdp.spawn(_sweeps_in, 2, args=(folder,),
                                                      timeout=60, join=False)
        assert taken and t == [2.0] * 3
        assert swept == [stale] and swept1 is None
        assert os.listdir(folder) == []  # the plant swept, the job's own segment unlinked
    finally:
        shutil.rmtree(folder, ignore_errors=True)
