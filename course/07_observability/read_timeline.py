"""Chapter 7, script 1: record a timeline of a few DDP steps and read where the time went.

    python course/07_observability/read_timeline.py                # 2 ranks, overlap vs torch
    python course/07_observability/read_timeline.py --out runs/ch07    # ... and keep the files

Each rank notes spans (forward, backward, each bucket's all-reduce from launch to completion,
the wait for communication, the optimizer step). Rank 0 merges them into trace.json, one
compute track and one communication track per rank (open it at https://ui.perfetto.dev), and
a PNG of the last steps. Then the step is split: compute, exposed communication, the rest.
"""

import argparse
import tempfile

import microddp as mdp
from microddp.trace import steps as trace_cli

SETTINGS = {"dim": 384, "depth": 6, "batch": 32, "steps": 8, "bucket_cap_mb": 0.5}


def traced(world, out, engine):
    """Runs on every rank: train a few steps with the recorder on; every rank gets the summary."""
    return trace_cli.traced_steps(world, out, engine=engine, **SETTINGS)


def report(root: str, keep: bool) -> None:
    for engine in ("overlap", "torch"):
        s = mdp.spawn(traced, 2, args=(f"{root}/{engine}", engine), timeout=240, backend="gloo")[0]
        print(f"engine {engine}: mean over steps 1..{s['steps'] - 1} of 2 ranks")
        print(f"  step {s['step_ms']:.2f} ms = compute {s['compute_ms']:.2f} + exposed comm "
              f"{s['exposed_comm_ms']:.2f} + data {s['data_ms']:.2f} + other {s['other_ms']:.2f}")
        print(f"  communication {s['comm_ms']:.2f} ms = hidden {s['hidden_comm_ms']:.2f} + "
              f"exposed {s['exposed_comm_ms']:.2f}; overlap {s['overlap_pct']:.1f}%")
        files = (f"files: {s['trace_json']}, {s['timeline_png']}" if keep else
                 "files deleted at exit (--out DIR keeps them)")
        print(f"  waited for communication {s['wait_ms']:.2f} ms; {files}")
    print("overlap % = hidden / total communication: the share of the all-reduce time that "
          "backward covered")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="where to keep trace.json / timeline.png "
                        "(default: a temporary folder, removed at exit)")
    args = parser.parse_args()
    if args.out:
        report(args.out, keep=True)
        return
    with tempfile.TemporaryDirectory(prefix="microddp-ch07-") as root:
        report(root, keep=False)


if __name__ == "__main__":
    main()
