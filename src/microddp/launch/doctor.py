"""Is this machine ready for microddp? The checks behind `microddp doctor`: the backends, a
loopback port, and a live 2-rank all-reduce, once through torch's all_reduce and once through
microddp's ring (send/recv alone: a host can pass one and fail the other).

They live here, above collectives and beside spawn, because they start ranks and run a ring.
"""

from __future__ import annotations

import platform
import socket
import time
from collections.abc import Callable

RING_NUMEL = 1001


def _self_test(world) -> tuple[float, str | None]:
    """Each rank contributes rank+1; everyone must see 1+2+...+n, once through gloo's all_reduce
    and once through microddp's ring. Returns the all_reduce's sum and the ring's problem."""
    import torch

    from .. import comms

    t = torch.full((1024,), float(world.rank + 1), device=world.device)
    comms.all_reduce(t, "sum")
    return float(t[0].item()), ring_problem(world)


def ring_problem(world, reduce: Callable | None = None) -> str | None:
    """What is wrong with microddp's ring_all_reduce here, or None. It rests on send/recv
    alone, another code path than gloo's all_reduce: a host can pass one and fail the other."""
    import torch

    if reduce is None:
        from ..collectives import ring_all_reduce as reduce
    # 1001 elements: chunks of unequal size, and every position has its own value.
    base = torch.arange(RING_NUMEL, dtype=torch.float32, device=world.device)
    expected = base * sum(range(1, world.world_size + 1))
    x = base * (world.rank + 1)
    try:
        reduce(x)
    except Exception as e:  # noqa: BLE001 (a diagnosis: report it, let the other line stand)
        return f"{type(e).__name__}: {e}".splitlines()[0]
    wrong = (x != expected).nonzero()
    if len(wrong) == 0:
        return None
    i = int(wrong[0])
    return f"element {i} is {x[i].item():g}, expected {expected[i].item():g}"


def loopback_port() -> tuple[bool, str]:
    """Whether a port on 127.0.0.1 can be bound, and what to show either way."""
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return True, f"127.0.0.1:{s.getsockname()[1]} can be bound"
    except OSError as e:
        return False, f"cannot bind a loopback port: {e.strerror}"


def live_checks(spawn: Callable, backend: str) -> list[tuple[str, bool, str]]:
    """The live test on 2 ranks over `backend`: its all_reduce, and microddp's ring."""
    name = "" if backend == "gloo" else f"{backend} "
    start = time.perf_counter()
    try:
        results = spawn(_self_test, 2, timeout=60, backend=backend)
        sums = [r[0] for r in results]
        seconds = time.perf_counter() - start
        live = all(s == 3.0 for s in sums)
        detail = f"2 ranks agree on {sums[0]:g} (expected 3) in {seconds:.1f} s"
        problems = [f"rank {r}: {p}" for r, (_, p) in enumerate(results) if p]
        ring = not problems
        ring_detail = (f"2 ranks get all {RING_NUMEL} expected sums (microddp's ring, "
                       "over send/recv)" if ring else "; ".join(problems))
    except Exception as e:  # report, never crash: this is a diagnosis
        live, detail = False, f"{type(e).__name__}: {e}".splitlines()[0]
        ring, ring_detail = False, "not run: the live test failed"
    return [(f"live {name}all_reduce", live, detail),
            (f"live {name}ring_all_reduce", ring, ring_detail)]


def diagnose(skip_live: bool = False) -> int:
    """Print what this machine offers (python, torch, CUDA, backends) and an ok/FAIL line per
    check; return 0 when microddp can run here, else 1. skip_live leaves out the 2-rank tests,
    which take seconds."""
    import torch

    from ..world.world import backend_available
    from .spawn import spawn

    checks: list[tuple[str, bool, str]] = []
    advice: list[str] = []
    print(f"python    {platform.python_version()} on {platform.system()} {platform.machine()}")
    print(f"torch     {torch.__version__}")
    cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if cuda else 0
    print(f"cuda      {'available' if cuda else 'not available'}, {gpus} GPU(s)")
    backends = {b: backend_available(b) for b in ("nccl", "gloo", "mpi", "ucc")}
    print("backends  " + "  ".join(f"{b}:{'yes' if ok else 'no'}" for b, ok in backends.items()))
    checks.append(("gloo backend", backends["gloo"], "needed for CPU training"))
    ok, msg = loopback_port()
    checks.append(("loopback port", ok, msg))
    if not skip_live:
        checks += live_checks(spawn, "gloo")
        if backends["nccl"] and gpus >= 2:  # the path GPU training takes: NCCL, a GPU a rank
            checks += live_checks(spawn, "nccl")
    for name, good, detail in checks:
        print(f"{'ok  ' if good else 'FAIL'}  {name:20s} {detail}")
    if not cuda:
        advice.append("no GPU: microddp uses gloo on the CPU; everything in the course runs")
    elif gpus and not backends["nccl"]:
        advice.append("GPUs but no NCCL: install a CUDA build of torch for fast GPU collectives")
    if gpus:
        advice.append(f"start at most {gpus} processes per host (one per GPU)")
    for line in advice:
        print(f"note: {line}")
    healthy = all(good for _, good, _ in checks)
    print("microddp can run here" if healthy else "microddp cannot run here: see FAIL above")
    return 0 if healthy else 1
