"""Every command's --help explains every option with its default and shows examples that run
as written from a fresh clone; a mistyped flag gets the command's own usage."""

import argparse
from pathlib import Path

import pytest

from cli_examples import check_parses, command_lines, out_folders, run_command
from microddp import commands as cli

# Every command a user can type (the leaves of `microddp`'s tree): a new one is covered as soon
# as it exists.
COMMANDS = [path for path, parser in cli.all_parsers() if path and not cli._subcommands(parser)]


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


FLAGS = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._StoreConstAction,
         argparse._HelpAction, argparse._SubParsersAction)


def _shown(default) -> list[str]:
    """Ways a --help text may spell a default value."""
    if isinstance(default, list | tuple):
        return [" ".join(map(str, default)), ",".join(map(str, default))]
    ways = [str(default), str(default).replace(str(Path.home()), "~")]
    if isinstance(default, float):
        ways.append(f"{default:g}")
    return ways


@pytest.mark.parametrize("path", COMMANDS, ids=" ".join)
def test_every_option_shows_its_default(path):
    """Flags have no default to show; every other option says what happens without it."""
    parser = _parser(path)
    for a in parser._actions:
        if isinstance(a, FLAGS) or not a.option_strings:
            continue
        name = a.option_strings[-1]
        assert "default" in a.help, f"microddp {' '.join(path)} {name}: no default in its help"
        if a.default is not None:
            assert any(w in a.help for w in _shown(a.default)), \
                f"microddp {' '.join(path)} {name}: help does not show the default {a.default!r}"


def _examples(path: list[str]) -> list[str]:
    return command_lines(_parser(path).epilog or "")


@pytest.mark.parametrize("path", COMMANDS, ids=" ".join)
def test_every_example_parses_and_names_files_that_exist(path):
    made: set[Path] = set()
    lines = _examples(path)
    assert lines, f"microddp {' '.join(path)}: no example command in --help"
    for line in lines:
        check_parses(line, made)
        made |= out_folders(line)


# The examples that finish in seconds, run as written; the others (training, benchmarks, a
# calibration) take minutes, and are only parsed above.
QUICK = {
    ("doctor",): "all",
    ("hello",): "all",
    ("run",): ["microddp run -n 2 -m microddp.commands.hello"],
    ("predict",): "all but --calibrate",  # nor --compare: it reads a file of this clone, and
    # these run from an empty folder (tests/test_predict_memory_pipeline.py runs --compare)
    ("bench", "async"): ["microddp bench async --steps 20 --rounds 1 --bounds 2 --out "
                         "runs/bench-async-quick"],
    ("trace",): "all but --overhead",
    ("bench", "pipeline"): ["microddp bench pipeline --stages 2 --microbatches 4 --compute sleep "
                            "--repeats 2 --out runs/pp"],
    ("exercise",): ["microddp exercise list", "microddp exercise start ring --out mywork"],
    ("bench", "zero"): ["microddp bench zero --ranks 2 --dim 64 --depth 2 --repeats 3 --out "
                        "runs/zero"],
}


def _quick(path: tuple[str, ...]) -> list[str]:
    which = QUICK[path]
    lines = _examples(list(path))
    if isinstance(which, list):
        assert set(which) <= set(lines), f"{which} are no longer examples of {path}"
        return which
    if which.startswith("all but "):
        return [line for line in lines if which.removeprefix("all but ") not in line
                and "--compare" not in line]
    return lines


@pytest.mark.slow  # every command's help example run end to end (the parsing test stays in the default set)
@pytest.mark.parametrize("path", list(QUICK), ids=" ".join)
def test_quick_examples_run_as_written(path, tmp_path):
    """From an empty folder, as a fresh clone's user would (no earlier runs/ to lean on)."""
    for line in _quick(path):
        run_command(line, tmp_path)


@pytest.mark.parametrize("argv,usage", [
    (["train", "--epoch", "1"], "usage: microddp train"),
    (["train", "--bogus"], "usage: microddp train"),
    (["bench", "ddp", "--dim", "128"], "usage: microddp bench ddp"),
    (["trace", "--step", "3"], "usage: microddp trace"),
    (["predict", "--calib"], "usage: microddp predict"),
])
def test_a_mistyped_flag_shows_the_commands_usage_and_is_never_abbreviated(argv, usage, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage), err
    assert f"error: unrecognized arguments: {argv[-2] if argv[-1][0] != '-' else argv[-1]}" in err


def test_the_train_worker_takes_no_abbreviation(capsys):
    from microddp.train.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["--epoch", "1"])
    assert e.value.code == 2
    assert "unrecognized arguments: --epoch 1" in capsys.readouterr().err
