"""The `microddp` backend's ProcessGroup called in every form torch's ProcessGroup accepts
(issue 50): lists and options (what torch's dispatch uses), one tensor, an op or a root rank
in place of the options, keyword names, a timeout, and the inputs gloo refuses. Each call is
made on the microddp world and on a gloo group of the same ranks, in the same ranks, and the
outputs, Work.result() and errors compared."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

import microddp as mdp
from microddp.backend import MicroDDPProcessGroup

pytestmark = pytest.mark.usefixtures("dev_shm_clean")
TIMEOUT = timedelta(seconds=60)


def _x(rank, n=4, dtype=torch.float32):
    return (torch.arange(n, dtype=torch.float64) * 0.37 + rank * 1.5 + 1).to(dtype)


def _calls(pg, rank, size):
    """name -> the call's outputs (tensors, result() shapes) or its error (type, message)."""
    out = {}

    def record(name, fn, outputs):
        try:
            work = fn()
            work.wait()
            try:
                result = [tuple(r.shape) if isinstance(r, torch.Tensor) else len(r)
                          for r in work.result()]
            except RuntimeError:  # gloo's reduce_scatter has no result(): ours may
                result = None
            out[name] = ([t.clone() for t in outputs], result)
        except Exception as e:  # noqa: BLE001 - the error itself is compared
            out[name] = (type(e).__name__, str(e).split("\n")[0])

    for op in ("SUM", "PRODUCT", "MIN", "MAX"):
        opts = dist.AllreduceOptions()
        opts.reduceOp = getattr(dist.ReduceOp, op)
        t = _x(rank)
        record(f"allreduce([t], opts {op})", lambda t=t, o=opts: pg.allreduce([t], o), [t])
        t = _x(rank)
        record(f"allreduce([t], {op})", lambda t=t, op=op: pg.allreduce(
            [t], getattr(dist.ReduceOp, op)), [t])
    t = _x(rank)
    record("allreduce(t)", lambda: pg.allreduce(t), [t])
    t2 = _x(rank)
    record("allreduce(t, op=MAX)", lambda: pg.allreduce(t2, op=dist.ReduceOp.MAX), [t2])
    t3 = _x(rank)
    record("allreduce(tensor=t)", lambda: pg.allreduce(tensor=t3), [t3])
    t4 = _x(rank, dtype=torch.int64)
    record("allreduce(int64 t, timeout)", lambda: pg.allreduce(t4, dist.ReduceOp.SUM,
                                                               timedelta(seconds=30)), [t4])
    record("allreduce([])", lambda: pg.allreduce([]), [])
    pair = [_x(rank), _x(rank)]
    record("allreduce([t, t])", lambda: pg.allreduce(pair), pair)

    for root in range(size):
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = root, 0
        t = _x(rank)
        record(f"broadcast([t], opts root {root})", lambda t=t, o=opts: pg.broadcast([t], o), [t])
        t = _x(rank)
        record(f"broadcast(t, {root})", lambda t=t, r=root: pg.broadcast(t, r), [t])
        t = _x(rank)
        record(f"broadcast(t, root={root})", lambda t=t, r=root: pg.broadcast(t, root=r), [t])
    for bad in (-1, size):
        opts = dist.BroadcastOptions()
        opts.rootRank = bad
        t = _x(rank)
        record(f"broadcast([t], root {bad})", lambda t=t, o=opts: pg.broadcast([t], o), [t])

    outs = [torch.zeros(4) for _ in range(size)]
    t = _x(rank)
    record("allgather([outs], [t], opts)", lambda: pg.allgather([outs], [t], AllgatherOptions()),
           outs)
    outs2 = [torch.zeros(4) for _ in range(size)]
    record("allgather([outs], [t])", lambda: pg.allgather([outs2], [t]), outs2)
    outs3 = [torch.zeros(4) for _ in range(size)]
    record("allgather(outs, t)", lambda: pg.allgather(outs3, t), outs3)
    outs4 = [torch.zeros(4) for _ in range(size)]
    record("allgather(outs, input_tensor=t)", lambda: pg.allgather(outs4, input_tensor=t), outs4)
    short = [torch.zeros(4) for _ in range(size - 1)]
    record("allgather short list", lambda: pg.allgather([short], [t]), short)
    wrong = [torch.zeros(5) for _ in range(size)]
    record("allgather wrong size", lambda: pg.allgather([wrong], [t]), wrong)

    ins = [_x(rank + k) for k in range(size)]
    o = torch.zeros(4)
    opts = dist.ReduceScatterOptions()
    record("reduce_scatter([o], [ins], opts)", lambda: pg.reduce_scatter([o], [ins], opts), [o])
    o2 = torch.zeros(4)
    record("reduce_scatter(o, ins)", lambda: pg.reduce_scatter(o2, ins), [o2])
    o3 = torch.zeros(4)
    record("reduce_scatter(o, ins, MAX)", lambda: pg.reduce_scatter(o3, ins, dist.ReduceOp.MAX),
           [o3])

    record("barrier()", lambda: pg.barrier(), [])
    record("barrier(opts)", lambda: pg.barrier(dist.BarrierOptions()), [])
    record("barrier(timeout)", lambda: pg.barrier(timedelta(seconds=30)), [])
    return out


def _both(rank):
    import microddp.backend  # noqa: F401 (registers the backend, as a user's script does)

    dist.init_process_group("microddp", timeout=TIMEOUT)
    ours = dist.group.WORLD
    assert isinstance(ours, MicroDDPProcessGroup)
    size = dist.get_world_size()
    # gloo built as torch's ProcessGroupGlooTest builds it: the backend object from a store
    store = dist.PrefixStore("reference", dist.distributed_c10d._get_default_store())
    gloo = dist.ProcessGroupGloo(store, rank, size, TIMEOUT)
    group = dist.new_group(backend="gloo", timeout=TIMEOUT)  # and as a ProcessGroup
    mine, backend, process_group = (_calls(pg, rank, size) for pg in (ours, gloo, group))
    differ = {}
    for name, a in mine.items():
        # the answer of gloo's backend object (what ProcessGroupGlooTest calls), or of a gloo
        # ProcessGroup where the form is one only a ProcessGroup has (barrier(timeout))
        if not any(_same(a, ref[name]) for ref in (backend, process_group)):
            differ[name] = (a, backend[name], process_group[name])
    shm = sum(n for (_, path), n in ours.calls.items() if path == "shm")
    dist.destroy_process_group()
    return differ, len(mine), shm


def _same(a, b) -> bool:
    if isinstance(a[0], str) or isinstance(b[0], str):
        return a == b
    return b[1] in (None, a[1]) and all(torch.equal(x, y) for x, y in zip(a[0], b[0], strict=True))


@pytest.mark.parametrize("n", [2, 3])
def test_every_call_form_gives_gloos_results(n):
    for differ, count, shm in mdp.spawn(_both, n, join=False, timeout=180):
        assert differ == {}, "\n".join(f"{k}: {v}" for k, v in differ.items())
        assert count == (34 if n == 2 else 37)  # every form above, for each root
        assert shm >= 10  # the one-tensor forms reached shared memory, not only gloo
