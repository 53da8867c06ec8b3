"""Unit tier: an actor takes its start-up heap out of the garbage collector's view.

``workers.freeze_heap`` runs at the end of every actor's start-up (docs/orchestration.md,
garbage collector): a full collection walking the imported torch / transformers objects
stalled a step by about 0.09 s. A reward worker is built in a fresh interpreter (as Ray
starts an actor) and must leave the objects alive then frozen, and later garbage still
collected.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"
SCRIPT = """
import gc
from megatron_armor.config import load_config
from megatron_armor.orchestration.actors.workers import RewardWorker
config = load_config(CONFIG, [])
before = gc.get_freeze_count()
worker = RewardWorker(config, 1)
frozen = gc.get_freeze_count()
class Cycle:
    pass
a, b = Cycle(), Cycle()
a.other, b.other = b, a
del a, b
collected = gc.collect()
worker.close()
print(before, frozen, collected)
"""


def test_a_started_actor_has_frozen_its_heap() -> None:
    script = f"CONFIG = {str(CONFIG)!r}\n" + SCRIPT
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=180)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    before, frozen, collected = map(int, done.stdout.split()[-3:])
    assert before == 0 and frozen > 10_000  # the imports and the scorer: out of the walk
    assert collected >= 2  # a cycle made afterwards is still collected
