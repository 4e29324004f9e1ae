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


def test_layers_import_only_downwards():
    """The env and the world model load nothing of training, evaluation, collection or h5py; models load no
    task package (nothing task-specific inside the model); nothing imports the CLI."""
    import subprocess
    import sys

    code = ("import sys, iws_gym.envs.env, iws_gym.envs.vector_env, iws_gym.models.world_model; "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith(('iws_gym', 'h5py')))))")
    mods = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    bad = [m for m in mods if m.startswith(("iws_gym.training", "iws_gym.evaluation", "iws_gym.data.collect",
                                            "iws_gym.data.episodes", "iws_gym.cli", "h5py"))]
    assert not bad, bad
    code = "import sys, iws_gym.models.world_model, iws_gym.models.dynamics; print(' '.join(m for m in sys.modules if m.startswith('iws_gym')))"
    mods = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert all(m.startswith(("iws_gym.models", "iws_gym.metrics")) or m == "iws_gym" for m in mods), mods
