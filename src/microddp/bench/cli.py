"""Measure microddp against PyTorch side by side: `microddp bench ddp|allreduce|scaling`."""

from __future__ import annotations

import argparse
import importlib

EPILOG = """\
examples:
  microddp bench allreduce           # ring / tree / naive vs gloo, 1 KiB .. 64 MiB
  microddp bench ddp                 # microddp DDP vs PyTorch DDP vs naive, dims 128..1024
  microddp bench scaling             # strong and weak scaling, 1..N ranks
each benchmark has its own --help.
"""

# name -> module offering add_arguments(parser) and run(args) -> int
BENCHMARKS = {
    "allreduce": "microddp.bench.allreduce",
    "ddp": "microddp.bench.ddp",
    "scaling": "microddp.bench.scaling",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for name, path in BENCHMARKS.items():
        try:
            module = importlib.import_module(path)
        except ModuleNotFoundError as e:
            if e.name is None or not path.startswith(e.name):
                raise
            continue  # not written yet
        b = sub.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0],
                           description=module.__doc__, epilog=getattr(module, "EPILOG", None),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(b)
        b.set_defaults(_bench=module.run)


def run(args: argparse.Namespace) -> int:
    return int(args._bench(args) or 0)
