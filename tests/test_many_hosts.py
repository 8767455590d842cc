"""The README's many-hosts commands, run as written on "hosts" made of network namespaces
(tests/netns_helpers.py): each has its own loopback, its hostname resolves to 127.0.0.1, and
no interface variable is set, so microddp must find the interface that reaches the others by
itself. The results must equal one host's, and a host that advertises the loopback to the
other must end in one clear line."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import netns_helpers

ROOT = Path(__file__).resolve().parents[1]
REASON = netns_helpers.unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=REASON or "")]
DEADLINE = 600
HOST = socket.gethostname()  # the same in every namespace: `ip netns` keeps the UTS namespace


def readme_commands() -> list[str]:
    """The torchrun commands of the README's "Many hosts" section, continuations joined, as
    the shell reads them ($HOST0 and friends expanded by bash when they run)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Many hosts", 1)[1].split("\n## ", 1)[0]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        joined = block.replace("\\\n", " ")
        commands += [" ".join(line.split()) for line in joined.splitlines()
                     if line.strip().startswith("torchrun")]
    return commands


def _env(net: netns_helpers.Fabric, host: int, **extra: str) -> dict:
    """A user's environment on host `host`: no interface variable, no rank variables."""
    drop = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "RANK", "WORLD_SIZE", "LOCAL_RANK",
            "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS",
            "MKL_NUM_THREADS", "MICRODDP_HIERARCHICAL")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(HOST0=net.addrs[0], NODE_RANK=str(host), THIS_HOST=net.addrs[host], **extra)
    return env


def _start(net, host: int, command: str, cwd: Path, **extra: str) -> subprocess.Popen:
    return net.popen(host, ["bash", "-c", command], cwd=cwd, env=_env(net, host, **extra),
                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(procs: list[subprocess.Popen], timeout: float = DEADLINE) -> list[str]:
    deadline = time.monotonic() + timeout
    return [p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for p in procs]


def _params(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def _one_host(tmp: Path, nproc: int = 4) -> dict:
    """The same job on one host with 4 ranks (the loopback, no namespace)."""
    out = subprocess.run([sys.executable, "-m", "microddp", "train", "--nproc", str(nproc),
                          "--out", str(tmp / "one-host")], capture_output=True, text=True,
                         timeout=DEADLINE)
    assert out.returncode == 0, out.stdout + out.stderr
    return _params(tmp / "one-host" / "model.pt")


def test_the_readme_has_the_commands_these_tests_run():
    static, c10d_host0, c10d_other = readme_commands()
    assert "--master-addr $HOST0" in static and "--node-rank $NODE_RANK" in static
    assert "--rdzv-conf is_host=1" in c10d_host0 and "is_host" not in c10d_other
    assert "--local-addr $HOST0" in c10d_host0 and "--local-addr $THIS_HOST" in c10d_other


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    """The README's static command on 2 namespaces x 2 ranks, and the one-host reference."""
    tmp = tmp_path_factory.mktemp("two-hosts")
    static = readme_commands()[0]
    with netns_helpers.Fabric(2) as net:
        procs = [_start(net, h, static, tmp) for h in range(2)]
        logs = _finish(procs)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)
    reference = _one_host(tmp)
    return tmp, logs, reference


def test_two_hosts_by_the_readme_match_one_host(two_hosts):
    tmp, logs, reference = two_hosts
    # the interface was found by itself: the one that routes to host 0's address
    assert ("microddp: 2 host(s) reach each other (mddp0, the route to MASTER_ADDR "
            f"10.213.0.1): {HOST} 10.213.0.1 (ranks 0,1), {HOST} 10.213.0.2 (ranks 2,3)"
            ) in logs[0]
    got = _params(tmp / "runs" / "two-hosts" / "model.pt")
    # Hierarchical all-reduce across the hosts adds in another order than one host's flat
    # one: equal to rounding, as the 1-rank vs N-rank comparisons of test_train.py.
    assert got.keys() == reference.keys()
    for k in got:
        assert torch.allclose(got[k], reference[k], rtol=0, atol=2e-5), \
            (k, (got[k] - reference[k]).abs().max())


HELLO = ("torchrun --nnodes 2 --nproc-per-node 2 --node-rank $NODE_RANK --master-addr $HOST0 "
         "--master-port 29400 -m microddp.commands.hello")


def _two_hosts_hello(net, tmp_path, **host1_env) -> list[str]:
    procs = [_start(net, 0, HELLO, tmp_path, MICRODDP_TIMEOUT="30"),
             _start(net, 1, HELLO, tmp_path, MICRODDP_TIMEOUT="30", **host1_env)]
    logs = _finish(procs, timeout=180)
    assert all(p.returncode != 0 for p in procs), logs
    return logs


def test_a_rank_that_advertises_loopback_to_another_host_is_named(tmp_path):
    with netns_helpers.Fabric(2) as net:
        logs = _two_hosts_hello(net, tmp_path, GLOO_SOCKET_IFNAME="lo")
    line = (f"rank 2 on host {HOST} advertises the loopback address 127.0.0.1 to ranks on other "
            "hosts, which cannot reach it; set GLOO_SOCKET_IFNAME on that host")
    assert all(line in log for log in logs), logs


def test_microddp_run_nnodes_is_torchrun_on_every_host(tmp_path):
    command = ("microddp run -n 2 --nnodes 2 --node-rank $NODE_RANK --master-addr $HOST0 "
               "-m microddp.commands.hello")
    with netns_helpers.Fabric(2) as net:
        procs = [_start(net, h, command, tmp_path) for h in range(2)]
        logs = _finish(procs, timeout=180)
    assert [p.returncode for p in procs] == [0, 0], logs
    assert "all_reduce(sum of ranks) = 6 (expected 6)" in logs[0]
    assert "hello from rank 3 of 4 (local rank 1" in logs[1]
