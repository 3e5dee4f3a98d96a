"""`raylane --help` and every subcommand's help read as a reference: each option says what it is for,
and its default where it has one."""

import argparse

import pytest

from raylane.cluster.cli import build_parser


def subcommands(parser: argparse.ArgumentParser, path: str = "raylane"):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from subcommands(sub, f"{path} {name}")


COMMANDS = dict(subcommands(build_parser()))


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_says_what_it_is_and_its_default(command):
    parser = COMMANDS[command]
    text = parser.format_help()
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS:
            continue
        assert action.help, f"{command} {action.option_strings[-1]} has no help"
        if action.default not in (None, False, argparse.SUPPRESS) and not isinstance(action.default, bool):
            shown = str(action.default) in text or "default" in action.help
            assert shown, f"{command} {action.option_strings[-1]}: default {action.default!r} not shown"
