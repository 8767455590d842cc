"""How a shared-memory wait waits (transport/shm.py): it spins on while this host has an idle
core, and sleeps on the futex once a task waits for one; MICRODDP_SHM_IDLE_SPIN_US sets how
long it may spin on. The peer is a forked process posting into a segment both map."""

import multiprocessing as mp
import os
import time

import pytest

import microddp as mdp
from microddp.transport import shm as transport


def _post_later(name: str, nbytes: int, delay_s: float) -> None:
    seg = transport.Segment(name, nbytes, create=False)
    flags = transport.Flags(seg, 0, 1, 2, [os.getppid(), os.getpid()])
    time.sleep(delay_s)
    flags.post(1)


def _wait_for_peer(monkeypatch, idle: bool) -> list[str]:
    """Rank 0 waits for rank 1's first post (made 20 ms later); which way did it wait?"""
    monkeypatch.setenv("MICRODDP_SHM_IDLE_SPIN_US", str(30e6))  # far past the peer's post
    monkeypatch.setattr(transport, "_idle_cores", lambda: idle)
    took = []
    slowly = transport.Flags._wait_slowly
    monkeypatch.setattr(transport.Flags, "_wait_slowly",
                        lambda self, *a: (took.append("slept"), slowly(self, *a)))
    name, nbytes = transport.segment_name(), 4096
    seg = transport.Segment(name, nbytes, create=True)
    try:
        peer = mp.get_context("fork").Process(target=_post_later, args=(name, nbytes, 0.02))
        peer.start()
        flags = transport.Flags(seg, 0, 0, 2, [os.getpid(), peer.pid])
        flags.wait(1, 30.0, "test")
        peer.join(10)
        assert peer.exitcode == 0
    finally:
        seg.unlink()
        seg.close()
    return took or ["spun"]


@pytest.mark.skipif(not transport.supported(), reason="needs /dev/shm on x86-64")
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: a wait never spins")
def test_a_wait_spins_on_while_cores_are_idle_and_sleeps_when_one_is_wanted(monkeypatch):
    assert _wait_for_peer(monkeypatch, idle=True) == ["spun"]
    assert _wait_for_peer(monkeypatch, idle=False) == ["slept"]


def test_the_idle_spin_setting(monkeypatch):
    monkeypatch.delenv("MICRODDP_SHM_IDLE_SPIN_US", raising=False)
    assert transport.idle_spin_s() == transport.SPIN_WHILE_IDLE_S
    monkeypatch.setenv("MICRODDP_SHM_IDLE_SPIN_US", "250")
    assert transport.idle_spin_s() == 250e-6
    monkeypatch.setenv("MICRODDP_SHM_IDLE_SPIN_US", "0")
    assert transport.idle_spin_s() == 0
    for bad in ("-1", "fast", "nan"):
        monkeypatch.setenv("MICRODDP_SHM_IDLE_SPIN_US", bad)
        with pytest.raises(mdp.MicroDDPError, match="MICRODDP_SHM_IDLE_SPIN_US must be"):
            transport.idle_spin_s()


def test_idle_cores_reads_the_runnable_count(monkeypatch):
    # this test's own process is runnable while it reads: never idle with no cores at all
    monkeypatch.setattr(transport, "_online", 0)
    assert transport._idle_cores() is False
    monkeypatch.setattr(transport, "_online", 10**6)
    assert transport._idle_cores() is (os.path.exists("/proc/loadavg"))
