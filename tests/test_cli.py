"""`iws CMD --help` documents every flag of every command, with its default."""
import argparse

import pytest

from iws_gym.cli import build_parser_with_help


def _commands(p, name="iws"):
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for k, q in a.choices.items():
                yield from _commands(q, f"{name} {k}")
    yield name, p


def test_every_command_documents_every_flag():
    for name, p in _commands(build_parser_with_help()):
        text = p.format_help()  # renders (a stray % in a help text would raise here)
        for a in p._actions:
            if a.dest != "help" and not isinstance(a, argparse._SubParsersAction):
                assert a.help, f"{name}: {a.option_strings or a.dest} has no help"
            if a.option_strings and a.default not in (None, argparse.SUPPRESS, False) and a.dest != "help":
                assert f"(default: {a.default})" in " ".join(text.split()), f"{name}: {a.dest} hides its default"


@pytest.mark.parametrize("stage,flag", [("stage1", "--crop"), ("stage2", "--agent-track"), ("stage2", "--corrupt-block")])
def test_train_help_lists_the_stage_options_with_defaults(stage, flag, capsys):
    from iws_gym.training.train import parse_args

    with pytest.raises(SystemExit):
        parse_args(stage, ["--help"])
    out = capsys.readouterr().out
    assert flag in out and "--max-minutes" in out and "(default:" in out
