"""The commands the docs show, read as a reader copies them: fenced shell blocks (lines joined
at a trailing backslash, comments dropped, spaces collapsed) and ``inline code`` spans. Shared
by ``tests/unit/test_doc_commands.py`` (every ``armor`` command through the real parser) and
``tests/slurm/test_cluster_walk.py`` (docs/cluster.md run on the CI cluster)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", re.S | re.M)
SHELL_FENCES = ("bash", "sh", "shell", "")
INLINE = re.compile(r"(?<!`)`([^`]+)`(?!`)")


@dataclass(frozen=True)
class DocCommand:
    """One command of a doc page: its text, the page and the line its block starts on."""

    text: str
    page: Path
    line: int

    def __str__(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}: {self.text}"


def strip_comment(line: str) -> str:
    """``line`` without a trailing ``# comment`` (a ``#`` outside quotes, after a space)."""
    quote = ""
    for i, char in enumerate(line):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def block_commands(body: str) -> list[str]:
    """The commands of one fenced block: continued lines joined, comments and blanks dropped,
    runs of spaces collapsed to one."""
    joined = re.sub(r"\\\n", " ", body)
    commands = []
    for line in joined.splitlines():
        text = " ".join(strip_comment(line).split())
        if text:
            commands.append(text)
    return commands


def fenced_commands(page: Path, until: str | None = None) -> list[DocCommand]:
    """Every command of the shell blocks of ``page`` in order (up to the heading ``until``)."""
    text = page.read_text()
    if until is not None:
        text = text.split(until, 1)[0]
    found = []
    for match in FENCE.finditer(text):
        if match.group(1) not in SHELL_FENCES:
            continue
        line = text[: match.start()].count("\n") + 1
        found.extend(DocCommand(cmd, page, line) for cmd in block_commands(match.group(2)))
    return found


def inline_spans(page: Path) -> list[DocCommand]:
    """Every ``inline code`` span of ``page`` outside fenced blocks (table cells included),
    paragraph by paragraph (a span never crosses one)."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), page.read_text())
    spans, line = [], 1
    for paragraph in re.split(r"(\n\s*\n)", text):
        for m in INLINE.finditer(paragraph):
            at = line + paragraph[: m.start()].count("\n")
            spans.append(DocCommand(" ".join(m.group(1).split()), page, at))
        line += paragraph.count("\n")
    return spans


def doc_pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
