"""``ARMOR_ENV=<name>`` for commands run outside the sbatch files (``armor doctor`` under a
plain ``srun``): the variables of the cluster preset ``slurm/env/<name>.sh`` (NCCL's
interfaces and HCAs, ...), so that the doctor's NCCL checks run as the job's collectives will.
The preset is sourced by bash, as ``slurm/lib/common.sh`` does; it only fills in what is unset.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository of this package (an editable install's checkout: presets live there)."""


def preset_file(name: str, root: Path) -> Path:
    """``slurm/env/<name>.sh`` of ``root``; ``ValueError`` naming the presets there."""
    folder = root / "slurm" / "env"
    path = folder / f"{name}.sh"
    if not path.is_file():
        known = sorted(p.stem for p in folder.glob("*.sh")) if folder.is_dir() else []
        raise ValueError(f"ARMOR_ENV={name}: no preset {path}; choose one of: {', '.join(known)} "
                         "(or set ARMOR_ROOT to the repository)")  # fmt: skip
    return path


def preset_changes(name: str, env: dict[str, str], root: Path) -> dict[str, str]:
    """The variables that sourcing preset ``name`` in ``env`` sets or changes."""
    path = preset_file(name, root)
    done = subprocess.run(["bash", "-c", 'source "$1" >/dev/null && env -0', "preset", str(path)],
                          env={**env, "ARMOR_ROOT": str(root)}, capture_output=True,
                          timeout=60)  # fmt: skip
    if done.returncode != 0:
        raise ValueError(f"ARMOR_ENV={name}: sourcing {path} failed: "
                         f"{done.stderr.decode(errors='replace').strip()}")  # fmt: skip
    after = dict(item.split("=", 1) for item in done.stdout.decode().split("\0") if "=" in item)
    return {k: v for k, v in after.items() if env.get(k) != v and k not in ("SHLVL", "_", "PWD")}


def apply_env_preset() -> str:
    """Apply ``ARMOR_ENV``'s preset to this process's environment (children inherit it);
    returns a line naming what it set ('' without ``ARMOR_ENV``)."""
    name = os.environ.get("ARMOR_ENV", "")
    if not name:
        return ""
    root = Path(os.environ.get("ARMOR_ROOT") or ROOT)
    changes = preset_changes(name, dict(os.environ), root)
    os.environ.update(changes)
    shown = ", ".join(
        f"{k}={v}" for k, v in sorted(changes.items()) if k.startswith(("NCCL_", "GLOO_"))
    )
    return f"ARMOR_ENV={name}: {len(changes)} setting(s) of {preset_file(name, root)}" + (
        f" ({shown})" if shown else ""
    )
