"""Embedded rollout engine vs transformers ``generate``, and weight-sync bandwidth.

Prints, side by side in one run, on the same random Qwen2 model and the same left-padded
batch (every sequence decodes exactly ``--new-tokens`` tokens: the model has no EOS):

- tokens/s of ``TorchEngine.generate`` (which also returns per-token log-probs) and of
  ``model.generate(do_sample=True)`` (which does not), and their ratio (target >= 1.0);
- the same with ``--n`` samples per prompt (``num_return_sequences`` for ``generate``);
- bytes/s of ``TorchEngine.update_weights`` from a full HF-named state dict.

Each timing is the median of ``--reps`` runs after one warm-up run.

    python benchmarks/bench_rollout.py [--device cuda] [--hidden 256 --layers 4 ...]
"""

from __future__ import annotations

import argparse
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
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--batch", type=int, default=16, help="prompts per batch")
    p.add_argument("--n", type=int, default=4, help="samples per prompt in the second comparison")
    p.add_argument("--prompt-len", type=int, default=48, help="longest prompt (others shorter)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    return p.parse_args()


def build_model(path: str, args: argparse.Namespace, seed: int) -> str:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2,
        max_position_embeddings=1024, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


def make_prompts(args: argparse.Namespace) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    lengths = [args.prompt_len - (i * 7) % (args.prompt_len // 2) for i in range(args.batch)]
    return [torch.randint(2, args.vocab, (n,), generator=gen).tolist() for n in lengths]


def median_time(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


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


def compare_generation(engine: TorchEngine, prompts, n: int, args) -> tuple[float, float]:
    tokens = len(prompts) * n * args.new_tokens
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, seed=0)
    ours = median_time(lambda: engine.generate(prompts, n, params), args.reps)
    theirs = median_time(lambda: hf_generate(engine, prompts, n, args.new_tokens), args.reps)
    return tokens / ours, tokens / theirs


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
        source = TorchEngine(build_model(f"{tmp}/b", args, 1), device=args.device)
        prompts = make_prompts(args)
        n_params = sum(t.numel() for _, t in engine.state_tensors())
        print(f"model: Qwen2 hidden={args.hidden} layers={args.layers} vocab={args.vocab} "
              f"({n_params / 1e6:.1f}M params) on {args.device}, torch threads={torch.get_num_threads()}")  # fmt: skip
        print(f"{'case':<34}{'engine tok/s':>14}{'generate tok/s':>16}{'ratio':>8}")
        for n, label in (
            (1, f"{args.batch} prompts x 1"),
            (args.n, f"{args.batch // args.n} prompts x {args.n}"),
        ):
            batch = prompts if n == 1 else prompts[: args.batch // args.n]
            ours, theirs = compare_generation(engine, batch, n, args)
            print(
                f"{label + f', {args.new_tokens} new tokens':<34}{ours:>14.1f}{theirs:>16.1f}{ours / theirs:>8.2f}"
            )
        rate, nbytes = weight_sync_bandwidth(engine, source, args.reps)
        print(f"weight sync into the engine: {nbytes / 2**20:.1f} MiB in {nbytes / rate * 1e3:.1f} ms "
              f"= {rate / 2**30:.2f} GiB/s ({rate:.3e} bytes/s)")  # fmt: skip


if __name__ == "__main__":
    main()
