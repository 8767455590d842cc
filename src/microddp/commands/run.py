"""Start N local workers of a script, as torchrun does: `microddp run -n N script.py [args]`.

Starts N workers with the environment torchrun gives them, prefixes every output line with
`[rank k]`, and if one worker fails stops the rest at once (each with its process group),
repeats the failing rank's last lines, and exits non-zero (`--expendable RANKS` lets those ranks
fail while the others go on, as a parameter server's workers may). `--max-restarts K` starts the whole
group again after a failure, unless a worker exited with 2 (a usage error: a restart would
repeat it). SIGTERM, SIGINT, SIGHUP and SIGQUIT stop the job (exit 128 + signal); so does a
closed output pipe, quietly (exit 141, as `| head` expects). With `--nnodes`, this host's
share of a job on several hosts is started by torchrun itself (launch/hosts.py).
"""

from __future__ import annotations

import argparse

from ..errors import MicroDDPError
from ..flags import rank_list
from ..launch.hosts import DEFAULT_JOIN_TIMEOUT_S, launch_hosts
from ..launch.run import launch

EPILOG = """\
examples:
  microddp run -n 2 -m microddp.commands.hello                 # 2 local workers of a module
  microddp run -n 2 -m microddp.train --epochs 1      # the training job, one worker per rank
  microddp run -n 2 --max-restarts 2 -m microddp.train --epochs 2 --out runs/restartable
  microddp run -n 3 --expendable 1-2 -m microddp.train --strategy async --epochs 1
                       # a parameter server goes on when a worker dies: let the launcher too
SCRIPT is any Python file that calls microddp.init() (or torch.distributed's
init_process_group); the course scripts start their own ranks: run them with plain python.

many hosts: microddp scripts run unchanged under torchrun, e.g. on each of 2 hosts
(NODE_RANK 0 and 1, HOST0 host 0's address; docs/11-many-hosts.md has c10d and SLURM)
  torchrun --nnodes 2 --nproc-per-node 4 --node-rank $NODE_RANK \\
           --master-addr $HOST0 --master-port 29400 -m microddp.commands.hello
or, the same torchrun command spelled by microddp run (host 0 at 10.0.0.1; --node-rank 1
on the other host):
  microddp run -n 4 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 -m microddp.commands.hello
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `microddp run`: workers, restarts, port, and the script with its arguments."""
    p.add_argument("-n", "--nproc", type=int, default=2, help="number of workers (default 2)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="restart all workers up to K times after a failure, except exit code 2 "
                        "(default 0)")
    p.add_argument("--master-port", type=int, default=0,
                   help="rendezvous port on 127.0.0.1 (default: a free one); with --nnodes, "
                        "on --master-addr (default 29400)")
    p.add_argument("--nnodes", type=int, default=1,
                   help="hosts in the job, as torchrun's: above 1, this host's -n workers are "
                        "started by torchrun itself (default 1)")
    p.add_argument("--node-rank", type=int, default=0,
                   help="with --nnodes: this host's number, 0 on the --master-addr host "
                        "(default 0)")
    p.add_argument("--master-addr", default=None,
                   help="with --nnodes: the address of host 0, the same on every host "
                        "(default: none, one host)")
    p.add_argument("--expendable", default="", metavar="RANKS",
                   help="ranks whose failure does not stop the others, e.g. 1-3 (a parameter "
                        "server's workers; default: none, any failure stops the job); one that "
                        "exits with 75 says a rank it needs is gone, and stops the job")
    p.add_argument("--join-timeout", type=float, default=DEFAULT_JOIN_TIMEOUT_S,
                   help="with --nnodes: seconds to wait for every host before torchrun starts; "
                        "then the node ranks that never came are named "
                        f"(default {DEFAULT_JOIN_TIMEOUT_S:g})")
    p.add_argument("-m", dest="module", action="store_true",
                   help="treat SCRIPT as a module name, as `python -m` does")
    p.add_argument("script", help="the Python script (or module, with -m) each worker runs")
    rest = p.add_argument("script_args", nargs=argparse.REMAINDER,
                          help="arguments for the script")
    rest.required = False  # argparse would list it as missing beside the script


def run(args: argparse.Namespace) -> int:
    """Launch the workers, restarting up to --max-restarts times; return the exit code."""
    from ..shm.group import sizes
    sizes(2)  # a bad MICRODDP_SHM_* size: one line here, not a traceback from every rank
    if args.nnodes != 1 or args.master_addr is not None:
        if args.expendable:  # torchrun, which runs the hosts' workers, stops all on any failure
            raise MicroDDPError("--expendable works on one host only: with --nnodes, torchrun "
                                "starts the workers and stops them all when one fails; drop "
                                "--expendable (a parameter server's run then restarts from its "
                                "checkpoint with --max-restarts)")
        return launch_hosts(args.script, args.script_args, nproc=args.nproc,
                            nnodes=args.nnodes, node_rank=args.node_rank,
                            master_addr=args.master_addr, master_port=args.master_port,
                            module=args.module, max_restarts=args.max_restarts,
                            join_timeout=args.join_timeout)
    return launch(args.script, args.script_args, nproc=args.nproc, module=args.module,
                  max_restarts=args.max_restarts, master_port=args.master_port,
                  expendable=rank_list("expendable", args.expendable))
