"""Embedded rollout engine vs transformers ``generate``, interleaved, and weight-sync bandwidth.

By default at the tiny config's real shape: a random Qwen2 with the dimensions of
``artifacts/tiny/model`` (``--like``; or ``--hidden/--layers/--vocab`` with ``--like ""``),
``rollout.gen_batch = 16`` prompts of up to 32 tokens, ``n = 7`` samples each
(``group_size - 1``), 40 new tokens (every sequence decodes exactly that many: the model has
no EOS), one torch thread for both (``--threads``). Printed, side by side in one run:

- tokens/s of ``TorchEngine.generate`` (which also returns per-token log-probs) and of
  ``model.generate(do_sample=True)`` (which does not), with ``n`` samples per prompt
  (``num_return_sequences``) and with 1: ``--reps`` rounds after one warm-up each, every
  round times both, the order swapped each round; min / median / max over rounds of the
  per-round ratio engine / generate;
- the same for the engine's decode steps through ``DecodeStep`` (the default) vs through the
  HF forward (``fast_decode=False``): same tokens, same log-probs;
- bytes/s of ``TorchEngine.update_weights`` from a full HF-named state dict (median).

    python benchmarks/bench_rollout.py [--reps 6] [--device cuda] [--like ""] [--hidden 256 ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from megatron_armor.rollout.protocol import SamplingParams
from megatron_armor.rollout.torch_engine import TorchEngine


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--like", default="artifacts/tiny/model", help="copy this model's shape")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--batch", type=int, default=16, help="prompts per batch (rollout.gen_batch)")
    p.add_argument("--n", type=int, default=7, help="samples per prompt (group_size - 1)")
    p.add_argument("--prompt-len", type=int, default=32, help="longest prompt (others shorter)")
    p.add_argument("--new-tokens", type=int, default=40)
    p.add_argument("--reps", type=int, default=6, help="interleaved rounds")
    p.add_argument("--threads", type=int, default=1, help="torch threads for both (0: as is)")
    args = p.parse_args()
    if args.like:
        with open(f"{args.like}/config.json") as f:
            cfg = json.load(f)
        args.hidden, args.layers, args.vocab = (cfg["hidden_size"], cfg["num_hidden_layers"],
                                                cfg["vocab_size"])  # fmt: skip
        args.heads, args.kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    return args


def build_model(path: str, args: argparse.Namespace, seed: int) -> str:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=1024, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


def make_prompts(args: argparse.Namespace) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    lengths = [args.prompt_len - (i * 7) % (args.prompt_len // 2) for i in range(args.batch)]
    return [torch.randint(2, args.vocab, (n,), generator=gen).tolist() for n in lengths]


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def median_time(fn, reps: int) -> float:
    fn()  # warm-up
    return statistics.median(seconds(fn) for _ in range(reps))


def interleaved_ratios(ours, theirs, reps: int) -> list[float]:
    """Per round ``time(theirs) / time(ours)`` (a tokens/s ratio), the two timed back to back,
    the order swapped every round, after one warm-up each."""
    ours(), theirs()
    ratios = []
    for r in range(reps):
        first, second = (ours, theirs) if r % 2 == 0 else (theirs, ours)
        a, b = seconds(first), seconds(second)
        t_ours, t_theirs = (a, b) if r % 2 == 0 else (b, a)
        ratios.append(t_theirs / t_ours)
    return ratios


def hf_generate(engine: TorchEngine, prompts: list[list[int]], n: int, new_tokens: int) -> None:
    """``transformers`` sampling on the same left-padded batch (no log-probs returned)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=engine.device)
    mask = torch.tensor(
        [[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=engine.device
    )
    model = engine._model("policy")
    with torch.no_grad():
        model.generate(
            input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
            top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            num_return_sequences=n, pad_token_id=0,
        )  # fmt: skip


def compare_generation(engine: TorchEngine, prompts, n: int, args) -> list[float]:
    """Per-round tokens/s ratios engine / ``generate`` (same tokens: no EOS)."""
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, seed=0)
    return interleaved_ratios(
        lambda: engine.generate(prompts, n, params),
        lambda: hf_generate(engine, prompts, n, args.new_tokens),
        args.reps,
    )


def compare_decode_step(
    fast: TorchEngine, plain: TorchEngine, prompts, n: int, args
) -> list[float]:
    """Per-round tokens/s ratios ``DecodeStep`` / HF-forward decode steps (same samples)."""
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, seed=0)
    return interleaved_ratios(
        lambda: fast.generate(prompts, n, params),
        lambda: plain.generate(prompts, n, params),
        args.reps,
    )


def weight_sync_bandwidth(engine: TorchEngine, source: TorchEngine, reps: int) -> tuple[float, int]:
    tensors = source.state_tensors()
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    seconds = median_time(lambda: engine.update_weights(tensors, version=1), reps)
    return nbytes / seconds, nbytes


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        engine = TorchEngine(build_model(f"{tmp}/a", args, 0), device=args.device, max_batch=256)
        plain = TorchEngine(engine.model_dir, device=args.device, max_batch=256, fast_decode=False)
        source = TorchEngine(build_model(f"{tmp}/b", args, 1), device=args.device)
        prompts = make_prompts(args)
        n_params = sum(t.numel() for _, t in engine.state_tensors())
        print(f"model: Qwen2 hidden={args.hidden} layers={args.layers} vocab={args.vocab} "
              f"({n_params / 1e6:.1f}M params) on {args.device}, torch threads={torch.get_num_threads()}")  # fmt: skip
        print(f"{'case':<40}{'engine / generate tokens/s (min / median / max)':>50}")
        for n in (args.n, 1):
            ratios = compare_generation(engine, prompts, n, args)
            label = f"{args.batch} prompts x {n}, {args.new_tokens} new tokens"
            print(f"{label:<40}{min(ratios):>20.2f} / {statistics.median(ratios):.2f} / "
                  f"{max(ratios):.2f}")  # fmt: skip
        print(f"{'case':<40}{'DecodeStep / HF forward tokens/s (min / median / max)':>50}")
        for n in (args.n, 1):
            ratios = compare_decode_step(engine, plain, prompts, n, args)
            label = f"{args.batch} prompts x {n}, {args.new_tokens} new tokens"
            print(f"{label:<40}{min(ratios):>20.2f} / {statistics.median(ratios):.2f} / "
                  f"{max(ratios):.2f}")  # fmt: skip
        rate, nbytes = weight_sync_bandwidth(engine, source, args.reps)
        print(f"weight sync into the engine: {nbytes / 2**20:.1f} MiB in {nbytes / rate * 1e3:.1f} ms "
              f"= {rate / 2**30:.2f} GiB/s ({rate:.3e} bytes/s)")  # fmt: skip


if __name__ == "__main__":
    main()
