"""A roll call of the hosts before torchrun starts on them (`microddp run --nnodes`).

torchrun's rendezvous waits for every host in silence and, at its deadline, says only that it
timed out; a mistyped `--master-addr` sends a host into the same long wait. So before handing
over to torchrun, every host answers a roll call in a small store at `--master-addr:--master-port`,
served by host 0 for the few seconds it lasts:
- host 0 first checks that `--master-addr` is one of its own addresses;
- every other host checks that it reaches that address at all, and stops at once when no
  machine answers there (no route, no host on the link), rather than at the deadline;
- at `--join-timeout`, every host that came stops with one line naming the node rank(s) that
  never came and what to check.
Then the store closes and torchrun takes the same port for its own rendezvous. With a job
secret (MICRODDP_SECRET or MICRODDP_SECRET_FILE on every host) the roll call's store is
microddp's own, which lets in only the hosts that prove it.
"""

from __future__ import annotations

import errno
import socket
import time
from datetime import timedelta
from typing import TYPE_CHECKING

from ..errors import MicroDDPError

if TYPE_CHECKING:
    import torch.distributed as dist

# No machine answers at the address: a retry cannot help (host 0 being slow to start is
# ECONNREFUSED or a timeout instead, retried until the deadline).
_UNREACHABLE = (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EADDRNOTAVAIL)
PROBE_TIMEOUT_S = 5.0
_PREFIX = "microddp/rollcall/"


def _resolve(addr: str) -> str:
    try:
        return socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)[0][4][0]
    except OSError as e:
        raise MicroDDPError(f"cannot resolve --master-addr {addr!r} ({e}); give host 0's "
                            "address, or a name every host resolves") from None


def _own_address(addr: str, port: int) -> None:
    """Host 0 serves the rendezvous at `addr`: it must be one of this host's addresses."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((addr, 0))
        except OSError as e:
            if e.errno != errno.EADDRNOTAVAIL:
                raise
            raise MicroDDPError(
                f"--master-addr {addr} is not an address of this host, but --node-rank 0 serves "
                f"the rendezvous there (port {port}); give host 0's own address (`hostname -I` "
                "lists them), or run this host with its own --node-rank") from None


def _reach(addr: str, port: int, deadline: float) -> None:
    """Wait until something listens at addr:port; stop at once if no machine answers there."""
    last = "no answer"
    while True:
        try:
            socket.create_connection((addr, port), timeout=PROBE_TIMEOUT_S).close()
            return
        except OSError as e:
            if e.errno in _UNREACHABLE:
                raise MicroDDPError(
                    f"cannot reach --master-addr {addr} ({e.strerror}): no machine answers at "
                    "that address from this host; check the address of host 0 (`hostname -I` "
                    "there) and that this host has a route to it (`ip route get "
                    f"{addr}`)") from None
            last = e.strerror or "timed out"
        if time.monotonic() >= deadline:
            raise MicroDDPError(
                f"nobody served the rendezvous at {addr}:{port} within the join timeout "
                f"({last}); start host 0 (--node-rank 0) with the same --master-addr and "
                "--master-port, and check that its firewall lets this port in")
        time.sleep(0.5)


def _missing_line(missing: list[int], nnodes: int, addr: str, port: int, timeout_s: float
                  ) -> str:
    ranks = ", ".join(map(str, missing))
    return (f"node rank(s) {ranks} of {nnodes} never joined the rendezvous at {addr}:{port} "
            f"within {timeout_s:g} s; start `microddp run` on that host with its --node-rank "
            "and the same --nnodes, --master-addr and --master-port, and check that it can "
            f"reach {addr}:{port} (`ip route get {addr}`, firewall)")


def roll_call(master_addr: str, port: int, nnodes: int, node_rank: int,
              timeout_s: float) -> None:
    """Return once all `nnodes` hosts have answered at master_addr:port; else raise
    MicroDDPError with one line naming what is missing."""
    # Here, not above: `microddp run --help` and its argument errors need no torch.
    import torch.distributed as dist

    from ..world.rendezvous import bind
    from ..world.secret import job_secret

    addr = _resolve(master_addr)
    deadline = time.monotonic() + timeout_s
    wait = timedelta(seconds=timeout_s)
    secret = job_secret()
    server = None
    if secret is not None:
        from ..world.store_client import AuthStore
        from ..world.store_server import StoreServer

        if node_rank == 0:
            _own_address(addr, port)
            server = StoreServer(bind(addr, port), secret, name="microddp roll call")
        else:
            _reach(addr, port, deadline)
        left = max(1.0, deadline - time.monotonic())
        store = AuthStore(addr, port, secret, timedelta(seconds=left))
    elif node_rank == 0:
        _own_address(addr, port)
        sock = bind(addr, port)
        store = dist.TCPStore(addr, port, nnodes, is_master=True, timeout=wait,
                              wait_for_workers=False, master_listen_fd=sock.fileno())
        sock.detach()  # the store owns the descriptor now
    else:
        _reach(addr, port, deadline)
        left = max(1.0, deadline - time.monotonic())
        store = dist.TCPStore(addr, port, nnodes, is_master=False,
                              timeout=timedelta(seconds=left))
    try:
        store.set(f"{_PREFIX}here/{node_rank}", "1")
        missing = _judge(store, nnodes, deadline) if node_rank == 0 else _verdict(store, deadline)
        store.set(f"{_PREFIX}seen/{node_rank}", "1")
        if node_rank == 0:  # keep the store up until every host that came has the verdict
            came = [r for r in range(nnodes) if r not in missing]
            _poll(store, [f"{_PREFIX}seen/{r}" for r in came], time.monotonic() + 60.0)
    finally:
        del store
        if server is not None:
            server.close()
    if missing:
        raise MicroDDPError(_missing_line(missing, nnodes, master_addr, port, timeout_s))


def _poll(store: dist.Store, keys: list[str], deadline: float) -> bool:
    """Whether all `keys` are set by the deadline (polled: store.wait would log a C++ warning
    on its timeout, beside our one line)."""
    while not store.check(keys):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)
    return True


def _judge(store: dist.Store, nnodes: int, deadline: float) -> list[int]:
    """Host 0: wait for every host until the deadline, then tell all the node ranks missing."""
    keys = [f"{_PREFIX}here/{r}" for r in range(nnodes)]
    _poll(store, keys, deadline)
    missing = [r for r, k in enumerate(keys) if not store.check([k])]
    store.set(f"{_PREFIX}verdict", ",".join(map(str, missing)))
    return missing


def _verdict(store: dist.Store, deadline: float) -> list[int]:
    """Another host: host 0's verdict (it judges at its own deadline, a little before ours)."""
    try:
        if not _poll(store, [f"{_PREFIX}verdict"], deadline + 60.0):
            raise RuntimeError
    except Exception:  # no verdict, or host 0's store went away
        raise MicroDDPError("host 0 gave no answer in the roll call before torchrun; is its "
                            "`microddp run` still running?") from None
    text = store.get(f"{_PREFIX}verdict").decode()
    return [int(r) for r in text.split(",")] if text else []
