"""Sub-commands from a table of name -> (module, summary): `microddp` and `microddp bench` both
build theirs this way, importing only the module of the command that was typed."""

from __future__ import annotations

import argparse
import importlib
import importlib.util


def _available(path: str) -> bool:
    return importlib.util.find_spec(path) is not None


def add_commands(sub, table: dict[str, tuple[str, str]], argv: list[str]) -> None:
    """Add one sub-parser per entry; import and fully configure only the one named in argv."""
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (path, summary) in table.items():
        if not _available(path):
            continue  # not part of this installation (yet)
        if name != chosen:
            sub.add_parser(name, help=summary, allow_abbrev=False)
            continue
        module = importlib.import_module(path)
        p = sub.add_parser(name, help=summary, description=module.__doc__,
                           epilog=getattr(module, "EPILOG", None), allow_abbrev=False,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        # A mistake is reported with the usage of the command it was made in (see main)
        p.set_defaults(_parser=p)
        if getattr(module, "NESTED", False):  # a command with commands of its own
            module.add_arguments(p, argv[argv.index(name) + 1:])
        else:
            module.add_arguments(p)
            p.set_defaults(_run=module.run)
