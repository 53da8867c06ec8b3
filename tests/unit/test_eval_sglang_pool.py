"""``armor eval --backend sglang`` sizes its SGLang pool from the GPUs it sees (``eval.sbatch
--gpus-per-node=8``: 8 servers at tp 1, not one on GPU 0). The servers' launch needs GPUs and
SGLang (the ``gpu`` tier); here the count and each server's GPU. Tier: unit."""

from __future__ import annotations

import argparse

import pytest

from megatron_armor.cli.eval_cmd import eval_servers, servers_to_start
from megatron_armor.config import ConfigError, load_config
from megatron_armor.config.sglang_pools import policy_pool
from megatron_armor.rollout.sglang.engine import SGLangEngine

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "engines, tp, visible, servers",
    [(0, 1, 8, 8), (0, 2, 8, 4), (0, 1, 1, 1), (0, 1, 0, 1), (3, 1, 8, 3), (2, 4, 8, 2)],
)
def test_one_server_per_tp_gpus_unless_the_count_is_set(engines, tp, visible, servers):
    assert eval_servers(engines, tp, visible) == servers


def test_a_set_count_that_needs_more_gpus_than_visible_is_refused():
    with pytest.raises(ConfigError, match="num_engines=5 x tp 2 needs 10 GPUs but 8 are visible"):
        eval_servers(5, 2, 8)


def test_eight_visible_gpus_start_eight_servers_each_on_its_gpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    config = load_config(None, ["rollout.backend=sglang"])
    args = argparse.Namespace(sglang_url=None)
    count = servers_to_start(args, config)
    assert count == 8
    engine = SGLangEngine(
        "model", config.rollout.sglang, pool=policy_pool(config.rollout.sglang, count)
    )
    try:
        assert [s.gpu for s in engine.servers] == list(range(8))
    finally:
        engine.close()
    assert servers_to_start(argparse.Namespace(sglang_url=["http://h:1"]), config) == 0
