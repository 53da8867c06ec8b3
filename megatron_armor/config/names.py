"""The names a string setting takes, declared once on the setting's type.

A setting with a fixed set of names and no registry of its own is typed
``Annotated[str, Names(...)]`` in ``schema.py``; :func:`named_settings` reads those types, so
``validate.check_names`` refuses any other value and the loader knows which settings take
``off`` (the settings whose names come from a registry are in ``algo/registry.py`` and
``rollout_traits.py``).
"""

from __future__ import annotations

import dataclasses
import typing


class Names(tuple):
    """The names of a setting (its type: ``Annotated[str, Names("a", "b")]``)."""

    def __new__(cls, *names: str) -> Names:
        return super().__new__(cls, names)


def named_settings(schema: type, prefix: str = "") -> dict[str, tuple[str, ...]]:
    """``{dotted key: names}`` of every setting of the dataclass tree ``schema`` typed with
    :class:`Names`."""
    out: dict[str, tuple[str, ...]] = {}
    hints = typing.get_type_hints(schema, include_extras=True)
    for f in dataclasses.fields(schema):
        hint, key = hints[f.name], f"{prefix}{f.name}"
        names = [m for m in getattr(hint, "__metadata__", ()) if isinstance(m, Names)]
        if names:
            out[key] = tuple(names[0])
        elif dataclasses.is_dataclass(hint):
            out.update(named_settings(hint, f"{key}."))
    return out
