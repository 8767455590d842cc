"""`pipeline.placement`: rank r goes to the (r mod cores)-th allowed core, and `pin` moves every
thread of the process there, the ones started before it (gloo's) and after it (they inherit).
Pinning is done in a child process: pinning pytest itself would leave it on one core."""

import os
import subprocess
import sys
import textwrap

from microddp.pipeline import placement


def test_ranks_go_round_the_allowed_cores_in_order():
    assert [placement.core_of(r, [3, 5]) for r in range(5)] == [3, 5, 3, 5, 3]
    assert placement.core_of(2, [0]) == 0
    assert placement.cores() == sorted(placement.cores()) and placement.cores()


def test_pin_moves_every_thread_of_the_process_older_and_newer():
    code = textwrap.dedent("""
        import os, threading
        from microddp.pipeline import placement
        stop = threading.Event()
        older = threading.Thread(target=stop.wait)
        older.start()
        rank = 1
        core = placement.pin(rank)
        assert core == placement.core_of(rank)
        newer = threading.Thread(target=stop.wait)
        newer.start()
        masks = {tid: os.sched_getaffinity(int(tid)) for tid in os.listdir("/proc/self/task")}
        stop.set()
        print(core, len(masks), sorted({min(m) for m in masks.values()}),
              {len(m) for m in masks.values()})
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    core, threads, where, sizes = done.stdout.split(maxsplit=3)
    assert int(threads) >= 3  # main, older, newer
    assert where == f"[{core}]" and sizes.strip() == "{1}"


def test_without_affinity_pinning_leaves_the_ranks_to_the_os(monkeypatch):
    # macOS has neither sched_getaffinity nor sched_setaffinity: every core, and no pinning
    monkeypatch.delattr("os.sched_getaffinity")
    monkeypatch.delattr("os.sched_setaffinity")
    assert placement.cores() == list(range(os.cpu_count() or 1))
    assert placement.pin(0) is None
