"""`python -m microddp.train ARGS`: one worker of the training job (what launchers start)."""

import argparse
import sys

from ..errors import MicroDDPError
from . import worker
from .config import add_arguments, from_args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m microddp.train", allow_abbrev=False)
    add_arguments(parser)
    try:
        return worker(from_args(parser.parse_args(argv)))
    except MicroDDPError as e:
        print(f"microddp train: error: {e}", file=sys.stderr, flush=True)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
