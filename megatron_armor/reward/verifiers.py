"""Verifier registry and the ``auto`` table that picks a verifier from a row's ``data_source``.

``reward.verifier``: ``dapo`` or ``math_verify`` score every sample with that verifier;
``auto`` looks the sample's ``data_source`` up (lower-cased, ``-`` read as ``_``):

===========================================================  ===============
data_source                                                  verifier
===========================================================  ===============
``math_dapo``, ``math_dapo_reasoning``, ``dapo_math``,       ``dapo``
``dapo_math_17k``, anything starting with ``tiny``
anything starting with ``aime``, ``amc``, ``math500``,       ``math_verify``
``math_500``, ``minerva``, ``olympiad``, ``hmmt``, ``gsm8k``
===========================================================  ===============

Benchmark files without a ``data_source`` column take their file stem as the source
(``aime24.parquet`` -> ``aime24``). Any other name is an error that names it and the fix.
Note: the DAPO recipe itself scores ``aime*`` with the DAPO rule; set
``reward.verifier=dapo`` to reproduce that exactly.
"""

from __future__ import annotations

from collections.abc import Callable

from megatron_armor.reward.dapo_rule import RuleResult, score_dapo
from megatron_armor.reward.math_verify_rule import score_math_verify

Verifier = Callable[[str, str], RuleResult]

VERIFIERS: dict[str, Verifier] = {"dapo": score_dapo, "math_verify": score_math_verify}
VERIFIER_CHOICES = ("auto", *VERIFIERS)

AUTO_EXACT = {
    "math_dapo": "dapo",
    "math_dapo_reasoning": "dapo",
    "dapo_math": "dapo",
    "dapo_math_17k": "dapo",
}
AUTO_PREFIXES = (
    ("tiny", "dapo"),
    ("aime", "math_verify"),
    ("amc", "math_verify"),
    ("math500", "math_verify"),
    ("math_500", "math_verify"),
    ("minerva", "math_verify"),
    ("olympiad", "math_verify"),
    ("hmmt", "math_verify"),
    ("gsm8k", "math_verify"),
)


def check_verifier(verifier: str) -> None:
    """Raise for a ``reward.verifier`` value that is not ``auto`` or a registered verifier."""
    if verifier not in VERIFIER_CHOICES:
        raise ValueError(
            f"reward.verifier={verifier!r} is not a verifier; use one of {list(VERIFIER_CHOICES)}"
        )


def auto_verifier(data_source: str) -> str:
    """The verifier the ``auto`` table assigns to ``data_source``."""
    key = data_source.strip().lower().replace("-", "_")
    if key in AUTO_EXACT:
        return AUTO_EXACT[key]
    for prefix, name in AUTO_PREFIXES:
        if key.startswith(prefix):
            return name
    raise ValueError(
        f"data_source={data_source!r} is not in the reward.verifier=auto table "
        f"(dapo: {sorted(AUTO_EXACT)} and tiny*; math_verify: "
        f"{[p for p, v in AUTO_PREFIXES if v == 'math_verify']} prefixes); set "
        "reward.verifier=dapo or reward.verifier=math_verify, or give the rows a known data_source"
    )


def resolve_verifier(verifier: str, data_source: str) -> str:
    """The verifier name for one sample: ``verifier`` itself, or the ``auto`` table's choice."""
    check_verifier(verifier)
    return auto_verifier(data_source) if verifier == "auto" else verifier
