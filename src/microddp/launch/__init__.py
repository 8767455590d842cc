"""Starting ranks: `spawn` (a function on N local ranks with a deadline: tests, benchmarks,
the course), `run` (the launcher `microddp run` is, as torchrun would start a script) and what
both need (procs: the store, the workers' environment, stopping a process tree)."""

from .spawn import spawn

__all__ = ["spawn"]
