"""A crafted checkpoint file, as an attacker with write access to a run directory would plant
it: shared by the unit and e2e tests of the safe loader."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

from megatron_armor.orchestration.checkpoints import write_manifest
from megatron_armor.orchestration.run_state import STATE_FILE


class _Exec:
    """Pickles to a call of ``os.system``: what a crafted checkpoint file would hold."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant_crafted_pickle(checkpoint: Path, marker: Path, step: int) -> None:
    """Replace ``orchestrator.pt`` by a pickle that would create ``marker`` when loaded unsafely,
    and re-sign the manifest, so only the safe loader stands in its way."""
    with (checkpoint / STATE_FILE).open("wb") as f:
        pickle.dump({"step": _Exec(marker)}, f)
    write_manifest(checkpoint, step)
