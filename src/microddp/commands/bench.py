"""Measure microddp against PyTorch side by side: `microddp bench allreduce|ddp|scaling|pipeline|zero|async|tp|compiled`."""

from __future__ import annotations

import argparse

EPILOG = """\
examples:
  microddp bench allreduce           # ring / tree / naive vs gloo, 1 KiB .. 64 MiB
  microddp bench ddp                 # microddp DDP vs PyTorch DDP vs naive, dims 128..1024
  microddp bench scaling             # strong and weak scaling, 1..N ranks
  microddp bench pipeline --compute sleep   # GPipe, 1F1B, interleaved, zero-bubble
  microddp bench zero                # DP, ZeRO-1/2/3, torch's ZeRO and FSDP2 on 2 and 4 ranks
  microddp bench async               # sync dp vs a parameter server: S=0, backup, SSP, async
  microddp bench tp                  # tensor parallelism vs torch's parallelize_module, TP 2
  microddp bench compiled            # DDP(torch.compile(model)): microddp's vs torch's step
each benchmark has its own --help.
"""

# name -> (module offering add_arguments(parser) and run(args) -> int, summary)
BENCHMARKS = {
    "allreduce": ("microddp.bench.allreduce",
                  "ring / tree / naive all-reduce vs gloo, with a fitted cost model"),
    "ddp": ("microddp.bench.ddp", "microddp DDP vs PyTorch DDP vs the naive stage"),
    "scaling": ("microddp.bench.scaling", "strong and weak scaling over world sizes"),
    "pipeline": ("microddp.bench.pipeline",
                 "pipeline schedules: bubble, activation memory, step time vs torch's"),
    "zero": ("microddp.bench.zero", "memory per rank and step time: DP, ZeRO-1/2/3 vs torch's"),
    "async": ("microddp.bench.sync_async",
              "sync dp vs a parameter server: backup workers, SSP, async, a straggler"),
    "tp": ("microddp.bench.tp", "tensor (+ sequence) parallelism vs torch's parallelize_module"),
    "compiled": ("microddp.bench.compiled",
                 "torch.compile under DDP: microddp's compiled step vs torch's"),
}
# add_arguments needs the words after `bench` to pick the benchmark, whose own run() is called
NESTED = True


def add_arguments(p: argparse.ArgumentParser, argv: list[str]) -> None:
    """One sub-command per benchmark; only the one named in `argv` is imported."""
    from .dispatch import add_commands

    sub = p.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    add_commands(sub, BENCHMARKS, argv)
