"""Imports point down the layers of docs/architecture.md ("Layers"), which this test reads. Tier: unit.

Every import of a ``megatron_armor`` module is read from the source (``ast``: module level, inside
functions and under ``TYPE_CHECKING`` alike) and checked against the table's rows: another
package only in a lower row, the same package in its own row or a lower one.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import megatron_armor

pytestmark = pytest.mark.unit

PACKAGE = Path(megatron_armor.__file__).parent
DOC = PACKAGE.parent / "docs" / "architecture.md"
ROW = re.compile(r"^\|\s*(\d+)\s*\|([^|]*)\|")


def layer_table(doc: Path = DOC) -> dict[str, int]:
    """``{path under megatron_armor/: row}`` from the "Layers" table (row 1 is the top)."""
    section = doc.read_text().split("## Layers", 1)[1].split("\n## ", 1)[0]
    table = {}
    for line in section.splitlines():
        match = ROW.match(line)
        if match:
            for path in re.findall(r"`([^`]+)`", match.group(2)):
                table[path] = int(match.group(1))
    return table


def unit_of(relpath: str, table: dict[str, int]) -> str | None:
    """The most specific table path that ``relpath`` (e.g. ``config/schema.py``) falls under."""
    hits = [p for p in table if relpath == p or (p.endswith("/") and relpath.startswith(p))]
    return max(hits, key=len) if hits else None


def module_file(dotted: str) -> str | None:
    """``megatron_armor.a.b`` -> ``a/b.py`` or ``a/b/__init__.py`` (None: not a module of ours)."""
    parts = dotted.split(".")
    if parts[0] != "megatron_armor":
        return None
    for cut in range(len(parts), 0, -1):  # ``from pkg.mod import name``: name may be a function
        base = PACKAGE.joinpath(*parts[1:cut])
        if base.with_suffix(".py").is_file() and cut > 1:
            return str(base.with_suffix(".py").relative_to(PACKAGE))
        if (base / "__init__.py").is_file():
            return str((base / "__init__.py").relative_to(PACKAGE))
    return None


def imported_modules(source: Path) -> list[tuple[int, str]]:
    """``(line, dotted module)`` of every import in ``source``, wherever it stands."""
    found = []
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):  # relative: resolve against the file's package
            base = source.relative_to(PACKAGE.parent).with_suffix("").parts[: -node.level]
            module = ".".join(base + ((node.module,) if node.module else ()))
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def package_of(relpath: str) -> str:
    return relpath.split("/", 1)[0] if "/" in relpath else relpath


def violations(table: dict[str, int]) -> list[str]:
    """Every import that points to a higher row, or sideways to another package."""
    found = []
    for source in sorted(PACKAGE.rglob("*.py")):
        here = str(source.relative_to(PACKAGE))
        here_unit = unit_of(here, table)
        for line, dotted in imported_modules(source):
            target = module_file(dotted)
            if target is None or here_unit is None:
                continue
            there_unit = unit_of(target, table)
            if there_unit is None or there_unit == here_unit:
                continue
            same_package = package_of(here) == package_of(target)
            up = table[there_unit] < table[here_unit]
            sideways = table[there_unit] == table[here_unit] and not same_package
            if up or sideways:
                found.append(f"{here}:{line} imports {dotted} (row {table[here_unit]} `{here_unit}`"
                             f" -> row {table[there_unit]} `{there_unit}`)")  # fmt: skip
    return found


def test_the_table_places_every_module():
    table = layer_table()
    assert len(table) >= 10, f"the Layers table of {DOC} was not found"
    unplaced = [str(p.relative_to(PACKAGE)) for p in sorted(PACKAGE.rglob("*.py"))
                if unit_of(str(p.relative_to(PACKAGE)), table) is None]  # fmt: skip
    assert unplaced == [], f"modules in no row of {DOC} 'Layers': {unplaced}"


def test_imports_point_down_the_layers():
    problems = violations(layer_table())
    assert problems == [], "imports against docs/architecture.md 'Layers':\n" + "\n".join(problems)


def test_an_upward_import_is_caught(tmp_path):
    """The check itself: a table that puts ``config/`` below ``algo/`` turns validation's import
    of the algorithm registry into an upward one, and ``cli/`` beside ``orchestration/`` turns
    ``armor train``'s import of the loop into a sideways one."""
    doc = tmp_path / "architecture.md"
    doc.write_text("## Layers\n\n| row | paths |\n|---|---|\n| 1 | `cli/`, `orchestration/` |\n"
                   "| 2 | `algo/` |\n| 3 | `config/` |\n")  # fmt: skip
    table = layer_table(doc)
    assert table == {"cli/": 1, "orchestration/": 1, "algo/": 2, "config/": 3}
    problems = violations(table)
    assert any(p.startswith("config/validate.py") and "megatron_armor.algo" in p for p in problems)
    assert any(
        p.startswith("cli/train_cmd.py") and "-> row 1 `orchestration/`" in p for p in problems
    )
