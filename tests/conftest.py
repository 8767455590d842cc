"""Shared test set-up: every multi-process test goes through microddp.launch.spawn, which has a
deadline and kills its ranks, so a bug fails a test instead of hanging CI."""

import atexit
import os
import shutil
import tempfile

import pytest
import torch._dynamo  # noqa: F401

from shm_leftovers import dev_shm_clean  # noqa: F401 (a fixture the shared-memory tests use)

# Why torch._dynamo here: most tests' ranks build a torch.optim optimizer, whose first use
# imports it (1.2 s on an idle core). Imported in this process before the first spawn, each
# worker's forkserver preloads it (microddp.launch.spawn), so it is paid once per worker rather
# than once per rank per test.

# Ranks in tests must fail fast rather than wait PyTorch's default half hour.
os.environ.setdefault("MICRODDP_TIMEOUT", "60")
# A hang's Flight Recorder dumps go to the run folder, else runs/hang-DATE in the working
# directory (monitor/flight.py): the planted hangs of the tests write theirs outside the clone.
_RUNS = tempfile.mkdtemp(prefix="microddp-test-runs-")
os.environ.setdefault("MICRODDP_RUN_DIR", _RUNS)
atexit.register(shutil.rmtree, _RUNS, ignore_errors=True)


@pytest.fixture(autouse=True)
def _fresh_world():
    """Each test starts with no world joined in the pytest process itself."""
    from microddp import comms

    yield
    comms.shutdown()
