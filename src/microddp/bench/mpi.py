"""MPI as a contender in `microddp bench allreduce --mpi`: the ranks start under `mpiexec`
(MPICH's, from the optional extra `pip install microddp[mpi]`), join torch.distributed as
well, and time MPI's Allreduce, Reduce_scatter_block and Allgather (through mpi4py, on the
memory of the very tensors microddp's calls use) interleaved with microddp's shared-memory
all_reduce, reduce_scatter and all_gather, round by round after one barrier.

Why mpiexec and not `launch.spawn`: MPI's own shared-memory transport is set up by its
launcher; two processes that joined one MPI world afterwards (ports, connect/accept) are
not what an MPI user gets. The table is microddp's median over MPI's, with the bootstrap
interval, and MPI's Allreduce timed twice (the A/A control: how far apart this run puts
two equal contenders).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch

from ..errors import MicroDDPError
from ..timing import compare, median
from ..transport import objects

CONTROL = "mpi-2"  # MPI's Allreduce timed again (A/A)
# (microddp's contender, MPI's) per collective: what the table compares
PAIRS = (("all_reduce", "shm", "mpi"), ("reduce_scatter", "shm-rs", "mpi-rs"),
         ("all_gather", "shm-ag", "mpi-ag"))


def available() -> str | None:
    """Why MPI cannot be a contender here (a sentence), or None when it can."""
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed: pip install 'microddp[mpi]' (MPICH and mpi4py)"
    if shutil.which("mpiexec") is None:
        return "no mpiexec on PATH: pip install 'microddp[mpi]' (MPICH and mpi4py)"
    return None


def _mpich_segments() -> set[str]:
    """MPICH's shared-memory files in /dev/shm now (none where there is no /dev/shm)."""
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("mpich_shm_")}
    except OSError:
        return set()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(fn: Callable[..., Any], world_size: int, args: tuple, timeout: float) -> Any:
    """`fn(world, *args)` on `world_size` ranks started by mpiexec, each also a rank of a
    torch.distributed gloo world on 127.0.0.1; rank 0's result. A rank that fails, or the
    deadline, ends every rank and raises MicroDDPError with what they printed."""
    why = available()
    if why is not None:
        raise MicroDDPError(f"--mpi: {why}")
    with tempfile.TemporaryDirectory(prefix="microddp-mpi-") as folder:
        # microddp's own format (transport/objects.py: JSON and raw tensor bytes), not pickle:
        # nothing another process wrote is unpickled (tests/test_no_pickle.py)
        job, out = os.path.join(folder, "job.bin"), os.path.join(folder, "out.bin")
        with open(job, "wb") as f:
            f.write(objects.encode([f"{fn.__module__}:{fn.__qualname__}", args, timeout]))
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
               "WORLD_SIZE": str(world_size), "OMP_NUM_THREADS": "1"}
        cmd = ["mpiexec", "-n", str(world_size), sys.executable, "-m", __name__, job, out]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        before = _mpich_segments()
        try:
            text, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            text, _ = proc.communicate()
            # MPICH unlinks its shared-memory files when its ranks end, not when they are
            # killed: take away the ones that appeared during this run
            for name in _mpich_segments() - before:
                try:
                    os.unlink(os.path.join("/dev/shm", name))
                except OSError:
                    pass
            raise MicroDDPError(f"--mpi: the ranks did not finish within {timeout:g} s "
                                f"(--timeout); they printed:\n{text[-2000:]}") from None
        if proc.returncode != 0 or not os.path.exists(out):
            raise MicroDDPError(f"--mpi: mpiexec exited with {proc.returncode}; the ranks "
                                f"printed:\n{text[-4000:]}")
        if text.strip():
            print(text, end="" if text.endswith("\n") else "\n")
        with open(out, "rb") as f:
            return objects.decode(f.read())


def _main(job: str, out: str) -> int:
    """One rank under mpiexec: its rank from MPI, a torch.distributed world beside it."""
    from mpi4py import MPI

    from .. import comms

    rank = MPI.COMM_WORLD.Get_rank()
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank)})
    torch.set_num_threads(1)
    with open(job, "rb") as f:
        name, args, timeout = objects.decode(f.read())
    module, _, qualname = name.partition(":")
    fn = getattr(importlib.import_module(module), qualname)
    world = comms.init(backend="gloo", timeout=timeout)
    try:
        result = fn(world, *args)
        if rank == 0:
            with open(out, "wb") as f:
                f.write(objects.encode(result))
    finally:
        comms.shutdown()
    return 0


def contenders(t: torch.Tensor, p: int, control: bool) -> dict[str, Callable[[], object]]:
    """MPI's collectives and microddp's shared-memory ones on tensors of `t`'s size, ready to
    time: all-reduce in place (t), reduce-scatter of p blocks into one, all-gather of one
    block into p; the buffers are made here, once. microddp's reduce-scatter and all-gather
    are shared memory's own (collectives.shm_*), the ones tensor parallelism calls."""
    from mpi4py import MPI

    from ..collectives import shm_all_gather, shm_reduce_scatter

    comm = MPI.COMM_WORLD
    n = t.numel()
    block = max(1, n // p)
    full = torch.zeros(block * p)
    parts = list(full.view(p, block))  # reduce-scatter's inputs, all-gather's outputs
    mine = torch.zeros(block)
    whole, flat, one = t.numpy(), full.numpy(), mine.numpy()
    out = {
        "mpi": lambda: comm.Allreduce(MPI.IN_PLACE, whole),
        "shm-rs": lambda: shm_reduce_scatter(mine, parts),
        "mpi-rs": lambda: comm.Reduce_scatter_block(flat, one),
        "shm-ag": lambda: shm_all_gather(parts, mine),
        "mpi-ag": lambda: comm.Allgather(one, flat),
    }
    if control:
        out[CONTROL] = lambda: comm.Allreduce(MPI.IN_PLACE, whole)
    return out


def same_results(world, n: int) -> dict[str, bool]:
    """Whether each pair of contenders computes the same thing, on random float32 inputs of
    `n` elements (different on every rank): what a comparison of their times presumes.
    Sums of two ranks' values, so the bits are equal whatever order each adds in."""
    from mpi4py import MPI

    from .. import comms
    from ..collectives import shm_all_gather, shm_reduce_scatter

    comm, p = MPI.COMM_WORLD, world.world_size
    g = torch.Generator().manual_seed(world.rank)
    x = torch.randn(n * p, generator=g)
    ours, theirs = x.clone(), x.clone()
    comms.all_reduce(ours)
    comm.Allreduce(MPI.IN_PLACE, theirs.numpy())
    out = {"all_reduce": torch.equal(ours, theirs)}
    mine, theirs_rs = torch.empty(n), torch.empty(n)
    shm_reduce_scatter(mine, list(x.view(p, n)))
    comm.Reduce_scatter_block(x.numpy(), theirs_rs.numpy())
    out["reduce_scatter"] = torch.equal(mine, theirs_rs)
    block = x[:n].clone()
    gathered, theirs_ag = torch.empty(p, n), torch.empty(p, n)
    shm_all_gather(list(gathered), block)
    comm.Allgather(block.numpy(), theirs_ag.numpy())
    out["all_gather"] = torch.equal(gathered, theirs_ag)
    return out


def table(rows: list[dict]) -> tuple[list[str], list[dict]]:
    """Lines to print and JSON records: per size and collective, microddp's and MPI's median
    and the ratio of medians (microddp / MPI; below 1 = faster than MPI) with its interval;
    the A/A control's ratio under all_reduce when it ran."""
    lines = [f"{'size':>9}  {'collective':<15} {'microddp':>10} {'MPI':>10} {'x MPI time':>10}"
             f"  {'90% interval':>12}"]
    records = []
    from .allreduce_report import human
    for row in rows:
        times = row["times"]
        for where, ours, theirs in PAIRS:
            if ours not in times or theirs not in times:
                continue
            ratio, (lo, hi) = compare(times[ours], times[theirs])
            a, b = median(times[ours]), median(times[theirs])
            lines.append(f"{human(row['bytes']):>9}  {where:<15} {a * 1e6:>8.1f}us "
                         f"{b * 1e6:>8.1f}us {ratio:>10.2f}  {lo:>7.2f}-{hi:.2f}")
            records.append({"bytes": row["bytes"], "collective": where, "microddp_s": a,
                            "mpi_s": b, "ratio": ratio, "interval": [lo, hi]})
        if CONTROL in times:
            aa, (lo, hi) = compare(times[CONTROL], times["mpi"])
            lines.append(f"{'':>9}  {'MPI A/A':<15} {median(times[CONTROL]) * 1e6:>8.1f}us "
                         f"{median(times['mpi']) * 1e6:>8.1f}us {aa:>10.2f}  {lo:>7.2f}-{hi:.2f}")
            records.append({"bytes": row["bytes"], "collective": "mpi A/A", "ratio": aa,
                            "interval": [lo, hi]})
    return lines, records


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1], sys.argv[2]))
