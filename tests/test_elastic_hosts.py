"""`microddp train --elastic` across two network-namespace "hosts" x 2 ranks (slow; needs root):
host 1 is lost whole (every process in its namespace SIGKILLed), host 0's two ranks go on.
The job's store is served from host 0, as `microddp run` would (AgentStore), and each rank
talks to the others over the bridge (GLOO_SOCKET_IFNAME), as across real machines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

import netns_helpers
from elastic_helpers import ATOL, SMALL, check_samples, flags, max_diff, membership, reference

REASON = netns_helpers.unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=REASON or "")]

SERVE = """
import sys, time
from microddp.launch.procs import AgentStore
agent = AgentStore.start(0, sys.argv[1])
print(agent.port, agent.secure_port, flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(600)
def test_losing_a_whole_host_leaves_the_other_training(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    secret = "elastic-hosts-" + os.urandom(8).hex()
    env = {**os.environ, "MICRODDP_SECRET": secret, "MICRODDP_ELASTIC_STEP_S": "0.3"}
    env.pop("MICRODDP_ELASTIC_FAULT", None)
    with netns_helpers.Fabric(2) as net:
        store = net.popen(0, [sys.executable, "-c", SERVE, net.addrs[0]], env=env,
                          stdout=subprocess.PIPE, text=True)
        port, secure = store.stdout.readline().split()
        ranks = []
        for rank in range(4):
            host = rank // 2
            worker = {**env, "RANK": str(rank), "WORLD_SIZE": "4", "LOCAL_RANK": str(rank % 2),
                      "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": net.addrs[0], "MASTER_PORT": port,
                      "TORCHELASTIC_USE_AGENT_STORE": "True", "MICRODDP_AGENT_STORE": "secret",
                      "MICRODDP_STORE_PORT": secure, "GLOO_SOCKET_IFNAME": netns_helpers.IFNAME}
            log = open(tmp_path / f"rank{rank}.log", "w")  # noqa: SIM115 (closed with the job)
            ranks.append(net.popen(host, [sys.executable, "-m", "microddp.train", "--elastic",
                                          "--out", str(out), "--no-plot", "--epochs", "1",
                                          *flags(SMALL)], env=worker, stdout=log,
                                   stderr=log))
        deadline = time.monotonic() + 300
        samples = out / "samples-0.jsonl"
        while time.monotonic() < deadline and (
                not samples.exists() or len(samples.read_text().splitlines()) < 3):
            time.sleep(0.1)
        lost_at = len(samples.read_text().splitlines())
        killed = net.kill_host(1)
        codes = [p.wait(timeout=300) for p in ranks[:2]]
        logs = "".join((tmp_path / f"rank{r}.log").read_text() for r in range(4))
        assert killed and codes == [0, 0], logs[-4000:]
    changes = membership(out)
    assert [(c["lost"], c["members"]) for c in changes] == [([2, 3], [0, 1])], changes
    assert changes[0]["step"] >= lost_at
    print(f"host lost after step {lost_at}: next step {changes[0]['pause_s']:.2f} s after the "
          f"failure was seen; records {json.dumps(changes)}")
    assert max_diff(out, reference(tmp_path / "ref", epochs=1)) <= ATOL
    check_samples(out, steps=12)
