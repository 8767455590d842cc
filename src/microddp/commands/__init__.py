"""`microddp` command line: one sub-command per job, each a thin call into another module.

Every command module offers `add_arguments(parser)`, `run(args) -> exit code`, a docstring
(shown by `--help`) and optionally an `EPILOG` with examples.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator

from ..errors import MicroDDPError
from .dispatch import add_commands

# name -> (module, summary). Only the chosen command's module is imported: startup stays
# quick, and one command's missing extra dependency never breaks another command.
COMMANDS = {
    "doctor": ("microddp.commands.doctor", "check this machine: backends, loopback, a live all-reduce"),
    "hello": ("microddp.commands.hello", "start N processes that introduce themselves and talk"),
    "run": ("microddp.commands.run", "start N local workers of a script, as torchrun does"),
    "train": ("microddp.commands.train", "train a model data-parallel on real data (the main job)"),
    "bench": ("microddp.commands.bench", "benchmarks against PyTorch: allreduce, ddp, scaling, pipeline, zero, async"),
    "trace": ("microddp.commands.trace", "record and summarise a timeline of DDP steps"),
    "predict": ("microddp.commands.predict", "predict step time and scaling with a cost model"),
    "status": ("microddp.commands.status", "where every rank of a running job is, and who is waited for"),
    "exercise": ("microddp.commands.exercise", "course exercises: write a key function, check it on real ranks"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The `microddp` parser; only the command named in `argv` is imported and fully configured."""
    parser = argparse.ArgumentParser(
        prog="microddp",
        description="Data parallelism from scratch: launcher, training job, benchmarks, tools.",
        epilog="example: microddp hello -n 4     (each command has --help with examples)",
        allow_abbrev=False,  # `--epoch 1` must be an error, never quietly `--epochs 1`
    )
    add_commands(parser.add_subparsers(dest="command", metavar="COMMAND"), COMMANDS, argv)
    return parser


def all_parsers(path: list[str] | None = None) -> Iterator[tuple[list[str], argparse.ArgumentParser]]:
    """Every command's fully built parser with the words that name it (`[]` for `microddp`
    itself, then `["bench", "ddp"]`...), parents first: the docs' CLI reference is made from
    these, so it shows exactly what --help shows."""
    path = path or []
    parser = build_parser(path)
    for name in path:
        parser = _subcommands(parser)[name]
    yield path, parser
    for name in _subcommands(parser):
        yield from all_parsers([*path, name])


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The sub-parsers of `parser` by name (argparse keeps them in a private action)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def main(argv: list[str] | None = None) -> int:
    """Run the `microddp` command line; a user's mistake prints one line and returns 2."""
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    # argparse reports an unknown flag from the top-level parser, with its usage; the user
    # needs the usage of the command they typed it in.
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        getattr(args, "_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except MicroDDPError as e:
        print(f"microddp {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"microddp {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
