"""Check that this machine can run microddp, with a live 2-process all-reduce (torch's) and
ring all-reduce (microddp's, from send/recv)."""

from __future__ import annotations

import argparse

EPILOG = """\
example:
  microddp doctor          # exit 0 when this machine can run microddp
  microddp doctor --skip-live
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `microddp doctor`."""
    p.add_argument("--skip-live", action="store_true",
                   help="skip the live 2-process all-reduce self-tests")


def run(args: argparse.Namespace) -> int:
    """Check this machine and print what works; non-zero if a check failed."""
    from ..launch.doctor import diagnose

    return diagnose(skip_live=args.skip_live)
