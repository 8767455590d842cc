"""What a test that uses shared memory may not leave in /dev/shm (not a test module itself):
the microddp segments of exited processes, other than those a test plants on purpose."""

from __future__ import annotations

import os

import pytest

from microddp.shm import segment as transport

# The name's tail of a segment a test plants on purpose (a stale one for the sweep to find):
# another xdist worker's check must not count it as left behind.
PLANTED = "0badc0ffee"


def left_behind() -> set[str]:
    """microddp segments in /dev/shm whose creator has exited (other tests running beside
    this one may hold a live one for a moment, while their ranks attach)."""
    return {n for n in os.listdir(transport.SHM_DIR) if n.startswith(transport.PREFIX)
            and not n.split("-")[-1].startswith(PLANTED)
            and not transport.alive(int(n[len(transport.PREFIX):].split("-")[1]))}


@pytest.fixture
def dev_shm_clean():
    """Fails the test if it leaves a microddp segment behind in /dev/shm."""
    before = left_behind()
    yield
    assert left_behind() - before == set(), "a microddp segment was left in /dev/shm"
