"""Starting ranks: `spawn` (a function on N local ranks with a deadline: tests, benchmarks,
the course), `run.launch` (a script on N local workers, as torchrun would start it: what
`microddp run`, `train` and `hello` call) and what both need (procs: the store, the workers'
environment, stopping a process tree)."""

from .spawn import spawn

__all__ = ["spawn"]
