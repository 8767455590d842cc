"""`microddp` command line: one sub-command per job, each a thin call into another module.

Every command module offers `add_arguments(parser)`, `run(args) -> exit code`, a docstring
whose first line is the command's summary, and optionally an `EPILOG` with examples.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .errors import MicroDDPError

# name -> module. A module not written yet is simply not offered.
COMMANDS = {
    "doctor": "microddp.doctor",
    "hello": "microddp.hello",
    "run": "microddp.launch",
    "train": "microddp.train",
    "bench": "microddp.bench.cli",
    "trace": "microddp.trace_cli",
    "predict": "microddp.predict",
}


def _modules() -> dict:
    found = {}
    for name, path in COMMANDS.items():
        try:
            found[name] = importlib.import_module(path)
        except ModuleNotFoundError as e:
            if e.name is None or not path.startswith(e.name):
                raise  # a real missing dependency inside an existing module
    return found


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="microddp",
        description="Data parallelism from scratch: launcher, training job, benchmarks, tools.",
        epilog="example: microddp hello -n 4     (each command has --help with examples)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in _modules().items():
        summary = (module.__doc__ or "").strip().splitlines()[0]
        p = sub.add_parser(name, help=summary, description=module.__doc__,
                           epilog=getattr(module, "EPILOG", None),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except MicroDDPError as e:
        print(f"microddp {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"microddp {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
