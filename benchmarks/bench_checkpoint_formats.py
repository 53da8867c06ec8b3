"""Trainer checkpoint formats side by side: save time, load time and bytes, in one run.

Each model and layout runs in its own group of trainer processes (gloo, CPU, the distributed
optimizer, fp32): one ARMOR update (the Adam state exists), then rounds in which every
variant (``trainer/checkpoint.py: SaveFormat``) saves the trainer state (policy, reference,
optimizer, scheduler) and loads it back at the same layout, in an order alternated per round.
A time is the slowest rank's, from a barrier to a barrier; bytes are the checkpoint's on disk
(all files) and its optimizer tensors' (from the checkpoint's metadata).

Variants:

- ``dp_reshardable``: the flat buffers of each data-parallel rank, written by every rank
  (reshards over DP only);
- ``fully_reshardable``: per-parameter state, gathered over DP on every rank (all-gather),
  written by data-parallel rank 0 (reshards to any layout);
- ``fully_reshardable/dp0``: the same, gathered on data-parallel rank 0 only (gloo gather);
- ``fully_reshardable/parallel``: gathered on every rank, the writes of the tensors the DP
  ranks hold alike spread over them and the reads of a load too (megatron-core's fully
  parallel save and load strategies).

``armor train`` saves and loads as ``fully_reshardable/parallel`` (``trainer/checkpoint.py:
SAVE_FORMAT``; docs/trainer.md says why).

Models: ``tiny`` (``armor tiny``'s model: ``ARMOR_TINY_DIR`` or ``artifacts/tiny``) at dp 2,
the dist tier's tiny Qwen2 at tp 2 and at pp 2 (dp 2 each: 4 ranks), and ``--wide`` a 14 M
parameter Qwen2 of the same shape family at tp 2, dp 2 (bytes that dominate the fixed costs).

    python benchmarks/bench_checkpoint_formats.py [--rounds 3] [--wide]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests" / "dist")]

VARIANTS = {  # name: (optimizer format, gather on DP rank 0, parallel I/O)
    "dp_reshardable": ("dp_reshardable", False, False),
    "fully_reshardable": ("fully_reshardable", False, False),
    "fully_reshardable/dp0": ("fully_reshardable", True, False),
    "fully_reshardable/parallel": ("fully_reshardable", False, True),
}
WIDE = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4,
        "num_attention_heads": 8, "num_key_value_heads": 4}  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="save + load of every variant per round")
    p.add_argument("--wide", action="store_true", help="also a 14 M parameter model at tp 2")
    p.add_argument("--worker", nargs=7, metavar="ARG", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_wide_model(root: Path) -> str:
    """A random Qwen2 of :data:`WIDE`'s shape (vocabulary 200, as the dist tier's)."""
    from tiny_models import VOCAB
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = root / "wide"
    config = Qwen2Config(vocab_size=VOCAB, max_position_embeddings=128, **WIDE)
    Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)


def models_and_layouts(root: Path, wide: bool) -> list[tuple[str, str, int, int, int]]:
    """``(name, model_dir, tp, pp, world)`` of each measured group."""
    from tiny_models import make_models

    tiny = Path(os.environ.get("ARMOR_TINY_DIR", REPO / "artifacts" / "tiny")) / "model"
    if not (tiny / "config.json").is_file():
        raise SystemExit(f"no tiny model at {tiny}: run `armor tiny --out artifacts/tiny` first")
    dist = make_models(str(root / "dist"))["qwen2"]
    groups = [("tiny dp2", str(tiny), 1, 1, 2), ("dist tp2 dp2", dist, 2, 1, 4),
              ("dist pp2 dp2", dist, 1, 2, 4)]  # fmt: skip
    if wide:
        groups.append(("wide tp2 dp2", make_wide_model(root), 2, 1, 4))
    return groups


def optimizer_bytes(dist_dir: Path) -> int:
    """Bytes of the checkpoint's optimizer tensors (their global shapes in ``.metadata``)."""
    import pickle

    with (dist_dir / ".metadata").open("rb") as f:
        metadata = pickle.load(f)  # written by this process's group a moment ago
    total = 0
    for key, item in metadata.state_dict_metadata.items():
        if key.startswith("optimizer.") and hasattr(item, "size"):
            numel = 1
            for n in item.size:
                numel *= n
            total += numel * item.properties.dtype.itemsize
    return total


def timed(fn) -> float:
    """Seconds of the slowest rank, from a barrier to a barrier."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds)


def worker(rank: int, world: int, port: int, model_dir: str, tp: int, pp: int, out: str) -> None:
    """One trainer rank: an update, then the rounds of saves and loads; rank 0 writes the
    measurements to ``out/results.jsonl``."""
    import torch.distributed as dist
    from reshard_worker import config
    from tiny_models import make_batch, perturb
    from trainer_worker import full

    from megatron_armor.trainer.checkpoint import SaveFormat, load_trainer, save_trainer
    from megatron_armor.trainer.megatron_trainer import MegatronTrainer

    trainer = MegatronTrainer(config(model_dir, world, tp, pp, 1, tp), rank, world,
                              "127.0.0.1", port)  # fmt: skip
    batch = make_batch()
    batch.tokens = batch.tokens % trainer.spec.vocab_size
    lp0 = full(trainer.compute_logprobs(batch, "policy"))
    batch.old_logprobs = perturb(lp0, batch.loss_mask, 1, 0.3)
    batch.ref_logprobs = perturb(lp0, batch.loss_mask, 2, 0.3)
    trainer.train_step(batch, 1)
    rounds = int(os.environ["BENCH_ROUNDS"])
    names = list(VARIANTS)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            fmt = SaveFormat(*VARIANTS[name])
            path = os.path.join(out, f"r{r}_{name.replace('/', '_')}")
            save_s = timed(lambda: save_trainer(trainer, path, {"step": 1}, fmt))  # noqa: B023
            load_s = timed(lambda: load_trainer(trainer, path, fmt))  # noqa: B023
            if rank == 0:
                record = {"variant": name, "round": r, "save_s": save_s, "load_s": load_s,
                          "bytes": sum(p.stat().st_size for p in Path(path).rglob("*")),
                          "optimizer_bytes": optimizer_bytes(Path(path) / "dist")}  # fmt: skip
                with open(os.path.join(out, "results.jsonl"), "a") as f:
                    f.write(json.dumps(record) + "\n")
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path)
    trainer.close()


def run_group(model_dir: str, tp: int, pp: int, world: int, rounds: int, out: Path) -> list:
    """The group's ranks as processes of this script (bounded); its measurements."""
    from megatron_armor.trainer.ranks import run_rank_processes

    out.mkdir(parents=True)
    port = free_port()
    commands = [[sys.executable, __file__, "--worker", str(rank), str(world), str(port),
                 model_dir, str(tp), str(pp), str(out)] for rank in range(world)]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               BENCH_ROUNDS=str(rounds))  # fmt: skip
    logs = [str(out / f"log{rank}.txt") for rank in range(world)]
    run_rank_processes(commands, logs, env, 600 + 120 * rounds)
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def summary(records: list[dict]) -> dict[str, dict]:
    """Per variant: median save and load seconds over the rounds, bytes."""
    out = {}
    for name in VARIANTS:
        mine = [r for r in records if r["variant"] == name]
        out[name] = {
            "save_s": statistics.median(r["save_s"] for r in mine),
            "load_s": statistics.median(r["load_s"] for r in mine),
            "bytes": mine[0]["bytes"],
            "optimizer_bytes": mine[0]["optimizer_bytes"],
        }
    return out


def table(group: str, rows: dict[str, dict]) -> str:
    base = rows["dp_reshardable"]
    lines = [f"{group}:", f"  {'variant':<28}{'save s':>8}{'x':>6}{'load s':>8}{'x':>6}"
             f"{'bytes':>12}{'optimizer':>12}"]  # fmt: skip
    for name, r in rows.items():
        lines.append(
            f"  {name:<28}{r['save_s']:8.3f}{r['save_s'] / base['save_s']:6.2f}"
            f"{r['load_s']:8.3f}{r['load_s'] / base['load_s']:6.2f}"
            f"{r['bytes']:12,d}{r['optimizer_bytes']:12,d}"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        rank, world, port, model_dir, tp, pp, out = args.worker
        worker(int(rank), int(world), int(port), model_dir, int(tp), int(pp), out)
        return
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as tmp:
        root = Path(tmp)
        for i, (group, model_dir, tp, pp, world) in enumerate(models_and_layouts(root, args.wide)):
            records = run_group(model_dir, tp, pp, world, args.rounds, root / f"g{i}")
            print(table(group, summary(records)), flush=True)
    print(f"medians of {args.rounds} rounds; x: ratio to dp_reshardable", flush=True)


if __name__ == "__main__":
    main()
