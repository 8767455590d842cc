"""The small-message latency work on the shared-memory path (issue 54): the wait's adaptive
spin, the MPI contender of `microddp bench allreduce --mpi` (when mpi4py and mpiexec are
installed: pip install 'microddp[mpi]'), and its refusals."""

import re

import pytest

from microddp import commands as cli
from microddp.bench import mpi
from microddp.shm import segment
from microddp.shm.segment import LINE_WORDS, SPIN_MAX_S, SPIN_MIN_S, Flags


class _Memory:
    """What Flags reads of a segment, in plain process memory (no /dev/shm, no peer)."""

    def __init__(self) -> None:
        self._buf = bytearray(2 * LINE_WORDS * 8)
        self.words = memoryview(self._buf).cast("q")
        self.bells = memoryview(self._buf).cast("i")
        self.address = 0  # never woken nor slept on here: the spins see every post


def _flags(monkeypatch, cores: int = 2) -> Flags:
    monkeypatch.setattr(segment, "_cores", lambda: cores)
    return Flags(_Memory(), 0, 0, 2, [0, 0])


def test_the_spin_budget_doubles_on_a_post_seen_and_halves_on_a_spin_in_vain(monkeypatch):
    flags = _flags(monkeypatch)
    assert flags.spin_s == SPIN_MAX_S
    peer = flags.others[0]
    flags.words[peer] = 5
    flags.spin_s = SPIN_MIN_S
    assert flags._spin(5) is True and flags.spin_s == 2 * SPIN_MIN_S
    flags.spin_s = SPIN_MAX_S
    assert flags._spin(4) is True and flags.spin_s == SPIN_MAX_S  # capped
    assert flags._spin(6) is False and flags.spin_s == SPIN_MAX_S / 2  # peer still at 5
    for _ in range(20):
        assert flags._spin(6) is False
    assert flags.spin_s == SPIN_MIN_S  # floored: the next wait still spins a little
    flags.wait(5, 1.0, "test")  # posted already: returns without sleeping


def test_no_spin_when_the_ranks_outnumber_the_cores(monkeypatch):
    flags = _flags(monkeypatch, cores=1)
    assert flags.spin_s == 0.0
    assert flags._spin(1) is False and flags.spin_s == 0.0


def test_mpi_needs_shared_memory_among_the_contenders(capsys):
    code = cli.main(["bench", "allreduce", "--sizes", "4K", "--algorithms", "ring", "--mpi"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--mpi compares MPI with shared memory" in err[0]


def test_mpi_missing_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(mpi, "available", lambda: "mpi4py is not installed: pip install x")
    code = cli.main(["bench", "allreduce", "--sizes", "4K", "--algorithms", "shm", "--mpi"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["microddp: --mpi: mpi4py is not installed: pip install x"] or (
        len(err) == 1 and "--mpi: mpi4py is not installed" in err[0])


needs_mpi = pytest.mark.skipif(mpi.available() is not None,
                               reason=f"MPI contender: {mpi.available()}")


@needs_mpi
def test_shared_memory_and_mpi_compute_the_same_results():
    got = mpi.run(mpi.same_results, 2, (1001,), timeout=120)
    assert got == {"all_reduce": True, "reduce_scatter": True, "all_gather": True}


@needs_mpi
def test_bench_allreduce_against_mpi(tmp_path, capsys):
    code = cli.main(["bench", "allreduce", "--sizes", "4K", "--algorithms", "shm", "--mpi",
                     "--control", "--repeats", "3", "--min-repeats", "2", "--warmup", "1",
                     "--timeout", "240", "--out", str(tmp_path)])
    assert code == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^\s+(?:4 KiB)?\s+(all_reduce|reduce_scatter|all_gather|MPI A/A)\s+"
                      r"([\d.]+)us\s+([\d.]+)us\s+([\d.]+)\s+([\d.]+)-([\d.]+)$", out, re.M)
    assert [r[0] for r in rows] == ["all_reduce", "reduce_scatter", "all_gather", "MPI A/A"]
    for _, ours, theirs, ratio, lo, hi in rows:
        assert float(ours) > 0 and float(theirs) > 0
        assert float(ratio) == pytest.approx(float(ours) / float(theirs), rel=0.02, abs=0.01)
        assert 0 < float(lo) <= float(hi)


@needs_mpi
def test_ranks_killed_at_the_deadline_leave_no_mpich_segment(tmp_path, capsys):
    """MPICH unlinks its /dev/shm files when its ranks end, not when mpiexec's process group
    is killed at --timeout: bench removes the ones its run made."""
    before = mpi._mpich_segments()
    code = cli.main(["bench", "allreduce", "--sizes", "16M", "--algorithms", "shm", "--mpi",
                     "--repeats", "500", "--timeout", "4", "--out", str(tmp_path)])
    assert code == 2 and "did not finish within 4 s" in capsys.readouterr().err
    assert mpi._mpich_segments() - before == set()


def test_a_lean_log_entry_finds_its_caller_on_its_thread_while_the_call_runs():
    """The monitor logs a blocking shared-memory all-reduce without its caller's frame
    (monitor/patch.py's `leanly`); a report asking while the call runs finds the frame below
    the wrapper on the calling thread, and after the call nothing is kept."""
    import threading

    from microddp.monitor import log

    book = log.CollectiveLog()
    seen = {}

    def wrapper(ask: bool = True):  # the monitor's wrapper: its code is where the walk stops
        entry = book.begin("world", "all_reduce")
        entry._thread = threading.get_ident()
        if ask:
            seen["during"] = entry.caller
        book.end(entry)
        seen["entry"] = entry

    log.WRAPPER_CODES.add(wrapper.__code__)
    try:
        wrapper()  # LINE-CALLER
        wrapper(ask=False)
    finally:
        log.WRAPPER_CODES.discard(wrapper.__code__)
    with open(__file__) as f:
        line = next(i for i, text in enumerate(f, 1) if "# LINE-CALLER" in text
                    and "wrapper()" in text)
    assert seen["during"] == (f"test_a_lean_log_entry_finds_its_caller_on_its_thread_while_"
                              f"the_call_runs at test_shm_latency.py:{line}")
    ended = seen["entry"]
    assert ended.location() == () and ended._frame_now() is None
