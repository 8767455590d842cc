"""What microddp does on GPUs, checked on a CPU-only machine by standing in for CUDA: which
backend and device a rank ends with, and what reaches NCCL. Nothing here runs a GPU kernel."""

import pytest
import torch
import torch.distributed as dist

import microddp as mdp
from microddp.transport.peers import Peers
from microddp.world import world


@pytest.fixture
def torch_group(tmp_path, monkeypatch):
    """A world of one formed the way a torch script does, `init_process_group()` without a
    backend (torch 2.6+ calls that backend "undefined" and picks one per tensor device)."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    dist.init_process_group(init_method=f"file://{tmp_path / 'rdv'}", rank=0, world_size=1)
    assert str(dist.get_backend()) == "undefined"


def _stand_in_for_two_gpus(monkeypatch) -> list[int]:
    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    return chosen


def test_a_group_without_a_backend_is_gloo_on_a_cpu_machine(torch_group):
    w = world.get_world()
    assert (w.backend, w.device) == ("gloo", torch.device("cpu"))
    assert not Peers().nccl


def test_a_group_without_a_backend_is_nccl_on_the_local_ranks_gpu(torch_group, monkeypatch):
    chosen = _stand_in_for_two_gpus(monkeypatch)
    w = world.get_world()
    assert (w.backend, w.device, chosen) == ("nccl", torch.device("cuda", 1), [1])
    # CUDA tensors on this group go through NCCL: the collectives must batch their sends
    # and receives, or two ranks that both send first block each other's streams.
    assert Peers().nccl


@pytest.mark.parametrize("env", [
    {"LOCAL_RANK": "2"},                            # this rank has no GPU of its own
    {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"},   # 4 ranks on this host, 2 GPUs
    {},                                             # no launcher said which GPU is whose
])
def test_a_group_without_a_backend_stays_on_the_cpu_without_a_gpu_per_rank(torch_group,
                                                                          monkeypatch, env):
    # torch runs a CPU script over such a group (gloo for CPU tensors): so must we, not refuse
    chosen = _stand_in_for_two_gpus(monkeypatch)
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    w = world.get_world()
    assert (w.backend, w.device, chosen) == ("gloo", torch.device("cpu"), [])


def test_nccl_exchanges_send_complex_tensors_as_real_ones(torch_group, monkeypatch):
    posted = []
    monkeypatch.setattr(dist, "P2POp", lambda op, t, peer, group: posted.append(t))
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: [])
    peers = Peers()
    peers.nccl = True  # NCCL has no complex type: torch's own collectives view them as real
    out, inbox = torch.ones(3, dtype=torch.complex64), torch.zeros(3, dtype=torch.complex64)
    peers.exchange(out, 0, inbox, 0)
    assert [(t.dtype, tuple(t.shape)) for t in posted] == [(torch.float32, (3, 2))] * 2
    assert posted[0].data_ptr() == inbox.data_ptr() and posted[1].data_ptr() == out.data_ptr()


def test_device_ids_must_name_the_modules_device():
    # A module on the meta device stands in for one on another GPU than device_ids names.
    module = torch.nn.Linear(2, 2, device="meta")
    with pytest.raises(mdp.MicroDDPError, match=r"device_ids=\[0\], but the module is on meta"):
        mdp.DistributedDataParallel(module, device_ids=[0])


def test_a_module_left_on_the_cpu_under_nccl_is_a_clear_error(torch_group, monkeypatch):
    world.get_world()  # adopted as gloo; from here on the group claims to be NCCL
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    with pytest.raises(mdp.MicroDDPError, match="NCCL, which moves CUDA tensors only, but the "
                                                "module has tensors on cpu"):
        mdp.DistributedDataParallel(torch.nn.Linear(2, 2))


def test_a_world_of_one_uses_its_gpu_without_starting_cuda(monkeypatch):
    chosen = _stand_in_for_two_gpus(monkeypatch)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    w = mdp.init()
    assert (w.backend, w.device, chosen) == (None, torch.device("cuda", 1), [])


@pytest.mark.parametrize("env, backend", [
    ({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"}, "gloo"),  # 4 ranks on 2 GPUs: all on gloo
    ({}, "gloo"),  # no LOCAL_RANK: the ranks are taken to share this host
    ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, "nccl"),
])
def test_every_rank_of_a_host_chooses_the_same_backend(monkeypatch, env, backend):
    _stand_in_for_two_gpus(monkeypatch)
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", env.get("LOCAL_RANK", "0"))
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MICRODDP_MONITOR", "0")  # the group is faked: nothing to watch
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    formed = []
    monkeypatch.setattr(world, "store_args", lambda *a: {})
    monkeypatch.setattr(dist, "init_process_group", lambda b, **kw: formed.append(b))
    monkeypatch.setenv("MICRODDP_MONITOR", "0")  # a stand-in group: no store to monitor with
    assert mdp.init().backend == backend and formed == [backend]
    assert [world.choose_backend(None, r, 4) for r in range(4)] == ["gloo"] * 4


def test_doctor_runs_its_live_test_over_nccl_too_where_there_are_gpus(monkeypatch, capsys):
    import argparse
    import importlib

    from microddp.commands import doctor

    _stand_in_for_two_gpus(monkeypatch)
    monkeypatch.setattr(world, "backend_available", lambda name: name in ("gloo", "nccl"))
    backends = []

    def spawn(fn, n, timeout, backend):
        backends.append(backend)
        return [(3.0, None)] * n

    monkeypatch.setattr(importlib.import_module("microddp.launch.spawn"), "spawn", spawn)
    assert doctor.run(argparse.Namespace(skip_live=False)) == 0
    assert backends == ["gloo", "nccl"]
    assert "live nccl ring_all_reduce 2 ranks get all 1001" in capsys.readouterr().out


def test_cpu_benchmarks_ask_for_gloo_even_on_a_gpu_host(monkeypatch):
    """Their tensors are made on the CPU: under the NCCL a GPU host would otherwise get,
    the first collective fails."""
    import importlib

    from microddp import commands as cli
    from microddp.predict import calibrate

    class Started(Exception):
        pass

    backends = []

    def spawn(fn, n, args=(), **kwargs):
        backends.append(kwargs.get("backend"))
        raise Started

    monkeypatch.setattr(importlib.import_module("microddp.launch.spawn"), "spawn", spawn)
    monkeypatch.setattr(calibrate, "spawn", spawn)
    monkeypatch.setattr(importlib.import_module("microddp.trace.steps"), "spawn", spawn)
    for start in (lambda: cli.main(["bench", "ddp", "--dims", "8"]), calibrate.alpha_beta,
                  lambda: calibrate.measured_step(2, "microddp", 8, 1, 4),
                  lambda: calibrate.rank_rate(8, 1, 4),
                  lambda: cli.main(["trace", "--overhead", "--steps", "3"])):
        with pytest.raises(Started):
            start()
    assert backends == ["gloo"] * 5
