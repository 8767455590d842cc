"""How ranks find each other: the rendezvous store that `init` hands to init_process_group.

Rank 0 hosts a TCPStore on exactly the address given (loopback stays loopback); the others,
or every rank under a launcher that hosts the store itself, connect to it. When the job has a
secret (MICRODDP_SECRET, MICRODDP_SECRET_FILE, always under `microddp run`), the store is
microddp's own, which lets in only processes that prove it (secure_store.py).
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from ..errors import MicroDDPError
from .hosts import is_loopback
from .listen import bind
from .secret import job_secret


def env_int(name: str, default: int | None) -> int | None:
    """The whole number in environment variable `name`, `default` if unset or empty."""
    raw = os.environ.get(name)
    if raw in (None, ""):
        return default
    try:
        return int(raw)
    except ValueError:
        raise MicroDDPError(f"environment variable {name}={raw!r} is not a whole number") from None


def make_store(
    addr: str, port: int, rank: int, world_size: int, timeout: timedelta
) -> dist.Store:
    """A TCPStore for rendezvous. Rank 0 hosts it on exactly `addr` (loopback stays loopback).

    Under a launcher that already hosts the store (torchrun, `microddp run`), every rank is a
    client, as PyTorch's own env:// handler does.
    """
    if port < 0 or port > 65535:
        raise MicroDDPError(f"port must be between 0 and 65535, got {port}")
    # The launcher's store serves MASTER_ADDR:MASTER_PORT only; any other address is ours to host.
    agent_store = (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
                   and (addr, str(port)) == (os.environ.get("MASTER_ADDR"),
                                             os.environ.get("MASTER_PORT")))
    secret = job_secret()
    if secret is not None:
        from .secure_store import secure_store  # noqa: PLC0415 (only for a job with a secret)

        return secure_store(addr, port, rank, secret, timeout, agent_store)
    if rank != 0 or agent_store:
        try:
            return dist.TCPStore(addr, port, world_size, is_master=False, timeout=timeout)
        except (RuntimeError, ValueError) as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise MicroDDPError(
                f"rank {rank} could not reach the rendezvous store at {addr}:{port} within "
                f"{timeout.total_seconds():g} s ({first}); is rank 0 running with the same "
                "MASTER_ADDR and MASTER_PORT?"
            ) from None
    bind_addr = addr if is_loopback(addr) else "0.0.0.0"  # a named host must be reachable
    sock = bind(bind_addr, port)
    store = dist.TCPStore(
        addr, sock.getsockname()[1], world_size, is_master=True, timeout=timeout,
        wait_for_workers=False, master_listen_fd=sock.fileno(),
    )
    sock.detach()  # the store owns the descriptor now and closes it when it goes
    return store


def _parse_tcp(init_method: str) -> tuple[str, int]:
    rest = init_method[len("tcp://"):].split("?")[0]
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit():
        raise MicroDDPError(f"init_method {init_method!r} must look like tcp://HOST:PORT")
    return host.strip("[]"), int(port)


def master_addr(init_method: str | None, store: dist.Store | None) -> str | None:
    """The address the ranks meet at, if an address is how they meet (env:// or tcp://)."""
    if store is not None:
        return None
    if init_method is None or init_method == "env://":
        return os.environ.get("MASTER_ADDR", "127.0.0.1")
    if init_method.startswith("tcp://"):
        return _parse_tcp(init_method)[0]
    return None


def store_args(
    init_method: str | None, store: dist.Store | None, rank: int, world_size: int,
    timeout: timedelta,
) -> dict:
    """Arguments for init_process_group: always a store, except for file:// which torch owns."""
    if store is not None:
        return {"store": store}
    if init_method is None or init_method == "env://":
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = env_int("MASTER_PORT", None)
        if port is None:
            raise MicroDDPError(
                "MASTER_PORT is not set; start with `microddp run -n N script.py` or torchrun, "
                "or pass init_method='tcp://127.0.0.1:PORT'"
            )
        return {"store": make_store(addr, port, rank, world_size, timeout)}
    if init_method.startswith("tcp://"):
        addr, port = _parse_tcp(init_method)
        return {"store": make_store(addr, port, rank, world_size, timeout)}
    if init_method.startswith("file://"):
        folder = Path(init_method[len("file://"):]).parent
        if not folder.is_dir():  # torch's FileStore would wait forever for a file it cannot make
            raise MicroDDPError(f"init_method {init_method!r}: the folder {folder} does not "
                                "exist; create it on a file system every rank sees")
        return {"init_method": init_method}
    raise MicroDDPError(
        f"unsupported init_method {init_method!r}; use env://, tcp://HOST:PORT or file:///PATH"
    )
