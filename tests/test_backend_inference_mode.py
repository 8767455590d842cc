"""The `microddp` backend under torch.inference_mode (issue 50, torch's ProcessGroupGlooTest
test_allgather_inference_mode): a call made in inference mode writes into tensors made there,
as gloo does. Shared memory's calls may run on the group's own thread, where the mode (which
is per thread) was off, and writing into an inference tensor there was refused."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import microddp as mdp

pytestmark = pytest.mark.usefixtures("dev_shm_clean")
TIMEOUT = timedelta(seconds=60)


def _calls(pg, rank, size) -> list:
    """All-gather, all-reduce and broadcast on `pg`, async (the group's thread), made and
    waited for in inference mode; the outputs."""
    with torch.inference_mode():
        out = []
        for n in (1, 3):
            inputs = [torch.tensor([float(n * rank + i)]) for i in range(n)]
            outputs = [[torch.full([1], -1.0) for _ in range(n * size)] for _ in range(n)]
            pg.allgather(outputs, inputs).wait()
            out += [t.clone() for o in outputs for t in o]
        works, tensors = [], []
        for i in range(8):  # several queued at once: the later ones run on the group's thread
            t = torch.full([4], float(rank + i))
            works.append(pg.allreduce([t]))
            tensors.append(t)
        b = torch.full([3], float(rank))
        works.append(pg.broadcast([b], dist.BroadcastOptions()))
        for w in works:
            w.wait()
        return out + [t.clone() for t in tensors] + [b.clone()]


def _both(rank):
    import microddp.backend  # noqa: F401 (registers the backend, as a user's script does)

    dist.init_process_group("microddp", timeout=TIMEOUT)
    size = dist.get_world_size()
    store = dist.PrefixStore("reference", dist.distributed_c10d._get_default_store())
    gloo = dist.ProcessGroupGloo(store, rank, size, TIMEOUT)
    ours, theirs = _calls(dist.group.WORLD, rank, size), _calls(gloo, rank, size)
    shm = sum(n for (_, path), n in dist.group.WORLD.calls.items() if path == "shm")
    dist.destroy_process_group()
    return ours, theirs, shm


def test_calls_in_inference_mode_give_gloos_results():
    for ours, theirs, shm in mdp.spawn(_both, 2, join=False, timeout=180):
        assert len(ours) == len(theirs) == 2 + 18 + 8 + 1  # all-gathers of 1 and 3 tensors
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
        assert shm >= 10  # shared memory carried them, not gloo beside it
