"""``armor eval --model DIR --data FILE... --k 32``: avg@k / pass@k / maj@k per benchmark.

Settings not given on the command line come from ``--config`` (a YAML config, or a run
directory: its resolved ``config.yaml``; its ``validation``, ``rollout.sampling.max_new_tokens``,
``data`` and ``reward`` sections, and ``trainer.model_overrides``, which both engines apply as
the run did) or, without one, from the schema defaults. Without ``--data`` the benchmarks are
the config's ``data.val_files``. ``--step N`` samples with the seed of the run's validation at
step ``N``: on that step's checkpoint (``armor convert --to-hf RUN_DIR N``) with the run's
engine, the report gives the run's ``val/*`` numbers of that step. Each data file is one
benchmark named after its file stem. Writes ``eval.md`` and ``eval.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from megatron_armor.config import ArmorConfig, ConfigError, load_config


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="evaluate a model on benchmarks (avg@k, pass@k, maj@k)")
    p.add_argument("--model", required=True, help="HF model directory")
    p.add_argument("--data", nargs="+", default=None,
                   help="benchmark files (parquet/jsonl); default: the config's data.val_files")  # fmt: skip
    p.add_argument("--k", type=int, default=None, help="samples per problem (validation.n_samples)")
    p.add_argument("--out", default="eval_results", help="output directory for eval.md/json")
    p.add_argument("--config", default=None,
                   help="YAML config or run directory supplying defaults and model overrides")  # fmt: skip
    p.add_argument("--backend", choices=("torch", "sglang"), default=None, help="rollout backend")
    p.add_argument("--sglang-url", nargs="*", default=None, help="use running SGLang servers")
    p.add_argument("--device", default=None, help="torch backend device (default: cuda if present)")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--template", choices=("dapo", "chat", "plain"), default=None)
    p.add_argument("--max-prompt-len", type=int, default=None)
    p.add_argument("--max-problems", type=int, default=None, help="cap per benchmark (0 = all)")
    p.add_argument("--verifier", choices=("auto", "dapo", "math_verify"), default=None)
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default 0)")
    p.add_argument("--step", type=int, default=None,
                   help="sample with the seed of the run's validation at this step")  # fmt: skip
    p.add_argument("--batch", type=int, default=None, help="torch engine rows decoded together")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    p.set_defaults(run=run)


# command-line option -> the config setting it overrides (validated like a training config)
OPTION_SETTINGS = {
    "k": "validation.n_samples",
    "temperature": "validation.temperature",
    "top_p": "validation.top_p",
    "max_new_tokens": "rollout.sampling.max_new_tokens",
    "template": "data.template",
    "max_prompt_len": "data.max_prompt_len",
    "max_problems": "validation.max_problems",
    "verifier": "reward.verifier",
    "backend": "rollout.backend",
    "batch": "rollout.engine_batch_size",
}


def eval_config(args: argparse.Namespace) -> ArmorConfig:
    """``--config`` (or the defaults) with the command-line options as overrides, through the
    same validation as ``armor train``; the model directory and benchmark files are checked
    up front too (``config/inputs.py``). Raises :class:`ConfigError` naming the option."""
    from megatron_armor.config.inputs import input_problems

    overrides = ["reward.overlong.enabled=false"] + [  # evaluation scores without the penalty
        f"{key}={getattr(args, option)}"
        for option, key in OPTION_SETTINGS.items()
        if getattr(args, option) is not None
    ]
    config = load_config(config_file(args.config), overrides)
    if args.data is None:
        if not config.data.val_files:
            raise ConfigError("--data: no benchmark files given and the config has no "
                              "data.val_files; pass --data FILE...")  # fmt: skip
        args.data = list(config.data.val_files)
    if args.step is not None and args.seed is not None:
        raise ConfigError("--step and --seed both set the sampling seed; give one")
    if args.step is not None:
        known = run_steps(args.config, config)
        if args.step not in known:
            raise ConfigError(f"--step {args.step}: {steps_text(args.config, config, known)}; "
                              "pass one of those")  # fmt: skip
    problems = input_problems("--model", args.model, {"--data": args.data})
    if problems:
        raise ConfigError("; ".join(problems))
    return config


def config_file(path: str | None) -> str | None:
    """``--config``: a YAML file, or a run directory's resolved ``config.yaml``."""
    if path is not None and Path(path).is_dir():
        saved = Path(path) / "config.yaml"
        if not saved.is_file():
            raise ConfigError(f"--config {path}: a directory without config.yaml (not a run "
                              "directory); pass the run directory or a YAML config")  # fmt: skip
        return str(saved)
    return path


def run_steps(config_arg: str | None, config: ArmorConfig) -> list[int]:
    """The steps ``--step`` may name: of a run directory, those it validated or holds a
    checkpoint of; of a YAML config (or the defaults), the steps its validation runs at."""
    from megatron_armor.orchestration.step.phases import validation_due

    if config_arg is None or not Path(config_arg).is_dir():
        return [s for s in range(config.run.steps + 1) if validation_due(config, s)]
    from megatron_armor.observability.metrics import read_metrics
    from megatron_armor.orchestration.run.checkpoints import list_checkpoints

    validated = {int(r["step"]) for r in read_metrics(config_arg)
                 if any(k.startswith("val/") for k in r)}  # fmt: skip
    return sorted(validated | {step for step, _ in list_checkpoints(config_arg)})


def steps_text(config_arg: str | None, config: ArmorConfig, known: list[int]) -> str:
    """Where the steps ``--step`` may name come from, and the steps."""
    listed = ", ".join(map(str, known)) or "none"
    if config_arg is not None and Path(config_arg).is_dir():
        return (f"the run {config_arg} has neither a validation nor a checkpoint at that step; "
                f"its validated and checkpointed steps: {listed}")  # fmt: skip
    return (
        f"no validation of the run at that step (run.steps={config.run.steps}, "
        f"validation.every={config.validation.every}): the validated steps are {listed}"
    )


def sampling_seed(args: argparse.Namespace, config: ArmorConfig) -> int:
    """``--seed``, or with ``--step N`` the seed of the run's validation at step ``N``
    (``orchestration/step/phases.py: validate``), else 0."""
    if args.step is None:
        return 0 if args.seed is None else args.seed
    from megatron_armor.orchestration.step.anchor_rollout import derive_seed

    return derive_seed(config.run.seed, args.step, 0, "validation")


def eval_settings(args: argparse.Namespace, config: ArmorConfig) -> dict:
    """All effective settings (command line over config), recorded in the report."""
    v, s = config.validation, config.rollout.sampling
    return {
        "model": args.model,
        "backend": config.rollout.backend,
        "k": v.n_samples,
        "temperature": v.temperature,
        "top_p": v.top_p,
        "max_new_tokens": s.max_new_tokens,
        "template": config.data.template,
        "max_prompt_len": config.data.max_prompt_len,
        "max_problems": v.max_problems,
        "verifier": config.reward.verifier,
        "seed": sampling_seed(args, config),
        "model_overrides": dict(config.trainer.model_overrides),
    }


def load_benchmarks(files: list[str], tokenizer, template: str, max_prompt_len: int) -> dict:
    """``{file stem: PromptDataset}``; a repeated stem is an error naming both files."""
    from megatron_armor.config.benchmarks import benchmark_name
    from megatron_armor.data.dataset import load_prompt_dataset

    datasets: dict = {}
    for file in files:
        name = benchmark_name(file)
        if name in datasets:
            raise ValueError(f"--data: two files are named {name!r}; rename one (names label rows)")
        datasets[name] = load_prompt_dataset([file], tokenizer, template, max_prompt_len, name=name)
        print(datasets[name].report(), flush=True)
    return datasets


def eval_servers(sglang_engines: int, tp: int, visible_gpus: int) -> int:
    """SGLang servers of an evaluation: ``rollout.sglang.num_engines`` when set, else one per
    ``tp`` of the GPUs this process sees (``eval.sbatch --gpus-per-node=8`` at tp 1: 8); at
    least one. An explicit count needing more GPUs than are visible is refused, naming both."""
    tp = max(tp, 1)
    if sglang_engines > 0:
        if visible_gpus and sglang_engines * tp > visible_gpus:
            raise ConfigError(
                f"rollout.sglang.num_engines={sglang_engines} x tp {tp} needs "
                f"{sglang_engines * tp} GPUs but {visible_gpus} are visible here; lower it or "
                "set it to 0 (one server per tp GPUs)"
            )
        return sglang_engines
    return max(visible_gpus // tp, 1)


def servers_to_start(args: argparse.Namespace, config: ArmorConfig) -> int:
    """How many SGLang servers ``armor eval`` starts (0: none, another backend or
    ``--sglang-url``): :func:`eval_servers` of the GPUs visible here."""
    if config.rollout.backend != "sglang" or args.sglang_url:
        return 0
    import torch

    sg = config.rollout.sglang
    return eval_servers(sg.num_engines, sg.tp, torch.cuda.device_count())


def make_engine(settings: dict, args: argparse.Namespace, config: ArmorConfig, servers: int):
    """The rollout engine named by ``settings['backend']`` (``servers``: SGLang servers to
    start, :func:`servers_to_start`)."""
    if settings["backend"] == "sglang":
        from megatron_armor.config.sglang_pools import policy_pool
        from megatron_armor.rollout.sglang.engine import SGLangEngine

        sg = config.rollout.sglang
        pool = policy_pool(sg, servers) if servers else None
        engine = SGLangEngine(args.model, sg, urls=args.sglang_url or None, pool=pool,
                              model_overrides=dict(config.trainer.model_overrides))  # fmt: skip
        if not args.sglang_url:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            engine.launch(colocated=False, log_dir=args.out)
        return engine
    import torch

    from megatron_armor.rollout.torch_engine import TorchEngine

    if args.threads > 0:
        torch.set_num_threads(args.threads)

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    return TorchEngine(
        args.model,
        device=device,
        dtype=dtype,
        max_batch=config.rollout.engine_batch_size,
        model_overrides=dict(config.trainer.model_overrides),
    )


def run(args: argparse.Namespace) -> int:
    from megatron_armor.evaluation.report import markdown_table, write_report
    from megatron_armor.evaluation.runner import evaluate
    from megatron_armor.orchestration.actors.workers import load_model_tokenizer
    from megatron_armor.reward.scorer import RewardScorer
    from megatron_armor.rollout.protocol import SamplingParams

    try:
        config = eval_config(args)
        servers = servers_to_start(args, config)
    except ConfigError as e:
        print(f"armor eval: {e}", file=sys.stderr)
        return 2
    settings = eval_settings(args, config)
    tokenizer = load_model_tokenizer(args.model)
    datasets = load_benchmarks(
        args.data, tokenizer, settings["template"], settings["max_prompt_len"]
    )
    params = SamplingParams(
        temperature=settings["temperature"],
        top_p=settings["top_p"],
        max_new_tokens=settings["max_new_tokens"],
        seed=settings["seed"],
    )
    engine = make_engine(settings, args, config, servers)
    scorer = RewardScorer(
        verifier=settings["verifier"],
        timeout_s=config.reward.timeout_s,
        num_workers=config.reward.num_workers,
        overlong_enabled=False,
    )
    start = time.perf_counter()
    try:
        results = evaluate(
            engine, datasets, scorer, settings["k"], params, settings["max_problems"],
            tokenizer=tokenizer,
            on_benchmark=lambda b, r: print(f"{b}: {r}", flush=True),
        )  # fmt: skip
    finally:
        scorer.close()
        close = getattr(engine, "close", None)
        if close is not None:
            close()
    settings["seconds"] = round(time.perf_counter() - start, 1)
    md, js = write_report(results, args.out, settings["k"], settings)
    print(markdown_table(results, settings["k"]), end="")
    print(f"wrote {md} and {js}")
    return 0
