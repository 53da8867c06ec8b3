"""Worker processes of ``armor doctor``, each an independent ``python -m`` process:

- ``ipc-receive``: unpickle CUDA tensors sent by another process (CUDA IPC handles, torch's
  ``ForkingPickler`` reductions) from stdin and print their checksum as JSON;
- ``nccl-rank RANK WORLD PORT``: one rank of an NCCL all-reduce over the node's GPUs;
- ``trainer SPEC_JSON``: one megatron-core trainer rank on a tiny model: the log-probs of the
  given samples, then one ARMOR update (gloo on CPU, NCCL on a GPU).

Each prints one JSON line last on stdout; the parent (:mod:`megatron_armor.doctor.node`) reads it.
"""

from __future__ import annotations

import json
import math
import pickle
import sys
import time

import torch

TINY_VOCAB = 128


def build_tiny_model(path: str, seed: int = 0, logit_scale: float = 1.0) -> str:
    """A 2-layer Qwen2 (vocab 128, hidden 64) saved as an HF dir at ``path``; its output layer
    is multiplied by ``logit_scale`` (> 1: log-probs spread over several nats)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        eos_token_id=1, pad_token_id=0, bos_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    model.save_pretrained(path)
    return path


def ipc_receive() -> dict:
    """Checksums of the tensors pickled on stdin (CUDA tensors arrive as IPC handles)."""
    tensors = pickle.loads(sys.stdin.buffer.read())
    return {"devices": [str(t.device) for t in tensors], "sums": [float(t.sum()) for t in tensors]}


def nccl_rank(rank: int, world: int, port: int, megabytes: int = 256) -> dict:
    """All-reduce ``rank + 1`` over ``world`` GPUs; the sum and the bus bandwidth."""
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)  # fmt: skip
    try:
        data = torch.full((megabytes << 18,), float(rank + 1), device="cuda")
        dist.all_reduce(data)  # warm-up, and the value checked
        value = float(data[0])
        torch.cuda.synchronize()
        start, reps = time.perf_counter(), 5
        for _ in range(reps):
            dist.all_reduce(data)
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / reps
        bus_gbps = 2 * (world - 1) / world * data.numel() * 4 / seconds / 1e9 if world > 1 else 0
        return {"value": value, "expected": world * (world + 1) / 2, "bus_gbps": bus_gbps}
    finally:
        dist.destroy_process_group()


def trainer_step(spec: dict) -> dict:
    """``spec``: ``model_dir``, ``port``, ``samples`` ([[prompt_ids, response_ids], ...], 4 per
    group, the last of each group the anchor), ``trainer`` (``TrainerConfig`` fields) and
    ``temperature``. Returns the samples' response log-probs and the update's metrics."""
    from megatron_armor.config.schema import ArmorConfig, FP8Config
    from megatron_armor.trainer.megatron_trainer import MegatronTrainer

    cfg = ArmorConfig()
    for key, value in spec["trainer"].items():
        setattr(cfg.trainer, key, FP8Config(**value) if key == "fp8" else value)
    cfg.trainer.model_path = spec["model_dir"]
    cfg.rollout.sampling.temperature = spec["temperature"]
    cfg.algo.group_size = 4  # alpha 'auto': 3/4 (config.resolved)
    trainer = MegatronTrainer(cfg, 0, 1, "127.0.0.1", spec["port"])
    try:
        batch = doctor_batch(spec["samples"])
        logprobs = trainer.compute_logprobs(batch)
        batch.old_logprobs, batch.ref_logprobs = logprobs.clone(), logprobs.clone()
        metrics = trainer.train_step(batch, 1)
    finally:
        trainer.close()
    finite = all(math.isfinite(v) for v in metrics.values())
    response_lp = logprobs[batch.loss_mask.bool()].float().tolist()
    return {"logprobs": response_lp, "metrics_finite": finite, "metrics": metrics}


def doctor_batch(samples: list[list[list[int]]]):
    """Groups of 4 samples (the last one of each an anchor) with +-1 advantages."""
    from megatron_armor.types import Group, Sample, SampleSource, pack_groups

    groups = []
    for g in range(len(samples) // 4):
        members = [
            Sample(f"q{g}", prompt, response,
                   source=SampleSource.REFERENCE if i == 3 else SampleSource.POLICY)
            for i, (prompt, response) in enumerate(samples[4 * g : 4 * g + 4])
        ]  # fmt: skip
        groups.append(Group(f"q{g}", members, anchor_index=3, advantages=[1.0, -1.0, -1.0, 1.0]))
    return pack_groups(groups)


def main(argv: list[str]) -> None:
    name, args = argv[0], argv[1:]
    if name == "ipc-receive":
        result = ipc_receive()
    elif name == "nccl-rank":
        result = nccl_rank(int(args[0]), int(args[1]), int(args[2]))
    elif name == "trainer":
        result = trainer_step(json.loads(args[0]))
    else:
        raise SystemExit(f"unknown probe {name!r}: ipc-receive | nccl-rank | trainer")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
