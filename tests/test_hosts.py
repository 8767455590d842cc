"""The pieces of running on many hosts that one machine can check: SLURM's node lists and
variables (and `srun`-style ranks that find each other through them), the interface that
routes to an address, and the preflight's verdict on what the ranks published."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from microddp.errors import MicroDDPError
from microddp.world import hosts, preflight, slurm


@pytest.mark.parametrize("text, expected", [
    ("node[01-03,7]", ["node01", "node02", "node03", "node7"]),
    ("node[01-03,7],login1", ["node01", "node02", "node03", "node7", "login1"]),
    ("gpu5", ["gpu5"]),
    ("r[1-2]n[08-10]", ["r1n08", "r1n09", "r1n10", "r2n08", "r2n09", "r2n10"]),
    ("a[9-11],b,c[1]", ["a9", "a10", "a11", "b", "c1"]),
])
def test_expand_nodelist(text, expected):
    assert slurm.expand_nodelist(text) == expected


@pytest.mark.parametrize("bad", ["node[01-03", "node[a-b]", "node]1["])
def test_a_malformed_nodelist_is_one_error(bad):
    with pytest.raises(MicroDDPError, match="SLURM node list"):
        slurm.expand_nodelist(bad)


def test_tasks_per_node():
    assert slurm.tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert slurm.tasks_per_node("4") == [4]


def test_slurm_variables_become_torchruns():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
           "SLURM_TASKS_PER_NODE": "2(x3)", "SLURM_JOB_NODELIST": "node[07-09]",
           "SLURM_JOB_ID": "123456"}
    assert slurm.from_slurm(env) == {
        "RANK": "5", "WORLD_SIZE": "6", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "node07", "MASTER_PORT": str(20000 + 123456 % 20000)}
    # the user's MASTER_ADDR/PORT stand; torchrun's RANK (torchrun under SLURM) wins outright
    assert "MASTER_ADDR" not in slurm.from_slurm({**env, "MASTER_ADDR": "10.0.0.1"})
    assert slurm.from_slurm({**env, "RANK": "0"}) == {}
    assert slurm.from_slurm({"SLURM_JOB_ID": "1"}) == {}


SRUN_TASK = """
import torch
import microddp as mdp
w = mdp.init()
t = torch.tensor([w.rank + 1.0])
mdp.comms.all_reduce(t)
print(f"rank {w.rank} of {w.world_size} local {w.local_rank} sum {t.item():g}", flush=True)
mdp.shutdown()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_init_reads_slurm_variables_when_torchruns_are_absent():
    """Two tasks as `srun --ntasks 2` starts them on one node: only SLURM_* variables (and a
    port), no RANK/WORLD_SIZE/MASTER_ADDR; they must find each other and all-reduce."""
    base = {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                         "MASTER_PORT")}
    base.update({"SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "localhost", "SLURM_NODEID": "0",
                 "SLURM_TASKS_PER_NODE": "2", "MASTER_PORT": str(_free_port())})
    procs = [subprocess.Popen([sys.executable, "-c", SRUN_TASK], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env={**base, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)})
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=90)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "rank 0 of 2 local 0 sum 3" in outs[0] and "rank 1 of 2 local 1 sum 3" in outs[1]


def test_the_route_to_loopback_is_lo():
    assert hosts.route_source("127.0.0.1") == "127.0.0.1"
    assert hosts.interface_of("127.0.0.1") == "lo"
    assert hosts.ipv4_of("lo") == "127.0.0.1"
    assert hosts.is_loopback("localhost") and not hosts.is_loopback("10.213.0.1")
    # nothing is chosen for a loopback route: the preflight reports it instead
    saved = {v: os.environ.pop(v, None) for v in hosts.IFNAME_VARS}
    try:
        assert hosts.choose_interface("127.0.0.1") is None
        assert not any(os.environ.get(v) for v in hosts.IFNAME_VARS)
    finally:
        for v, value in saved.items():
            if value is not None:
                os.environ[v] = value


def test_an_interface_that_does_not_exist_is_one_error(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuch0")
    with pytest.raises(MicroDDPError, match="no interface 'nosuch0'"):
        hosts.advertised()


def _info(rank, host_id, addr):
    return {"rank": rank, "host": "vm", "host_id": host_id, "addr": addr, "port": 1}


def test_preflight_names_the_rank_that_advertises_loopback_to_another_host():
    infos = [_info(0, "A", "10.213.0.1"), _info(1, "A", "10.213.0.1"),
             _info(2, "B", "127.0.0.1"), _info(3, "B", "127.0.0.1")]
    line = preflight.problem_with(infos, "GLOO_SOCKET_IFNAME")
    assert line.startswith("rank 2 on host vm advertises the loopback address 127.0.0.1")
    assert "set GLOO_SOCKET_IFNAME on that host" in line
    # one host: the loopback is right
    assert preflight.problem_with([_info(0, "A", "127.0.0.1"), _info(1, "A", "127.0.0.1")],
                                  "GLOO_SOCKET_IFNAME") is None


def test_microddp_run_nnodes_spells_torchruns_command():
    from microddp.launch.hosts import torchrun_argv

    argv = torchrun_argv("microddp.train", ["--epochs", "1"], nproc=4, nnodes=2, node_rank=1,
                         master_addr="10.0.0.1", module=True)
    assert argv[1:] == ["-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "4",
                        "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port",
                        "29400", "--max-restarts", "0", "-m", "microddp.train", "--epochs", "1"]
    with pytest.raises(MicroDDPError, match="needs --master-addr"):
        torchrun_argv("x.py", [], nproc=1, nnodes=2, node_rank=0, master_addr=None)
    with pytest.raises(MicroDDPError, match="--node-rank 2 is outside 0..1"):
        torchrun_argv("x.py", [], nproc=1, nnodes=2, node_rank=2, master_addr="h")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_roll_call_returns_when_every_host_answers():
    """Two "hosts" on the loopback, in two threads: both return (host 0 keeps the store up
    until host 1 has seen the full roll)."""
    import threading

    from microddp.launch.rollcall import roll_call

    port, errors = _free_port(), []

    def host(rank: int) -> None:
        try:
            roll_call("127.0.0.1", port, 2, rank, timeout_s=60)
        except Exception as e:  # reported below: a thread's exception would be lost
            errors.append(e)

    threads = [threading.Thread(target=host, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and errors == []


def test_the_roll_call_names_the_node_ranks_that_never_came():
    from microddp.launch.rollcall import roll_call

    port = _free_port()
    with pytest.raises(MicroDDPError) as e:
        roll_call("127.0.0.1", port, 3, 0, timeout_s=1)
    assert str(e.value).startswith(f"node rank(s) 1, 2 of 3 never joined the rendezvous at "
                                   f"127.0.0.1:{port} within 1 s; start `microddp run` on that "
                                   "host with its --node-rank")
