"""The paper's datasets (arXiv 2607.10481 §5): where each is published and how it is read.

``TARGETS`` names every file ``armor data`` writes (``<name>.parquet``, the names the configs
use: ``configs/base.yaml``) with its hub source; :func:`open_source` reads a source in any of
the forms people have it: a parquet / jsonl / json file, a directory of such files (a
``hf download`` snapshot), a ``datasets.Dataset.save_to_disk`` directory, or a
hub name (``owner/name[:split]``, through ``datasets`` where the node has network).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATA_SUFFIXES = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}
SAVED_DATASET_FILES = ("state.json", "dataset_dict.json")
"""A ``save_to_disk`` directory holds one of these (a ``Dataset`` / a ``DatasetDict``)."""
HUB_NAME = re.compile(r"[\w.-]+/[\w.-]+(:[\w.-]+)?")


@dataclass(frozen=True)
class HubSource:
    """A dataset on the Hugging Face hub: repository, configs (concatenated) and split."""

    repo: str
    configs: tuple[str | None, ...] = (None,)
    split: str = "train"

    def __str__(self) -> str:
        configs = "+".join(c for c in self.configs if c)
        return f"{self.repo}{f' ({configs})' if configs else ''}:{self.split}"


@dataclass(frozen=True)
class Target:
    """One file the recipe reads: ``<name>.parquet``, its metric name ``val/<name>/...``."""

    name: str
    title: str
    hub: HubSource
    training: bool = False
    expected_problems: int = 0
    """Problems of the published benchmark (0: not checked); another count is reported."""

    @property
    def file_name(self) -> str:
        return f"{self.name}.parquet"


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target(
            "dapo-math-17k",
            "DAPO-Math-17k (training set; the hub copy repeats each problem ~100 times)",
            HubSource("BytedTsinghua-SIA/DAPO-Math-17k"),
            training=True,
        ),
        Target("aime24", "AIME 2024", HubSource("HuggingFaceH4/aime_2024"), expected_problems=30),
        Target(
            "aime25",
            "AIME 2025 (I and II)",
            HubSource("opencompass/AIME2025", ("AIME2025-I", "AIME2025-II"), "test"),
            expected_problems=30,
        ),
        Target("amc23", "AMC 2023", HubSource("math-ai/amc23", split="test"), expected_problems=40),
        Target(
            "math500",
            "MATH-500",
            HubSource("HuggingFaceH4/MATH-500", split="test"),
            expected_problems=500,
        ),
    )
}


def target(name: str) -> Target:
    """The target called ``name``; a clear error listing the known ones."""
    if name not in TARGETS:
        raise ValueError(f"unknown dataset {name!r}; `armor data` prepares {', '.join(TARGETS)}")
    return TARGETS[name]


def open_source(source: str, split: str = "train") -> Any:
    """A ``datasets.Dataset`` from a local file or directory, or a hub name; ``split`` picks
    the split of a saved ``DatasetDict`` (when it has several)."""
    path = Path(source).expanduser()
    if path.is_dir():
        if any((path / name).is_file() for name in SAVED_DATASET_FILES):
            return _saved_dataset(path, split)
        return _load_files(_data_files_under(path), source)
    if path.exists():
        return _load_files([path], source)
    if HUB_NAME.fullmatch(source) and path.suffix.lower() not in DATA_SUFFIXES:
        name, _, hub_split = source.partition(":")
        return open_hub(HubSource(name, split=hub_split or split))
    raise FileNotFoundError(
        f"{source}: no such file or directory (and not a hub name `owner/name[:split]`)"
    )


def open_hub(hub: HubSource) -> Any:
    """Load ``hub`` with ``datasets`` (needs network), configs concatenated in order."""
    import datasets

    try:
        parts = [datasets.load_dataset(hub.repo, c, split=hub.split) for c in hub.configs]
    except Exception as e:  # hub/network errors come in many types; keep the cause
        raise FileNotFoundError(
            f"{hub}: loading it from the hub failed ({type(e).__name__}: {e}); on a node without "
            "network download it elsewhere (`hf download --repo-type dataset "
            f"{hub.repo} --local-dir DIR`) and pass `--source NAME=DIR`"
        ) from e
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def _saved_dataset(path: Path, split: str) -> Any:
    """A ``save_to_disk`` directory: the ``Dataset``, or ``split`` (else the only split) of a
    ``DatasetDict``."""
    import datasets

    loaded = datasets.load_from_disk(str(path))
    if not isinstance(loaded, datasets.DatasetDict):
        return loaded
    splits = list(loaded)
    if len(splits) == 1:
        return loaded[splits[0]]
    for name in (split, "test", "train"):
        if name in loaded:
            return loaded[name]
    raise ValueError(f"{path}: a dataset with splits {splits}; pass the split's directory")


def _data_files_under(path: Path) -> list[Path]:
    """The data files of a directory (a hub snapshot): its parquet files, else its jsonl,
    else its json files, sorted; hidden folders (``.cache``) skipped."""
    found = [p for p in sorted(path.rglob("*")) if p.is_file() and not _hidden(p, path)]
    for suffix in DATA_SUFFIXES:
        files = [p for p in found if p.suffix.lower() == suffix]
        if files:
            return files
    raise FileNotFoundError(
        f"{path}: a directory without data: no parquet/jsonl/json file and no `save_to_disk` "
        f"dataset ({' / '.join(SAVED_DATASET_FILES)})"
    )


def _hidden(file: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in file.relative_to(root).parts)


def _load_files(files: list[Path], source: str) -> Any:
    """One dataset of ``files`` (all of the same format)."""
    import datasets

    fmt = DATA_SUFFIXES.get(files[0].suffix.lower())
    if fmt is None:
        raise ValueError(
            f"{source}: unsupported file type {files[0].suffix!r}; use {sorted(DATA_SUFFIXES)}, "
            "a directory of them or a `save_to_disk` directory"
        )
    try:
        return datasets.load_dataset(fmt, data_files=[str(f) for f in files], split="train")
    except Exception as e:  # arrow/json errors come in many types; name the source
        raise ValueError(f"{source}: cannot be read as {fmt} ({type(e).__name__}: {e})") from e
