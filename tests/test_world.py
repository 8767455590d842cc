"""init(): every rendezvous method, the choice of backend and device, and its errors."""

import os
import socket
from datetime import timedelta

import psutil
import pytest
import torch
import torch.distributed as dist

import microddp as mdp
from microddp import comms
from microddp.world import world


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sum_of_ranks(rank: int, method: str, n: int) -> tuple:
    """Join with `method`, then prove the group works: all ranks agree on 0 + 1 + ... + n-1."""
    if method == "env-rank0-hosts":
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE")
        os.environ["MASTER_PORT"] = os.environ["TEST_PORT"]
        w = mdp.init()
    elif method.startswith("tcp://") or method.startswith("file://"):
        w = mdp.init(init_method=method, rank=rank, world_size=n)
    elif method == "store":
        store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), n, is_master=False,
                              timeout=timedelta(seconds=30))
        w = mdp.init(store=store, rank=rank, world_size=n, timeout=30)
    else:
        w = mdp.init()  # torchrun-style environment from the launcher
    t = torch.tensor([float(w.rank)])
    comms.all_reduce(t)
    listening = []
    if w.rank == 0:
        me = psutil.Process()
        listening = sorted({c.laddr.ip for c in me.net_connections("tcp") if c.status == "LISTEN"})
    comms.shutdown()
    return w.rank, w.world_size, w.backend, str(w.device), float(t.item()), listening


@pytest.mark.parametrize("method", ["env", "env-rank0-hosts", "tcp", "file", "store"])
def test_every_rendezvous_method_forms_a_working_group(method, tmp_path, monkeypatch):
    n = 3
    if method == "tcp":
        method = f"tcp://127.0.0.1:{_free_port()}"
    elif method == "file":
        method = f"file://{tmp_path / 'rendezvous'}"
    monkeypatch.setenv("TEST_PORT", str(_free_port()))
    results = mdp.spawn(_sum_of_ranks, n, (method, n), timeout=60, join=False)
    for r, (rank, size, backend, device, total, _) in enumerate(results):
        assert (rank, size, backend, device, total) == (r, n, "gloo", "cpu", 3.0)
    if method in ("env-rank0-hosts",) or method.startswith("tcp://"):
        # Rank 0 hosted the store itself: on loopback only, never on every interface.
        assert results[0][5] == ["127.0.0.1"]


def test_timeout_accepts_seconds_and_timedelta():
    assert world._as_timedelta(5) == timedelta(seconds=5)
    assert world._as_timedelta(timedelta(minutes=2)) == timedelta(minutes=2)
    with pytest.raises(mdp.MicroDDPError, match="positive"):
        world._as_timedelta(-1)


def test_a_bad_microddp_timeout_is_one_line_in_init_and_in_the_launcher(monkeypatch, capsys):
    from microddp.commands import main

    monkeypatch.setenv("MICRODDP_TIMEOUT", "abc")
    with pytest.raises(mdp.MicroDDPError, match="MICRODDP_TIMEOUT must be a number of seconds"):
        mdp.init()
    assert main(["hello", "-n", "2"]) == 2  # the launcher read it too, and crashed
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["microddp hello: error: MICRODDP_TIMEOUT must be a number of seconds, got "
                   "'abc'"]


def test_backend_and_device_choice_on_this_machine():
    expected = "nccl" if torch.cuda.is_available() else "gloo"
    assert world.choose_backend(None, 0) == expected
    assert world.choose_device("gloo", 0) == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_nccl_without_gpus_is_a_clear_error():
    with pytest.raises(mdp.MicroDDPError, match="'nccl' is not available: no CUDA GPU"):
        world.choose_backend("nccl", 0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"world_size": 0}, "at least 1"),
        ({"world_size": 2, "rank": 2}, "outside the world"),
        ({"backend": "carrier-pigeon"}, "unknown backend"),
        ({"init_method": "smtp://x", "rank": 0, "world_size": 2}, "unsupported init_method"),
        ({"init_method": "tcp://nohostport", "rank": 0, "world_size": 2}, "tcp://HOST:PORT"),
        ({"timeout": 0}, "positive"),
        ({"timeout": "abc"}, "timeout must be a number of seconds, got 'abc'"),
        ({"timeout": True}, "timeout must be a number of seconds, got True"),
        ({"timeout": float("nan")}, "positive number of seconds up to .* got nan"),
        ({"timeout": float("inf")}, "positive number of seconds up to .* got inf"),
        ({"timeout": -3}, "positive number of seconds up to .* got -3"),
        ({"timeout": 1e30}, "positive number of seconds up to .* got 1e\\+30"),
        ({"init_method": "file:///no/such/folder/rdzv", "rank": 0, "world_size": 2},
         "the folder /no/such/folder does not exist"),
    ],
)
def test_bad_init_arguments(kwargs, message):
    with pytest.raises(mdp.MicroDDPError, match=message):
        mdp.init(**kwargs)


def test_port_already_taken_is_named(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
        with pytest.raises(mdp.MicroDDPError, match=f"port {port} on 127.0.0.1 is already in use"):
            mdp.init(init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2, timeout=5)


def test_missing_master_port_says_how_to_launch(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(mdp.MicroDDPError, match="MASTER_PORT is not set"):
        mdp.init()


def test_a_group_formed_by_torch_is_adopted(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert not world.get_world().distributed  # no group yet: a world of one
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdv'}", rank=0,
                            world_size=1)
    w = world.get_world()  # the world of one assumed before is stale now
    assert (w.rank, w.world_size, w.local_rank, w.backend, w.device.type) == (0, 1, 0, "gloo",
                                                                               "cpu")
    assert mdp.init() is w  # init() joins the same group, it does not form a second
    world._world = None
    with pytest.raises(mdp.MicroDDPError, match="already joined uses 'gloo'"):
        mdp.init(backend="mpi")
