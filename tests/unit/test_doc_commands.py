"""Docs whose commands cannot rot: every ``armor ...`` command of README.md and docs/*.md goes
through the real ``armor`` argument parser, and every repository path a documented command
names exists (apart from the paths commands create: ``CREATED``). Tier: unit.

What counts (``tests/doc_commands.py`` reads the pages): each line of a shell block that runs
``armor SUB`` (after ``VAR=value`` assignments), and each inline ``armor SUB ...`` span. An
inline span that is only ``armor SUB`` (or ``armor SUB --option``) names the subcommand (and
the option), which must exist; a span whose ``SUB`` ends in ``:`` is the command's output. A
synopsis reads as its first form: ``[...]`` kept without the brackets, ``A|B`` as ``A``,
``...`` dropped, and an UPPER_CASE placeholder or ``$(...)`` as one value.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from doc_commands import REPO, DocCommand, doc_pages, fenced_commands, inline_spans  # noqa: E402

from megatron_armor.cli import SUBCOMMANDS, build_parser, parse_command_line  # noqa: E402

pytestmark = pytest.mark.unit

CREATED = ("runs/", "data/", "data-ci/", "models/", "artifacts/", "eval/", "logs/",
           "checkpoints/", "raw/", "wheels/", "eval_results/")  # fmt: skip
"""Paths under these are made by a documented command (or are the reader's own copies)."""
TRACKED_TOP = tuple(sorted(p.name + "/" for p in REPO.iterdir() if p.is_dir()
                           and not p.name.startswith(".") and (p / ".").exists()
                           and p.name + "/" not in CREATED))  # fmt: skip
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=\S*$")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*(\.[a-z]+)?$")


def armor_words(text: str) -> list[str] | None:
    """The words after ``armor`` when ``text`` runs an armor subcommand, else None."""
    text = re.sub(r"\$\([^)]*\)", "1", text.split("&")[0].split(" | ")[0].split(";")[0])
    try:
        words = shlex.split(text)
    except ValueError:
        return None
    while words and ASSIGNMENT.match(words[0]):
        words = words[1:]
    if len(words) < 2 or words[0] != "armor" or words[1] not in SUBCOMMANDS:
        return None
    return words[1:]


def first_form(words: list[str]) -> list[str]:
    """A synopsis as a command: brackets dropped, first alternatives, placeholders as values."""
    out = []
    for word in words:
        if word in ("...", "…"):  # "the rest of the command line"
            out.append("1")
            continue
        word = word.replace("[", "").replace("]", "").replace("\\|", "|").split("|")[0]
        word = word.replace("...", "").replace("…", "")
        if "=" in word and PLACEHOLDER.match(word.split("=")[1] or "X"):
            word = word.split("=")[0] + "=1"
        if PLACEHOLDER.match(word) or PLACEHOLDER.match(word.split(":")[0]):
            word = "1"
        if word:
            out.append(word)
    return out


def parse(words: list[str]) -> str:
    """'' when ``armor WORDS`` parses, else argparse's complaint."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parse_command_line(words)
    except SystemExit:
        return err.getvalue().strip().splitlines()[-1] if err.getvalue() else "exit"
    return ""


def subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def names_of(subcommand: str) -> set[str]:
    """The options of ``armor SUBCOMMAND`` and the names of its own subcommands."""
    parser = subparser(build_parser(), subcommand)
    names = {s for a in parser._actions for s in a.option_strings}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            names |= set(action.choices)
    return names


def is_mention(words: list[str]) -> bool:
    """``armor SUB``, ``armor SUB --option`` or ``armor config show``: a name in prose."""
    return len(words) == 1 or (len(words) == 2 and words[1] in names_of(words[0]))


def documented() -> list[tuple[DocCommand, list[str]]]:
    found = []
    for page in doc_pages():
        for command in [*fenced_commands(page), *inline_spans(page)]:
            words = armor_words(command.text)
            if words is not None and not words[0].endswith(":"):
                found.append((command, words))
    return found


COMMANDS = documented()


def test_the_docs_show_armor_commands():
    assert len(COMMANDS) > 100 and {w[0] for _, w in COMMANDS} == set(SUBCOMMANDS)


@pytest.mark.parametrize("command, words", COMMANDS, ids=[str(c) for c, _ in COMMANDS])
def test_every_documented_armor_command_parses(command, words):
    if is_mention(words):
        missing = [w for w in words[1:] if w not in names_of(words[0])]
        assert not missing, f"{command}: `armor {words[0]}` has no option or command {missing}"
        return
    problem = parse(first_form(words))
    assert not problem, f"{command}\n  armor {' '.join(first_form(words))}: {problem}"


def repository_paths(text: str) -> list[str]:
    """The repository paths a command names (words or ``key=value`` values)."""
    paths = []
    for word in text.replace("=", " ").replace(",", " ").split():
        word = word.strip("'\"`()[]")
        if word.startswith(TRACKED_TOP) and not word.startswith(CREATED) and "*" not in word:
            paths.append(word.rstrip("/."))
    return paths


def shell_commands() -> list[DocCommand]:
    return [c for page in doc_pages() for c in fenced_commands(page)]


def test_every_repository_path_a_documented_command_names_exists():
    missing = [f"{c}: {p}" for c in shell_commands() + [c for c, _ in COMMANDS]
               for p in repository_paths(c.text) if not (REPO / p).exists()]  # fmt: skip
    assert not missing, "\n".join(missing)
