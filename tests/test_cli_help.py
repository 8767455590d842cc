"""Every command's --help explains every option and shows an example (DESIGN.md)."""

import argparse

import pytest

from microddp import cli

COMMANDS = [["doctor"], ["hello"], ["run"], ["train"], ["bench", "allreduce"], ["bench", "ddp"],
            ["bench", "scaling"], ["trace"], ["predict"]]


def _parser(path: list[str]) -> argparse.ArgumentParser:
    parser = cli.build_parser(path)
    for name in path:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return parser


@pytest.mark.parametrize("path", COMMANDS, ids=" ".join)
def test_every_option_has_help_and_the_command_an_example(path):
    parser = _parser(path)
    bare = [a.option_strings or a.dest for a in parser._actions
            if a.help is None and not isinstance(a, argparse._SubParsersAction)]
    assert bare == [], f"microddp {' '.join(path)}: options without help: {bare}"
    assert f"microddp {' '.join(path)}" in (parser.epilog or ""), "no example in --help"
