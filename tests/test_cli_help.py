"""Every `k3 ... --help` shows each command's and option's help as written: no word lost to markup (rich
read `hf://ORG/REPO[@REV]` as a style tag and dropped it) and no sentence cut at its source line break."""

from __future__ import annotations

import re

import pytest
from cli_walk import commands
from typer.testing import CliRunner

from k3.cli import app

WIDTH = 200  # wide enough that no help line wraps
BOX = re.compile(r"[│╭╮╰╯─]")


def written_words(text: str) -> list[str]:
    """The words of a help string as its author wrote them, the markdown code marks aside."""
    return text.replace("`", "").split()


def shown_words(output: str) -> set[str]:
    return set(BOX.sub(" ", output).split())


COMMANDS = list(commands())


@pytest.mark.parametrize("path, command", COMMANDS, ids=[" ".join(("k3", *p)) for p, _ in COMMANDS])
def test_help_shows_every_word_of_the_command_and_its_options(path, command):
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": str(WIDTH)})
    assert result.exit_code == 0, result.output
    shown = shown_words(result.output)
    helps = [command.help or ""] + [getattr(p, "help", None) or "" for p in command.params]
    lost = [w for text in helps for w in written_words(text) if w not in shown]
    assert not lost, f"k3 {' '.join(path)} --help lost {lost}"


def test_a_paragraph_is_shown_as_one_line_not_cut_where_its_source_line_ends():
    result = CliRunner().invoke(app, ["generate", "--help"], env={"COLUMNS": str(WIDTH)})
    assert "terminal; with --nproc N the routed experts" in result.output
