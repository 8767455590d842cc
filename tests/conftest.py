"""Shared test set-up: every multi-process test goes through microddp.launch.spawn, which has a
deadline and kills its ranks, so a bug fails a test instead of hanging CI."""

import os

import pytest

# Ranks in tests must fail fast rather than wait PyTorch's default half hour.
os.environ.setdefault("MICRODDP_TIMEOUT", "60")


@pytest.fixture(autouse=True)
def _fresh_world():
    """Each test starts with no world joined in the pytest process itself."""
    from microddp.comms import world

    yield
    world.shutdown()
