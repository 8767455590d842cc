"""Running ranks one of which gets SIGKILL, and collecting what the survivors report (not a
test module itself): used by the shared-memory tests of microddp's own groups and of the
torch backend."""

from __future__ import annotations

import multiprocessing as mp
import queue
from collections.abc import Callable


def survivors(target: Callable, args: tuple, n: int = 3, wait_s: float = 90
              ) -> tuple[list[int | None], dict[int, tuple]]:
    """Start `n` spawned processes running `target(rank, *args, results)`, where the doomed
    rank kills itself and the others put (rank, a, b) on `results`; wait up to `wait_s` for
    n - 1 reports, then stop every process. Returns (exit codes, {rank: (a, b)})."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *args, results), daemon=True)
             for r in range(n)]
    for p in procs:
        p.start()
    out: dict[int, tuple] = {}
    try:
        while len(out) < n - 1:
            rank, a, b = results.get(timeout=wait_s)
            out[rank] = (a, b)
    except queue.Empty:
        pass
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
    return [p.exitcode for p in procs], out
