"""A check through the rendezvous store, before the process group forms, that every rank can
reach every other one at the address gloo will advertise.

Without it, a rank that advertises 127.0.0.1 to a peer on another host, or an address a
firewall blocks, ends in gloo's `connectFullMesh failed ... Connection refused` on one host
and a silent wait on the others until the timeout. Here each rank publishes its host and
address (and a listening port on that address) in the store; each then checks, in seconds,
that no rank shows a loopback address to a rank on another host and that it can open a
connection to every rank on another host. Every rank learns every verdict, so all of them
stop with the same one line: which rank, on which host, at which address, and what to set.
"""

from __future__ import annotations

import json
import socket
from datetime import timedelta

import torch.distributed as dist

from ..errors import MicroDDPError
from .hosts import advertised, host_id, is_loopback

CONNECT_TIMEOUT_S = 3.0


def _listen(addr: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((addr, 0))
    except OSError as e:
        sock.close()
        raise MicroDDPError(f"this host cannot listen on {addr}, the address gloo would "
                            f"advertise ({e.strerror}); set GLOO_SOCKET_IFNAME to the interface "
                            "that reaches MASTER_ADDR") from None
    sock.listen(1024)  # peers only connect; the kernel completes it without an accept()
    return sock


def _wait(store: dist.Store, keys: list[str], timeout: timedelta, what: str) -> None:
    try:
        store.wait(keys, timeout)
    except Exception:  # torch raises DistStoreError (a RuntimeError) on a timeout
        missing = [k.rsplit("/", 1)[1] for k in keys if not store.check([k])]
        raise MicroDDPError(
            f"ranks {', '.join(missing)} did not {what} within {timeout.total_seconds():g} s; "
            "is every host started, with the same MASTER_ADDR and MASTER_PORT?") from None


def problem_with(infos: list[dict], var: str) -> str | None:
    """The first rank that shows a loopback address to a rank on another host, as one line."""
    hosts = {i["host_id"] for i in infos}
    if len(hosts) < 2:
        return None
    for i in infos:
        if is_loopback(i["addr"]):
            return (f"rank {i['rank']} on host {i['host']} advertises the loopback address "
                    f"{i['addr']} to ranks on other hosts, which cannot reach it; set {var} on "
                    f"that host to the interface that reaches MASTER_ADDR (`ip route get "
                    f"MASTER_ADDR` names it)")
    return None


def _reach(me: dict, infos: list[dict], var: str) -> str:
    """'' if this rank can connect to every rank on another host, else the first failure."""
    for i in infos:
        if i["host_id"] == me["host_id"]:
            continue
        try:
            socket.create_connection((i["addr"], i["port"]), timeout=CONNECT_TIMEOUT_S).close()
        except OSError as e:
            why = e.strerror or type(e).__name__
            return (f"rank {me['rank']} on host {me['host']} cannot reach rank {i['rank']} on "
                    f"host {i['host']} at {i['addr']} ({why}); set {var} on host {i['host']} to "
                    "the interface the other hosts reach it by, or open its firewall")
    return ""


def preflight(store: dist.Store, rank: int, world_size: int, timeout: timedelta
              ) -> list[dict]:
    """Check, through `store`, that the ranks can reach each other; return what each rank
    published (rank, host, host_id, addr, port). Raises MicroDDPError, the same on every rank,
    naming the first rank that cannot be reached and the variable to set."""
    var = "GLOO_SOCKET_IFNAME"
    # The store may outlive a round of workers (torchrun's elastic agent keeps it across
    # restarts, and a restarted host's agent counts its restarts from 0): number the rounds by
    # arrivals, world_size to a round, so every rank of this round writes under new keys.
    arrival = store.add("microddp/preflight/arrivals", 1)
    prefix = f"microddp/preflight/{(arrival - 1) // world_size}/"
    addr = advertised("GLOO_SOCKET_IFNAME")
    listener = None if is_loopback(addr) else _listen(addr)
    try:
        me = {"rank": rank, "host": socket.gethostname(), "host_id": host_id(), "addr": addr,
              "port": listener.getsockname()[1] if listener else 0}
        store.set(f"{prefix}who/{rank}", json.dumps(me))
        who = [f"{prefix}who/{r}" for r in range(world_size)]
        _wait(store, who, timeout, "publish their address")
        infos = [json.loads(store.get(k)) for k in who]
        problem = problem_with(infos, var) or _reach(me, infos, var)
        store.set(f"{prefix}verdict/{rank}", problem)
        verdicts = [f"{prefix}verdict/{r}" for r in range(world_size)]
        _wait(store, verdicts, timeout, "finish checking their peers")
        for k in verdicts:
            line = store.get(k).decode()
            if line:
                raise MicroDDPError(line)
        return infos
    finally:
        if listener is not None:
            listener.close()
