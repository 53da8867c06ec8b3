"""The name registry and the import boundary of ``megatron_armor.algo`` (docs/architecture.md). Tier: unit."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import megatron_armor.algo
from megatron_armor.algo import registry

pytestmark = pytest.mark.unit

ALGO_DIR = Path(megatron_armor.algo.__file__).parent
ALLOWED_IMPORTS = (
    "torch",
    "math",
    "dataclasses",
    "typing",
    "collections",
    "__future__",
    "megatron_armor.types",
    "megatron_armor.algo",
)


def test_every_registered_name_resolves():
    for name in registry.RATIO_MODES:
        assert registry.get_ratio(name).name == name
    for name in registry.AGGREGATIONS:
        assert registry.get_aggregation(name).name == name
    for name in registry.ANCHOR_MODES:
        assert registry.get_anchor_mode(name).name == name
    assert set(registry.ADVANTAGES) == {"grpo", "qae", "quatro"}
    assert set(registry.KL_ESTIMATORS) == {"k1", "k2", "k3"}
    assert set(registry.RESET_SCHEDULES) == {"none", "every", "every-until", "log2"}
    assert callable(registry.get_advantage("qae").fn) and callable(registry.get_kl_estimator("k2"))


@pytest.mark.parametrize(
    "getter, setting",
    [
        (registry.get_ratio, "algo.ratio"),
        (registry.get_advantage, "algo.advantage"),
        (registry.get_aggregation, "algo.loss_agg"),
        (registry.get_kl_estimator, "algo.kl_estimator"),
        (registry.get_anchor_mode, "algo.anchor"),
    ],
)
def test_unknown_names_list_the_valid_ones(getter, setting):
    with pytest.raises(ValueError, match=rf"{setting}='bogus': unknown name; use one of \["):
        getter("bogus")


def test_algo_sources_import_only_torch_stdlib_and_types():
    for path in ALGO_DIR.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "distributed":
                raise AssertionError(f"{path.name}:{node.lineno} uses torch.distributed")
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name.startswith(ALLOWED_IMPORTS), f"{path.name} imports {name}"
                assert not name.startswith("torch.distributed"), f"{path.name} imports {name}"


BLOCKER = r"""
import importlib.abc, sys
BLOCKED = ("megatron", "ray", "sglang", "omegaconf", "transformers", "megatron_armor.config")
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            raise ImportError(f"blocked import: {name}")
        return None
sys.meta_path.insert(0, Blocker())
import torch
class Poison:
    def __getattr__(self, attr):
        raise RuntimeError(f"algo touched torch.distributed.{attr}")
torch.distributed = Poison()
import megatron_armor.algo as algo
from megatron_armor.types import Sample
s = algo.LossSettings()
lp = torch.zeros(4, requires_grad=True)
loss, m = algo.compute_policy_loss(lp, lp.detach(), lp.detach() - 1, torch.ones(4), torch.ones(4),
    torch.tensor([0, 0, 1, 1]).bool(), torch.tensor([0, 0, 1, 1]), s, 4.0)
loss.backward()
g, reason = algo.select_group("q", [Sample("q", [1], [2], acc=True), Sample("q", [1], [2])],
    [Sample("q", [1], [3], acc=True)], "armor", False)
algo.assign_advantages([g])
assert reason == "accepted" and len(g.advantages) == 3
assert algo.ResetSchedule("log2").should_reset(8)
bad = [m for m in sys.modules if m.split(".")[0] in ("megatron", "ray", "sglang", "omegaconf")]
assert not bad and "megatron_armor.config" not in sys.modules, bad
print("ok", round(loss.item(), 6))
"""


def test_algo_works_with_heavy_packages_blocked():
    root = ALGO_DIR.parent.parent
    proc = subprocess.run(
        [sys.executable, "-c", BLOCKER], capture_output=True, text=True, cwd=root, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("ok ")
