"""What every launcher needs: a rendezvous store on a free loopback port, torchrun's
environment for each worker, and a way to stop workers so that none outlives its launcher.

The job's secret is a fresh random one per job (or MICRODDP_SECRET / MICRODDP_SECRET_FILE when
the user gives one), handed to the workers in their environment, which only the same user (and
root) can read.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from ..errors import MicroDDPError

if TYPE_CHECKING:
    import torch.distributed as dist

    from ..world.store_server import StoreServer

LOOPBACK = "127.0.0.1"


@dataclass
class AgentStore:
    """The stores the launcher hosts; workers join them as clients, as under torchrun.

    Two, both on loopback: torch's TCPStore at MASTER_PORT, for a plain PyTorch script's
    `init_process_group()` (torch's env:// reads only that), and microddp's own at
    MICRODDP_STORE_PORT, which `microddp.init` uses and which lets in only a process that proves
    the job's secret: loopback keeps the network out, the secret keeps out the machine's other
    users too. Binding our own socket to port 0 and handing it to the store means the port is
    chosen by the kernel and held from that moment on: no window in which another process can
    take it.
    """

    store: dist.TCPStore | None
    addr: str
    port: int
    secret: str
    server: StoreServer | None = None
    secure_port: int = 0

    @classmethod
    def start(cls, port: int = 0, addr: str = LOOPBACK,
              timeout: float | timedelta | None = None) -> AgentStore:
        """Both stores on `addr` (`port` for torch's; 0 picks a free one), for the workers."""
        if not 0 <= port <= 65535:
            raise MicroDDPError(f"port must be between 0 and 65535, got {port}; 0 picks a free "
                                "one")
        # Here, not above: the store is the one thing of torch's a launcher needs, so its
        # --help and argument errors never wait for torch to load.
        import torch.distributed as dist

        from ..world.rendezvous import bind
        from ..world.secret import job_secret, new_secret
        from ..world.store_server import StoreServer
        from ..world.world import _as_timedelta

        sock = bind(addr, port)
        port = sock.getsockname()[1]
        store = dist.TCPStore(addr, port, None, is_master=True, wait_for_workers=False,
                              timeout=_as_timedelta(timeout), master_listen_fd=sock.fileno())
        sock.detach()  # the store owns and closes the descriptor
        secret = job_secret() or new_secret()
        server = StoreServer(bind(addr, 0), secret)
        return cls(store, addr, port, secret, server, server.port)

    def close(self) -> None:
        """Stop serving: the job is over."""
        if self.server is not None:
            self.server.close()
        self.store = None  # torch's server closes with its last reference


def new_run_id() -> str:
    """A job's TORCHELASTIC_RUN_ID: unique, as torchrun --standalone makes it (a uuid4)."""
    return str(uuid.uuid4())


def worker_env(base: dict, rank: int, world_size: int, store: AgentStore,
               restart: int = 0, max_restarts: int = 0, *, run_id: str) -> dict:
    """The variables torchrun (LocalElasticAgent) sets for a worker on a single host.

    `run_id` names the job: the same for every worker and every restart of it.
    """
    env = dict(base)
    env.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0", GROUP_WORLD_SIZE="1",
        ROLE_NAME="default", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(world_size),
        MASTER_ADDR=store.addr, MASTER_PORT=str(store.port),
        TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT=str(restart),
        TORCHELASTIC_MAX_RESTARTS=str(max_restarts), TORCHELASTIC_RUN_ID=run_id,
        PYTHONUNBUFFERED="1", MICRODDP_SECRET=store.secret, MICRODDP_AGENT_STORE="secret",
        MICRODDP_STORE_PORT=str(store.secure_port),
    )
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # torchrun's default, if not set
    # Like torchrun: N busy workers on a few cores must not each start a full thread pool.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world_size)))
    return env


def _load_libc():
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None  # not Linux with glibc: the launcher's own cleanup still applies


# Loaded here, once, not in the child: between fork and exec a child of a threaded launcher may
# only do what needs no lock another thread could have held at the fork, and dlopen takes one.
_LIBC = _load_libc()
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int | None = None) -> None:
    """Ask Linux to SIGKILL this process when its parent dies (no orphans, even on kill -9).

    `parent` is the pid the parent had before starting this process: if it has already died,
    the request came too late to fire, so exit now.
    """
    if _LIBC is None or not hasattr(_LIBC, "prctl"):
        return
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent is not None and os.getppid() != parent:
        sys.stdout.flush()  # os._exit skips it: what was printed so far still goes out
        sys.stderr.flush()
        os._exit(1)


def kill_all(workers: list[tuple[int, Callable[[], bool]]], grace: float = 3.0,
             groups: bool = True) -> None:
    """SIGTERM each worker (and its process group), then SIGKILL what is left after `grace`.

    `workers` pairs each pid with a liveness check that also reaps it (Popen.poll,
    Process.is_alive), so the caller still learns each worker's exit code. With `groups`, every
    worker's group is signalled even when the worker itself has exited: a crashed worker's own
    children (data loaders, helpers) are still in its group and must not outlive the job.
    """
    def send(pid: int, sig: int) -> bool:
        try:
            os.killpg(pid, sig) if groups else os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def running(pid: int, check: Callable[[], bool]) -> bool:
        alive = check()  # first, so that an exited worker is reaped
        return alive or (groups and send(pid, 0))  # signal 0: does the group still exist?

    alive = [(pid, check) for pid, check in workers if running(pid, check)]
    for pid, _ in alive:
        send(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [(pid, check) for pid, check in alive if running(pid, check)]
    for pid, _ in alive:
        send(pid, signal.SIGKILL)


def describe_exit(code: int) -> str:
    """'exit code 3' or 'killed by SIGKILL' from a Popen-style return code."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
