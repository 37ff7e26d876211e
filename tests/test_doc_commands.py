"""Every `k3 ...` command line the README and docs show runs as written: its commands exist and it passes only
options they take (a reader copies these lines; `k3 dist generate` stood in one where the command is
`k3 generate --nproc N`)."""

from __future__ import annotations

import re
from pathlib import Path

from typer.main import get_command

from k3.cli import app
from k3.terminal import GroupWithDefault

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
SPAN = re.compile(r"`([^`\n]+)`")
COMMENT = re.compile(r"(?:^|\s)#.*")  # a shell comment: prose, not a command
# `k3` as a command: at the start of a snippet or after a shell prefix or separator, then a command's name and
# its words up to the end of the command (a pipe, a separator, a closing parenthesis)
COMMAND = re.compile(r"(?:^|[\s$(]|&&|;)k3 ([a-z][a-z0-9-]*(?:\s[^|;&)\n]*)?)(?=$|[|;&)\n])")


def snippets(text: str) -> list[str]:
    """The code of a page: each line of its fenced blocks and each inline code span outside them."""
    lines = [line for block in FENCE.findall(text) for line in block.splitlines()]
    return [COMMENT.sub("", code) for code in lines + SPAN.findall(FENCE.sub("", text))]


def command_lines() -> list[tuple[str, list[str]]]:
    """(page, the words after `k3`) for every k3 command line shown in the pages."""
    found = []
    for page in PAGES:
        for snippet in snippets(page.read_text()):
            for match in COMMAND.finditer(snippet):
                found.append((page.relative_to(ROOT).as_posix(), match.group(1).split()))
    return found


def option_names(command) -> set[str]:
    return {name for p in command.params for name in [*p.opts, *getattr(p, "secondary_opts", [])]}


def problem(words: list[str]) -> str | None:
    """What does not run in `k3 WORDS`, or None."""
    command, path, rest = get_command(app), ["k3"], list(words)
    while rest and hasattr(command, "commands"):  # a group: its next word names one of its commands
        word, subcommands = rest[0], command.commands
        if word in subcommands:
            command, path, rest = subcommands[word], [*path, word], rest[1:]
        elif word.startswith(("-", "[")) or word in ("...", "…"):  # the group's options; a placeholder
            return None
        elif isinstance(command, GroupWithDefault):  # `k3 stream SOURCE ...`: `k3 stream run SOURCE ...`
            command, path = subcommands[command.default], [*path, command.default]
        else:
            return f"{' '.join(path)} has no command {word!r} ({', '.join(subcommands)})"
    for word in rest:  # a command's arguments and options
        if word == "--":  # what follows goes to another program
            break
        option = word.lstrip("[").split("=")[0].rstrip(",.:]")
        if option.startswith("-") and len(option) > 1 and option not in option_names(command) | {"--help"}:
            return f"{' '.join(path)} takes no option {option}"
    return None


def test_the_command_lines_are_found():
    found = command_lines()
    assert len(found) > 50
    assert ("README.md", ["demo"]) not in found  # `make demo` is make's, not k3's
    assert any(page == "README.md" and words[:2] == ["golden", "CKPT"] for page, words in found)
    assert problem(["dist", "generate"]) is not None  # a mistake this file found (k3 generate --nproc N)
    assert problem(["stream", "ckpt/", "--prompts", "p.jsonl", "--no-such-option"]) is not None
    assert problem(["stream", "ckpt/", "--prompts", "p.jsonl"]) is None  # `k3 stream run`, its default
    assert problem(["generate", "ckpt/", "--no-such-option"]) is not None
    assert problem(["generate", "ckpt/", "-p", "Hola", "--threads", "2"]) is None


def test_every_command_line_in_the_docs_runs_as_written():
    wrong = {
        f"{page}: k3 {' '.join(words)}\n    {why}"
        for page, words in command_lines()
        if (why := problem(words))
    }
    assert not wrong, "\n".join(sorted(wrong))
