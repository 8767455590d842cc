"""`microddp run --nnodes N --node-rank R --master-addr HOST0`: a job on several hosts, started
by torchrun itself (its static rendezvous), with torchrun's meaning for every flag.

microddp has no multi-host launcher of its own: starting, watching and restarting workers
across machines is torchrun's job. This only spells the torchrun command from `microddp run`'s
flags and hands over to it (exec: signals and the exit code are torchrun's), after a roll call
of the hosts (rollcall.py) so that a host that never comes is named.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from ..errors import MicroDDPError
from .rollcall import roll_call

DEFAULT_PORT = 29400  # the same on every host: a free port cannot be picked independently
DEFAULT_JOIN_TIMEOUT_S = 600.0  # as torchrun's c10d join timeout: hosts may boot at their pace


def torchrun_argv(script: str, script_args: Sequence[str], *, nproc: int, nnodes: int,
                  node_rank: int, master_addr: str | None, master_port: int = 0,
                  module: bool = False, max_restarts: int = 0) -> list[str]:
    """The torchrun command line that runs `script` as this host's share of the job."""
    if nnodes < 1 or nproc < 1:
        raise MicroDDPError(f"--nnodes and --nproc must be at least 1, got {nnodes} and {nproc}")
    if not 0 <= node_rank < nnodes:
        raise MicroDDPError(f"--node-rank {node_rank} is outside 0..{nnodes - 1} (--nnodes "
                            f"{nnodes}); give each host its own number, 0 on the host of "
                            "--master-addr")
    if not master_addr:
        raise MicroDDPError("--nnodes above 1 needs --master-addr: the address of the host with "
                            "--node-rank 0, the same on every host")
    port = master_port or DEFAULT_PORT
    if not 0 < port < 65536:
        raise MicroDDPError(f"--master-port must be between 1 and 65535, got {port}")
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
            "--nproc-per-node", str(nproc), "--node-rank", str(node_rank),
            "--master-addr", master_addr, "--master-port", str(port),
            "--max-restarts", str(max_restarts), *(["-m"] if module else []), script,
            *script_args]


def _warn_without_secret(addr: str, port: int) -> None:
    from ..world.secret import job_secret  # noqa: PLC0415 (reads the file: errors are ours)

    if job_secret() is None:
        print(f"microddp run: warning: no job secret (MICRODDP_SECRET or MICRODDP_SECRET_FILE), "
              f"so anyone who reaches {addr}:{port} can join this job's rendezvous; see "
              "docs/security.md", file=sys.stderr, flush=True)


def launch_hosts(script: str, script_args: Sequence[str], *,
                 join_timeout: float = DEFAULT_JOIN_TIMEOUT_S, **kw) -> int:
    """Wait until every host answers the roll call (rollcall.py: one clear line, not a silent
    rendezvous timeout, for a host that never comes), then become torchrun for this host's
    share of the job (never returns unless exec fails)."""
    argv = torchrun_argv(script, script_args, **kw)
    if join_timeout <= 0:
        raise MicroDDPError(f"--join-timeout must be positive, got {join_timeout:g} seconds")
    if kw["nnodes"] > 1:
        roll_call(kw["master_addr"], kw.get("master_port") or DEFAULT_PORT, kw["nnodes"],
                  kw["node_rank"], join_timeout)
        # after the roll call: a mistake in the addresses is the one line, not this warning
        _warn_without_secret(kw["master_addr"], kw.get("master_port") or DEFAULT_PORT)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(argv[0], argv)
    return 1  # not reached
