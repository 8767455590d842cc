"""comms.all_reduce with shared memory off (MICRODDP_TRANSPORT=gloo): checked (default) against
checked=False, interleaved call by call after a barrier, 2 ranks; median us per call."""
import os
import statistics
import time

os.environ["MICRODDP_TRANSPORT"] = "gloo"
import torch

import microddp as mdp


def rank(world, sizes, n):
    torch.set_num_threads(1)
    out = {}
    for size in sizes:
        t = torch.ones(size // 4)
        times = {True: [], False: []}
        for i in range(n):
            for checked in ((True, False) if i % 2 else (False, True)):
                mdp.comms.barrier()
                t0 = time.perf_counter()
                mdp.comms.all_reduce(t, checked=checked)
                times[checked].append(time.perf_counter() - t0)
        out[size] = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    return out

if __name__ == "__main__":
    sizes = [4096, 65536, 1 << 20]
    for rep in range(3):
        res = mdp.spawn(rank, 2, args=(sizes, 200), timeout=300, backend="gloo")[0]
        print(f"run {rep + 1} (load {os.getloadavg()[0]:.1f}): " + ", ".join(
            f"{s // 1024} KiB: checked {r[True]:.0f} us / unchecked {r[False]:.0f} us = {r[True] / r[False]:.2f}"
            for s, r in res.items()))
