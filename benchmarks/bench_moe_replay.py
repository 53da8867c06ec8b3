"""Routing replay on the tiny Qwen3-MoE: mismatch, clipping and step time per mode, one run.

Each configuration (``trainer.moe.routing_replay`` ``off`` / ``r2`` / ``r3``, and under
``r3`` the anchors' rules ``own`` / ``reference`` / ``free``, ``trainer.moe.anchor_routes``)
runs the same seeded steps in a fresh process (one CPU rank, gloo):

1. a tiny random Qwen3-MoE (transformers' own initialisation: small router logits, so close
   expert scores, as a trained MoE has for many tokens) is written to a temp dir;
2. per step, the embedded engine in ``--engine-dtype`` (bf16 by default, as serving engines
   run) holding the trainer's current weights draws ``G - 1`` samples per prompt with their
   routes, and a reference engine (the initial weights, same dtype) draws the anchor (the
   ``G``-th sample); rewards are a fixed function of the tokens, advantages group-centred;
3. the trainer (fp32) runs ``step_logprobs`` (``old`` and reference passes) and
   ``train_step`` (``--minibatches`` updates), then the policy engine takes its weights.

Per configuration, averaged over the steps: the mismatch ``k3`` between the engine's and the
trainer's log-probs (policy samples against ``lp_old``, anchors against ``lp_ref``: the
``rollout/*_mismatch_k3`` metrics; the first step's policy ``k3`` and clip fraction apart: the
configurations share its weights and samples, later steps follow their own updates); on anchors, the ``k3`` between ``lp_old`` as the
configuration scores them and ``lp_old`` under the policy's own routing (an extra, untimed
pass: how far the anchors' routes take the policy's scores from the function the policy
runs); the clip fraction (low + high) and the anchors' mean ratio of the updates; the routing
agreement (``moe/route_agree_*``); the median trainer time per step (``step_logprobs`` +
``train_step``).

    python benchmarks/bench_moe_replay.py [--steps 4] [--prompts 4] [--group 4]
        [--engine-dtype bf16] [--new-tokens 24]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch

CONFIGS = [("off", "own"), ("r2", "own"), ("r3", "own"), ("r3", "reference"), ("r3", "free")]
VOCAB = 256


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6, help="RL steps per configuration")
    p.add_argument("--prompts", type=int, default=4, help="queries per step")
    p.add_argument("--group", type=int, default=4, help="samples per query (the last an anchor)")
    p.add_argument("--new-tokens", type=int, default=24, help="max response length")
    p.add_argument("--minibatches", type=int, default=2, help="updates per step")
    p.add_argument("--engine-dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--lr", type=float, default=1e-2, help="trainer learning rate")
    p.add_argument(
        "--tie-eps", type=float, default=0.0,
        help="> 0: every router's rows set to one row plus this much noise (near-ties: with an "
        "fp32 engine the only engine/trainer difference left is which experts they pick)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def make_model(root: str, seed: int, tie_eps: float = 0.0) -> str:
    """A tiny Qwen3-MoE (4 layers, 3 sparse; 8 experts, top-2) with transformers' init (the
    routers at near-ties with ``tie_eps``)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg)
    if tie_eps > 0:
        with torch.no_grad():
            for name, w in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    w.copy_(w[:1].expand_as(w) + tie_eps * torch.randn_like(w))
    path = os.path.join(root, "qwen3_moe")
    model.save_pretrained(path)
    return path


def trainer_config(model: str, mode: str, anchors: str, lr: float):
    from megatron_armor.config.schema import ArmorConfig

    cfg = ArmorConfig()
    t = cfg.trainer
    t.model_path, t.world_size, t.precision = model, 1, "fp32"
    t.lr, t.warmup_steps, t.grad_clip, t.lr_unit = lr, 0, 1.0, "updates"
    t.micro_batch_tokens, t.logprob_chunk = 256, 64
    t.moe.routing_replay, t.moe.anchor_routes = mode, anchors
    cfg.algo.ratio, cfg.algo.group_size, cfg.algo.loss_agg = "mixed", 4, "token-mean"  # alpha 3/4
    cfg.rollout.sampling.temperature = 1.0
    return cfg


def draw_batch(policy, reference, args, step: int):
    """One step's groups: ``G - 1`` policy samples and one anchor per prompt, with routes."""
    from megatron_armor.rollout.protocol import SamplingParams
    from megatron_armor.types import Group, Sample, SampleSource, pack_groups

    gen = torch.Generator().manual_seed(1000 * args.seed + step)
    prompts = [torch.randint(2, VOCAB, (6,), generator=gen).tolist() for _ in range(args.prompts)]
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, seed=step)
    drawn = policy.generate(prompts, args.group - 1, params)
    anchors = reference.generate(prompts, 1, params, weights="ref")
    groups = []
    for q, (prompt, outs, anchor) in enumerate(zip(prompts, drawn, anchors, strict=True)):
        samples = [Sample(f"q{q}", prompt, o.token_ids, o.logprobs, routed_experts=o.routed_experts)
                   for o in outs]  # fmt: skip
        a = anchor[0]
        samples.append(Sample(f"q{q}", prompt, a.token_ids, a.logprobs,
                              source=SampleSource.REFERENCE, routed_experts=a.routed_experts))  # fmt: skip
        scores = [sum(t % 2 == 0 for t in s.response_ids) / len(s.response_ids) for s in samples]
        mean = sum(scores) / len(scores)
        groups.append(Group(f"q{q}", samples, anchor_index=len(samples) - 1,
                            advantages=[s - mean for s in scores]))  # fmt: skip
    return pack_groups(groups)


def k3(lp_trainer: torch.Tensor, lp_engine: torch.Tensor) -> float:
    """Mean ``rho - 1 - log rho``, ``rho = exp(lp_trainer - lp_engine)``."""
    log_rho = (lp_trainer - lp_engine).double()
    return float((log_rho.exp() - 1 - log_rho).mean()) if len(log_rho) else float("nan")


def own_routing_logprobs(trainer, batch) -> torch.Tensor:
    """``lp_old`` with every router's own top-k (``routing_replay: off``): how far the pass's
    routes move the policy's log-probs of the anchors from its own routing's."""
    moe = trainer.config.trainer.moe
    mode, moe.routing_replay = moe.routing_replay, "off"
    try:
        own, _, _ = trainer.step_logprobs(batch, with_ref=False, shared=True)
    finally:
        moe.routing_replay = mode
    return own


def run_child(args) -> dict:
    """One configuration in this process (module docstring)."""
    from megatron_armor.rollout.torch_engine import TorchEngine
    from megatron_armor.trainer.megatron_trainer import MegatronTrainer

    mode, anchors = args.child.split(":")
    cfg = trainer_config(args.model, mode, anchors, args.lr)
    dtype = torch.bfloat16 if args.engine_dtype == "bf16" else torch.float32
    # the engine first: the trainer's CPU mode stands in for torch.cuda names transformers
    # reads when it loads a model
    engine = TorchEngine(args.model, dtype=dtype, return_routed_experts=True)
    engine.update_weights(engine.state_tensors(), 0, weights="ref")  # the initial weights
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    trainer = MegatronTrainer(cfg, 0, 1, "127.0.0.1", port)
    rows: dict[str, list[float]] = {}
    for step in range(args.steps):
        batch = draw_batch(engine, engine, args, step)
        start = time.perf_counter()
        old, ref, extra = trainer.step_logprobs(batch, with_ref=True, shared=True)
        batch.old_logprobs, batch.ref_logprobs = old, ref
        elapsed = time.perf_counter() - start
        own = own_routing_logprobs(trainer, batch)  # untimed: the measurement's own pass
        start = time.perf_counter()
        metrics = trainer.train_step(batch, args.minibatches)
        elapsed += time.perf_counter() - start
        engine.update_weights(trainer.export_weights(), step + 1)
        mask, anchor = batch.loss_mask > 0, batch.is_anchor
        policy = mask & ~anchor
        values = {
            "policy_k3": k3(old[policy], batch.engine_logprobs[policy]),
            "anchor_k3": k3(ref[anchor], batch.engine_logprobs[anchor]),
            "anchor_old_bias_k3": k3(old[anchor], own[anchor]),
            "clipfrac": metrics["loss/clipfrac_low"] + metrics["loss/clipfrac_high"],
            "anchor_ratio": metrics.get("loss/anchor_ratio_mean", float("nan")),
            "step_s": elapsed,
            **{k: v for k, v in {**extra, **metrics}.items() if k.startswith("moe/")},
        }
        for k, v in values.items():
            rows.setdefault(k, []).append(v)
    trainer.close()
    out = {k: statistics.fmean(v) for k, v in rows.items()}
    out["policy_k3_first"], out["clipfrac_first"] = rows["policy_k3"][0], rows["clipfrac"][0]
    out["step_s"] = statistics.median(rows["step_s"])
    return out


COLUMNS = [
    ("policy_k3_first", "policy k3, step 1", "{:.2e}"),
    ("clipfrac_first", "clip frac, step 1", "{:.4f}"),
    ("policy_k3", "policy k3", "{:.2e}"),
    ("anchor_k3", "anchor k3", "{:.2e}"),
    ("anchor_old_bias_k3", "anchor old vs own routes k3", "{:.2e}"),
    ("clipfrac", "clip frac", "{:.4f}"),
    ("anchor_ratio", "anchor ratio", "{:.4f}"),
    ("moe/route_agree_policy", "agree policy", "{:.3f}"),
    ("moe/route_agree_anchor", "agree anchor", "{:.3f}"),
    ("moe/route_agree_update", "agree update", "{:.3f}"),
    ("step_s", "step s", "{:.2f}"),
]


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(run_child(args)))
        return
    results = {}
    with tempfile.TemporaryDirectory() as root:
        model = make_model(root, args.seed, args.tie_eps)
        for mode, anchors in CONFIGS:
            cmd = [sys.executable, __file__, "--child", f"{mode}:{anchors}", "--model", model,
                   *(argv if argv is not None else sys.argv[1:])]  # fmt: skip
            env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
            line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
            if done.returncode or not line:
                sys.exit(f"{mode}:{anchors} failed:\n{done.stderr[-3000:]}")
            results[f"{mode} / {anchors}"] = json.loads(line[-1][len("RESULT ") :])
    print("| routing_replay / anchor_routes | " + " | ".join(c[1] for c in COLUMNS) + " |")
    print("|---" * (len(COLUMNS) + 1) + "|")
    for name, r in results.items():
        cells = [fmt.format(r[k]) if k in r else "-" for k, _, fmt in COLUMNS]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
