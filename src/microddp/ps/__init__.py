"""Asynchronous training with a parameter server: rank 0 holds the parameters (or ranks
0..S-1 a shard each, PSConfig.servers), the other ranks pull them and push gradients point to
point, under a staleness bound S (0 = synchronous, inf = fully asynchronous), with backup
workers, stragglers and lost workers.

    from microddp import ps
    report = ps.run(world, ps.Task(make_model, data.train, 64, data.test),
                    ps.PSConfig(steps=100, staleness=2))   # ServerReport on rank 0
"""

from .config import SERVER, PSConfig, parse_staleness, parse_straggler
from .job import run
from .policy import Held, Staleness, describe
from .server import Observer, Server, ServerReport, run_server
from .task import Task, accuracy, score
from .worker import WorkerReport, run_worker

__all__ = ["SERVER", "Held", "Observer", "PSConfig", "Server", "ServerReport", "Staleness",
           "Task", "WorkerReport", "accuracy", "describe", "parse_staleness", "parse_straggler",
           "run", "run_server", "run_worker", "score"]
