"""Chapter 1, script 1: is this machine ready for distributed PyTorch?

    python course/01_first_program/verify_setup.py

Checks what the chapter needs (torch, CUDA, the communication backends) and then lets two
processes actually talk. `microddp doctor` runs the same checks with more advice.
"""

import argparse
import platform

import torch
import torch.distributed as dist

import microddp as mdp
from microddp.world.world import backend_available


def live_check(world: mdp.World) -> float:
    """Each rank contributes rank + 1; with 2 ranks every rank must see 3."""
    t = torch.tensor([float(world.rank + 1)])
    mdp.comms.all_reduce(t, "sum")
    return t.item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2, help="processes in the live check")
    args = parser.parse_args()
    if args.world_size < 1:
        parser.error("--world-size must be at least 1")

    print(f"Python {platform.python_version()}, PyTorch {torch.__version__}")
    print(f"torch.distributed available: {dist.is_available()}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    print(f"CUDA available: {torch.cuda.is_available()} ({gpus} GPU(s))")
    for name in ("nccl", "gloo", "mpi"):
        print(f"backend {name:5s}: {'available' if backend_available(name) else 'not available'}")

    # mp.spawn-style start of N processes, each joining a gloo group on 127.0.0.1.
    results = mdp.spawn(live_check, args.world_size, timeout=60, backend="gloo")
    expected = args.world_size * (args.world_size + 1) / 2
    ok = all(r == expected for r in results)
    print(f"live all_reduce over {args.world_size} processes: {results} "
          f"(expected {expected:g} everywhere) -> {'OK' if ok else 'FAILED'}")
    print("Ready for distributed training!" if ok else "Something is wrong: run `microddp doctor`")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
