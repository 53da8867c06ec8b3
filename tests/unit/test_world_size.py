"""``trainer.world_size: auto`` and the idle-GPU refusal, through the config loader and the
``armor train`` / ``armor plan`` / ``armor config`` entry points. Tier: unit."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_armor.cli import main as armor_main
from megatron_armor.config import ArmorConfig, ConfigError, load_config

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
BASE = str(REPO / "configs" / "base.yaml")
FOUR_NODES = ["orchestration.nodes=4", "orchestration.gpus_per_node=8"]


def test_auto_is_every_gpu_of_the_job_colocated_and_the_trainer_pool_disaggregated():
    assert load_config(BASE).resolved.world_size == 8  # the one-node default
    assert load_config(BASE, FOUR_NODES).resolved.world_size == 32
    disaggregated = [*FOUR_NODES, "orchestration.layout=disaggregated",
                     "orchestration.rollout_gpus=8", "rollout.sglang.weight_transport=distributed"]  # fmt: skip
    assert load_config(BASE, disaggregated).resolved.world_size == 24


def test_auto_is_one_rank_per_node_on_cpu_and_the_tiny_config_keeps_one_rank():
    tiny = str(REPO / "configs" / "tiny_cpu.yaml")
    assert load_config(tiny).resolved.world_size == 1
    assert load_config(tiny, ["orchestration.nodes=2"]).resolved.world_size == 2
    assert ArmorConfig().resolved.world_size == 1  # a config built in code decides it alike


def test_an_explicit_size_that_idles_gpus_is_refused_with_the_fix():
    with pytest.raises(ConfigError) as info:
        load_config(BASE, [*FOUR_NODES, "trainer.world_size=8"])
    message = str(info.value)
    assert "trainer.world_size=8 leaves 24 of the job's orchestration.nodes=4 x " in message
    assert "set trainer.world_size=auto (32)" in message
    assert "trainer.allow_idle_gpus=true" in message
    idle = load_config(BASE, [*FOUR_NODES, "trainer.world_size=8", "trainer.allow_idle_gpus=true"])
    assert idle.resolved.world_size == 8  # deliberate
    with pytest.raises(ConfigError, match=r"trainer.world_size=64: more ranks than the job's"):
        load_config(BASE, [*FOUR_NODES, "trainer.world_size=64"])
    # cpu: ranks share a node's cores, nothing idles
    assert load_config(None, ["orchestration.nodes=2", "trainer.world_size=1"])


def test_auto_without_gpus_left_for_the_trainer_and_a_bad_word_are_named():
    with pytest.raises(ConfigError, match=r"world_size=auto: the disaggregated layout leaves no"):
        load_config(BASE, ["orchestration.layout=disaggregated", "orchestration.rollout_gpus=8"])
    with pytest.raises(ConfigError, match=r"trainer.world_size='all': a number of trainer ranks"):
        load_config(BASE, ["trainer.world_size=all"])


def test_armor_train_refuses_before_ray_and_armor_plan_exits_2(monkeypatch, capsys):
    import megatron_armor.orchestration.step.loop as loop

    def never(*args, **kwargs):
        raise AssertionError("training started")

    monkeypatch.setattr(loop, "train", never)
    idle = [*FOUR_NODES, "trainer.world_size=8"]
    assert armor_main(["train", BASE, *idle]) == 2
    assert "trainer.world_size=8 leaves 24" in capsys.readouterr().err
    assert armor_main(["plan", BASE, *idle]) == 2
    assert "trainer.allow_idle_gpus=true" in capsys.readouterr().err
    assert armor_main(["config", "show", BASE, *FOUR_NODES]) == 0
    assert "world_size: 32" in capsys.readouterr().out
