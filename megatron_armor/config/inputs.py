"""Up-front checks of the files a run reads: the HF model directory (its safetensors headers
and the tensors its config.json needs: ``weights_check.py``), its tokenizer, the data; and of
the directory it writes (``run.output_dir``).

They run in the config validation path (``load_config(..., check_inputs=True)``, used by
``armor train``; ``armor eval`` calls :func:`input_problems` directly) so a bad path, a broken
``config.json``, a missing tokenizer or an unusable data file is named before Ray and the
actors start. Model paths are always local: nothing here (or in the recipe) reads the hub.
Each problem names the setting, the file (and row) and the fix; docs/troubleshooting.md
lists them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from megatron_armor.config.benchmarks import missing_watched_files
from megatron_armor.config.schema import ArmorConfig
from megatron_armor.config.weights_check import weights_problems

Problems = Iterator[str]

SUPPORTED_ARCHITECTURES = ("qwen2", "qwen3", "llama", "qwen3_moe")
"""HF ``model_type`` values the trainer and the engines implement (trainer/model.py)."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
MODEL_DIR_FIX = "an HF model directory (config.json, tokenizer files, *.safetensors)"


def _missing_dir(key: str, model_path: str) -> str:
    text = f"{key}={model_path!r}: no such directory; point it at {MODEL_DIR_FIX}"
    if "/" in model_path and not model_path.startswith((".", "/", "~")):
        text += (
            f" (models are never fetched from the hub: `hf download "
            f"{model_path} --local-dir DIR` first, then {key}=DIR)"
        )
    return text


def _hf_config(key: str, path: Path) -> dict | str:
    """``path/config.json`` as a dict, or the problem with it."""
    file = path / "config.json"
    if not file.is_file():
        return f"{key}={str(path)!r}: no config.json in it; point it at {MODEL_DIR_FIX}"
    try:
        cfg = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        return (
            f"{file}: invalid JSON at line {e.lineno}, column {e.colno} ({e.msg}); repair or "
            f"re-download the file ({key})"
        )
    if not isinstance(cfg, dict):
        return f"{file}: expected a JSON object, got {type(cfg).__name__} ({key})"
    return cfg


def model_dir_problems(key: str, model_path: str) -> Problems:
    """The model directory exists and holds a parseable ``config.json`` of a supported
    architecture, tokenizer files and weights."""
    if not model_path:
        yield f"{key} is empty; set it to {MODEL_DIR_FIX}"
        return
    path = Path(model_path).expanduser()
    if not path.is_dir():
        yield _missing_dir(key, model_path)
        return
    cfg = _hf_config(key, path)
    if isinstance(cfg, str):
        yield cfg
        return
    model_type = cfg.get("model_type")
    supported = model_type in SUPPORTED_ARCHITECTURES
    if not supported:
        yield (
            f"{path}/config.json: model_type={model_type!r} is not supported ({key}); "
            f"use a model of type {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        yield (
            f"{key}={model_path!r}: no tokenizer (none of {', '.join(TOKENIZER_FILES)}); copy "
            "the tokenizer files of the base model into the directory"
        )
    if supported:  # headers, truncation, and the tensors config.json needs (weights_check.py)
        yield from weights_problems(key, path, cfg.get("text_config", cfg))
    elif not any(path.glob("*.safetensors")):
        yield f"{key}={model_path!r}: no weights (*.safetensors); point it at {MODEL_DIR_FIX}"


def data_file_problems(key: str, files: list[str]) -> Problems:
    """Each file exists, is readable, has rows, and has at least one usable row (bad rows are
    named by row id)."""
    from megatron_armor.data.dataset import check_data_file

    if not files:
        yield f"{key} is empty; list at least one parquet/jsonl file"
    for source in files:
        try:
            check_data_file(source)
        except (OSError, ValueError) as e:
            yield f"{key}: {e}"


def input_problems(model_key: str, model_path: str, data: dict[str, list[str]]) -> list[str]:
    """Problems of the model directory and the data files (``{setting: files}``)."""
    found = list(model_dir_problems(model_key, model_path))
    for key, files in data.items():
        found.extend(data_file_problems(key, files))
    return found


def check_inputs(config: ArmorConfig) -> Problems:
    """The files ``armor train`` reads: ``trainer.model_path``, ``data.train_files`` and,
    when validation is on, ``data.val_files``."""
    from megatron_armor.data.sources import TARGETS

    data = {"data.train_files": config.data.train_files}
    if config.validation.every > 0:
        data["data.val_files"] = config.data.val_files
    yield from output_dir_problems(config.run.output_dir)
    yield from missing_watched_files(config, TARGETS)
    yield from wandb_problems(config)
    yield from input_problems("trainer.model_path", config.trainer.model_path, data)


def output_dir_problems(output_dir: str) -> Problems:
    """``run.output_dir`` exists or can be made, and this user can write in it: created if
    missing, then a file written and removed in it (the only sure test: permissions, a
    read-only or full file system, a path through a regular file)."""
    import tempfile

    path = Path(output_dir).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path, prefix=".armor-write-check-"):
            pass
    except OSError as e:
        yield (
            f"run.output_dir={output_dir!r} cannot be created or written ({type(e).__name__}: "
            f"{e}); point it at a directory this user can write"
        )


def wandb_problems(config: ArmorConfig) -> Problems:
    """``logging.wandb=true`` needs the ``wandb`` package on the driver's machine: refused at
    load, before Ray and the servers start."""
    import importlib.util

    if config.logging.wandb and importlib.util.find_spec("wandb") is None:
        yield (
            "logging.wandb=true but the `wandb` package is not installed here; "
            "`pip install -r requirements-wandb.txt` (the image has it) or set logging.wandb=false"
        )
    if config.logging.wandb and config.logging.wandb_mode == "online" and not wandb_login():
        yield (
            "logging.wandb=true (logging.wandb_mode=online) but no W&B login here: WANDB_API_KEY "
            "is not set and ~/.netrc has no api.wandb.ai entry (a container without your home "
            "directory, e.g. pyxis with --no-container-mount-home, does not see `wandb login`'s "
            "~/.netrc); export WANDB_API_KEY before sbatch (every step gets it) or set "
            "logging.wandb_mode=offline"
        )


def wandb_login() -> bool:
    """Whether W&B has credentials here: ``WANDB_API_KEY``, or ``wandb login``'s ``~/.netrc``
    entry for its host (``WANDB_BASE_URL``, default api.wandb.ai)."""
    import netrc
    import os
    from urllib.parse import urlparse

    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or ""
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False
