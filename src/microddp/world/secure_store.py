"""Which store a rank meets the others at when the job has a secret, and hosting it.

Three cases, read from the environment a launcher leaves:
- `microddp run` (one host) serves a store that checks the secret itself beside torch's and
  says so with MICRODDP_AGENT_STORE=secret: every rank is its client at MICRODDP_STORE_PORT;
- torchrun (or `microddp run --nnodes`, which becomes torchrun) serves torch's own TCPStore,
  which checks nothing: the ranks leave it to torchrun's agents and meet at a store of their own,
  hosted by rank 0 at MASTER_PORT + 1 (MICRODDP_STORE_PORT to choose another);
- no launcher (env://, tcp://, SLURM's srun): rank 0 hosts it at the address given.
Without a secret nothing here runs: the store is torch's TCPStore, as before.
"""

from __future__ import annotations

import os
from datetime import timedelta

from ..errors import MicroDDPError
from .hosts import is_loopback
from .listen import bind
from .store_client import AuthStore
from .store_server import StoreServer

AGENT_STORE_ENV = "MICRODDP_AGENT_STORE"  # "secret": the launcher's store checks the secret
STORE_PORT_ENV = "MICRODDP_STORE_PORT"


# torch keeps a Python Store only through its C++ side, which cannot call back into a Python
# object that was collected: every store handed to torch is kept here for the process's life
# (rank 0's server with it: other ranks may still be reading from it at its exit).
_LIVE: list[AuthStore] = []


class HostedStore(AuthStore):
    """Rank 0's client of the server it hosts in this process."""

    def __init__(self, server: StoreServer, host: str, secret: str, timeout: timedelta):
        self.server = server
        super().__init__(host, server.port, secret, timeout)


def host(addr: str, port: int, secret: str, timeout: timedelta) -> HostedStore:
    """Serve the job's store on `addr:port` (every interface for an address that is not
    loopback: other hosts must reach it) and return this process's client of it."""
    bind_addr = addr if is_loopback(addr) else "0.0.0.0"
    server = StoreServer(bind(bind_addr, port), secret)
    return HostedStore(server, addr, secret, timeout)


def _launcher_port(port: int) -> int:
    raw = os.environ.get(STORE_PORT_ENV)
    if raw:
        if not raw.isdigit() or not 0 < int(raw) < 65536:
            raise MicroDDPError(f"{STORE_PORT_ENV}={raw!r} must be a port number (1-65535)")
        return int(raw)
    if port + 1 > 65535:
        raise MicroDDPError(f"MASTER_PORT {port} leaves no port above it for the job's own "
                            f"store; set {STORE_PORT_ENV} to a free port, the same on every host")
    return port + 1


def secure_store(addr: str, port: int, rank: int, secret: str, timeout: timedelta,
                 under_launcher: bool) -> AuthStore:
    """The store that checks `secret`: the launcher's, or one rank 0 hosts (see above)."""
    if under_launcher and os.environ.get(AGENT_STORE_ENV) == "secret":
        store = AuthStore(addr, _launcher_port(port), secret, timeout)
    else:
        if under_launcher:  # torch's agent store: keep off it, meet one port above
            port = _launcher_port(port)
        store = host(addr, port, secret, timeout) if rank == 0 else \
            AuthStore(addr, port, secret, timeout)
    _LIVE.append(store)
    return store
