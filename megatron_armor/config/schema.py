"""The typed config tree: dataclasses are the schema (OmegaConf structured configs).

Every field has a docstring under it. YAML files store runs (``configs/``); dotted overrides
on the command line (``algo.alpha=0.875``). Single-field checks live in ``fields.py``
(one validator per section), cross-field checks in ``validate.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Union

from megatron_armor.config.names import Names
from megatron_armor.config.resolve import Resolved, resolve

WeightTransport = Annotated[str, Names("tensor", "distributed", "disk")]
Precision = Annotated[str, Names("bf16", "fp16", "fp32")]
TransformerImpl = Annotated[str, Names("local", "te")]
LrUnit = Annotated[str, Names("rl_steps", "updates")]
LrDecayStyle = Annotated[str, Names("constant", "linear", "cosine")]
BestMode = Annotated[str, Names("max", "min")]
Fp8Format = Annotated[str, Names("e4m3", "hybrid")]
Fp8Recipe = Annotated[str, Names("delayed", "tensorwise", "mxfp8", "blockwise")]
Template = Annotated[str, Names("dapo", "chat", "plain")]
Verifier = Annotated[str, Names("auto", "dapo", "math_verify")]
Layout = Annotated[str, Names("cpu", "colocated", "disaggregated")]
AsyncRollout = Annotated[str, Names("off", "one_step", "bounded")]
RoutingReplay = Annotated[str, Names("off", "r2", "r3")]
AnchorRoutes = Annotated[str, Names("own", "reference", "free")]
Profiler = Annotated[str, Names("none", "nsys", "torch", "dlprof")]
WandbMode = Annotated[str, Names("online", "offline")]


@dataclass
class ResetConfig:
    """Reference reset schedule (docs/algorithm.md, reference reset)."""

    schedule: str = "none"
    """``none`` | ``every`` | ``every-until`` | ``log2``."""
    every: int = 0
    """``tau``: reset every this many steps (``every``, ``every-until``)."""
    until: int = 0
    """Last step at which a reset may happen (``every-until``); frozen afterwards."""


@dataclass
class QuatroConfig:
    """``algo.advantage: quatro``: the per-query KL trust region (docs/algorithm.md)."""

    delta: float = 0.1
    """Trust-region radius: ``KL(pi* || pi_old) <= delta`` per query over its sampled responses."""
    lambda_min: float = 1.0e-3
    """Lower clamp of the multiplier ``lambda`` (where the constraint does not bind)."""
    lambda_max: float = 1.0e4
    """Upper clamp of ``lambda``."""


@dataclass
class RolloutCorrectionConfig:
    """Weights for the engine/trainer mismatch (docs/algorithm.md, rollout correction)."""

    mode: str = "none"
    """``none`` | ``token_tis`` | ``seq_tis`` | ``token_mask`` | ``seq_mask`` | ``icepop``."""
    cap: float = 2.0
    """``C`` of ``token_tis`` / ``seq_tis``: ``w = min(rho, C)``."""
    low: float = 0.5
    """``lo`` of ``token_mask`` / ``seq_mask`` / ``icepop``: a ratio below it gets weight 0."""
    high: float = 2.0
    """``hi`` of ``token_mask`` / ``seq_mask`` / ``icepop``: a ratio above it gets weight 0."""
    seq_ratio: str = "product"
    """The sequence ratio of ``seq_tis`` / ``seq_mask``: ``product`` | ``geometric``."""


@dataclass
class AlgoConfig:
    """ARMOR / DAPO algorithm switches (docs/algorithm.md)."""

    anchor: str = "armor"
    """``none`` (DAPO dynamic sampling) | ``armor`` | ``filter_only`` (referee's control)."""
    weak_filter: bool = False
    """Keep all-wrong on-policy groups when the reference solved the query."""
    anchor_source: str = "generate"
    """``generate`` (fresh reference samples each step) | ``cache`` (once per reference period)."""
    group_size: int = 16
    """``G``: samples per query in the trained group (on-policy + anchor)."""
    ref_n: int = 4
    """Reference samples per query drawn to find an anchor."""
    alpha: Any = "auto"
    """Mixing coefficient in (0, 1], or ``auto`` = n_on / (n_on + 1)."""
    ratio: str = "mixed"
    """``standard`` | ``mixed`` | ``off_policy`` | ``static_expansion`` (docs/algorithm.md, mixed optimization)."""
    advantage: str = "grpo"
    """``grpo`` (group mean/std) | ``qae`` (quantile baseline) | ``quatro`` (trust-region duals)."""
    qae_quantile: float = 0.45
    """``k`` for the QAE quantile baseline."""
    quatro: QuatroConfig = field(default_factory=QuatroConfig)
    """Hyperparameters of ``advantage: quatro``."""
    advantage_args: dict[str, Any] = field(default_factory=dict)
    """Hyperparameters of the ``algo.advantage`` estimator, ``{name: value}``, for estimators
    without fields of their own above; checked against the estimator's own parameters
    (docs/architecture.md, where to add X)."""
    filter_policy_samples: str = "G"
    """``filter_only`` on-policy samples per query: ``G`` (DAPO's group) | ``G-1`` (ARMOR's
    ``n_on``: rule (a) over the same samples as ARMOR, the same generation compute)."""
    clip_low: float = 0.2
    """``eps_low``: lower PPO clip."""
    clip_high: float = 0.28
    """``eps_high``: upper PPO clip (DAPO clip-higher)."""
    dual_clip_c: float = 10.0
    """Dual-clip constant ``c`` (> 1) for negative advantages."""
    log_ratio_clamp: float = 20.0
    """Clamp on the log of the mixed ratio."""
    loss_agg: str = "token-mean"
    """``token-mean`` | ``seq-mean-token-mean`` | ``seq-mean-token-sum``."""
    kl_coef: float = 0.0
    """``beta`` for the optional KL(pi_theta || pi_ref) penalty (0 = off; not part of ARMOR)."""
    kl_estimator: str = "k3"
    """``k1`` | ``k2`` | ``k3`` estimator for the KL penalty."""
    max_gen_batches: int = 10
    """Generation batches tried per step before the step is short (``on_short_batch``)."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Correction of the gap between the engine's and the trainer's log-probs (default off)."""
    on_short_batch: str = "train_partial"
    """When ``max_gen_batches`` batches accepted fewer than ``rollout.batch`` queries:
    ``train_partial`` (train on the accepted groups if they are at least
    ``min_batch_fraction`` of the batch, ``anchor/short_batch``; fewer: the step fails) |
    ``error`` (the step fails, as DAPO's dynamic sampling does; strict reproduction)."""
    min_batch_fraction: float = 0.5
    """``train_partial``'s floor: the fewest accepted queries a step trains on, as a fraction
    of ``rollout.batch`` (rounded up); 0: no floor, a step trains on what it accepted and makes
    no update when that is nothing (docs/algorithm.md, "Short batches")."""
    reset: ResetConfig = field(default_factory=ResetConfig)
    """Reference reset schedule."""


@dataclass
class SamplingConfig:
    """Sampling settings shared by the policy and the reference."""

    temperature: float = 1.0
    """Sampling temperature (the trainer computes log-probs at the same temperature)."""
    top_p: float = 1.0
    """Nucleus sampling threshold in (0, 1]."""
    top_k: int = -1
    """Top-k sampling (-1 = off)."""
    max_new_tokens: int = 64
    """Maximum response length in tokens."""


@dataclass
class SGLangRefPoolConfig:
    """The reference servers of ``rollout.ref_strategy: dedicated`` (and of the ``cache``
    strategy's misses): a second SGLang pool that keeps ``theta_ref`` and is synced only at
    start-up, resume and a reference reset."""

    num_engines: int = 0
    """Reference servers (0 = as many as the policy pool)."""
    tp: int = 0
    """GPUs per reference server (0 = ``rollout.sglang.tp``)."""
    mem_fraction: float = 0.0
    """Share of each GPU's memory that a reference server claims (weights + KV cache); 0 =
    0.2 colocated, ``rollout.sglang.mem_fraction_static`` disaggregated. Colocated, the servers
    sit on the policy servers' GPUs and their ``--mem-fraction-static`` is derived from this
    share (SGLang reads its fraction against the memory free when it starts)."""
    base_port: int = 31000
    """First HTTP port; reference server ``i`` listens on ``base_port + i``."""
    router_port: int = 29100
    """Router port of the reference pool (``rollout.sglang.router: true``)."""


@dataclass
class SGLangConfig:
    """SGLang server pool (GPU clusters only)."""

    tp: int = 1
    """GPUs per SGLang engine (``--tp-size``)."""
    num_engines: int = 0
    """Number of SGLang server processes (0 = fill the rollout GPUs: ``trainer.world_size / tp``
    colocated, ``orchestration.rollout_gpus / tp`` disaggregated, minus the reference pool's)."""
    mem_fraction_static: float = 0.7
    """``--mem-fraction-static``."""
    base_port: int = 30000
    """First HTTP port; engine ``i`` listens on ``base_port + i``."""
    router: bool = True
    """Put ``sglang-router`` in front of the engines."""
    router_port: int = 29000
    """Router HTTP port."""
    startup_timeout_s: float = 600.0
    """Seconds to wait for ``/health_generate`` after launch."""
    request_timeout_s: float = 3600.0
    """Per-request timeout."""
    max_concurrency: int = 512
    """Concurrent in-flight ``/generate`` requests per client."""
    max_retries: int = 3
    """Retries (with backoff) per request on connection errors."""
    weight_transport: WeightTransport = "tensor"
    """How the trainer ranks push weights: ``tensor`` (colocated, CUDA IPC), ``distributed``
    (NCCL broadcast), ``disk``."""
    weight_bucket_mb: int = 512
    """Bucket size of a weight push (MB): the most GPU (or host, for ``disk``) memory one
    push holds at a time besides the model."""
    context_length: int = 0
    """``--context-length`` of the servers (0 = the model's ``max_position_embeddings``, after
    ``trainer.model_overrides``); must hold ``data.max_prompt_len + max_new_tokens``."""
    extra_args: dict[str, Any] = field(default_factory=dict)
    """Extra ``sglang.launch_server`` arguments (validated against SGLang's ``ServerArgs``)."""
    server_module: str = "sglang.launch_server"
    """Module started as ``python -m MODULE`` with the ``ServerArgs`` flags: a site's wrapper or
    patched SGLang build may take its place."""
    ref_pool: SGLangRefPoolConfig = field(default_factory=SGLangRefPoolConfig)
    """The reference pool (``rollout.ref_strategy: dedicated`` or a ``cache`` filled by it)."""
    health_check_every: int = 1
    """Steps between health checks of the servers (0 = never): a dead server is restarted and
    gets the current weights before it serves again."""


@dataclass
class RolloutConfig:
    """Generation: batch sizes, sampling, engine backend, reference serving."""

    backend: str = "torch"
    """``torch`` (embedded engine, CPU default) | ``sglang``."""
    batch: int = 8
    """``B``: accepted queries per training step."""
    gen_batch: int = 24
    """Queries per generation batch (``k * B``); must be >= ``batch``."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Training-time sampling settings."""
    ref_strategy: str = "swap"
    """How the reference is served: ``swap`` | ``dedicated`` | ``cache``."""
    engine_batch_size: int = 64
    """Sequences decoded together by the embedded engine."""
    reference_parts: int = 1
    """Parts of a generation batch whose reference samples are drawn separately, each as soon
    as its policy samples are scored, overlapping the scoring of the others (1 = one call)."""
    reference_first: Union[bool, str] = "auto"  # noqa: UP007 (OmegaConf reads typing.Union)
    """``true``: draw a generation batch's reference samples first and policy samples only for
    the queries with a correct one (rule (b) rejects the others whatever their policy
    samples); reference samples are then drawn for queries rule (a) rejects too. Fewer tokens
    when rule (b) rejects more than ``ref_n / n_on`` times as many queries as rule (a)
    (docs/algorithm.md); needs ``algo.anchor`` armor or filter_only and ``reference_parts: 1``.
    ``false``: policy samples first. ``auto``: each step the order that rule picks from the
    rejection shares of the step before (policy first at the first step, and always where
    ``true`` does not apply). Same rules, same distribution of groups in every order."""
    prefetch_reference: bool = True
    """When the next step will draw the reference first, send its first generation batch's
    reference call while the trainer works on this step (the same queries, seed and
    reference weights, so the same samples; not before a reference reset, with the anchor
    cache, ``colocated`` or a reference swapped into the policy servers by the driver).
    ``false``: every reference call in its own step's rollout."""
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    """SGLang settings (``backend: sglang``)."""


@dataclass
class FP8Config:
    """Transformer Engine FP8 settings (mapped onto megatron-core ``TransformerConfig``)."""

    enabled: bool = False
    """Train in FP8 (needs Transformer Engine)."""
    format: Fp8Format = "hybrid"
    """Transformer Engine's FP8 format."""
    recipe: Fp8Recipe = "delayed"
    """Transformer Engine's FP8 scaling recipe (``mxfp8``: Blackwell only)."""
    margin: int = 0
    """Scaling-factor margin."""
    amax_history_len: int = 1024
    """Amax history length (delayed scaling)."""
    amax_compute_algo: str = "max"
    """``max`` | ``most_recent``."""


@dataclass
class MoEConfig:
    """Mixture-of-experts training settings (read only for a model with experts, e.g.
    Qwen3-MoE; docs/trainer.md, "Mixture of experts")."""

    aux_loss_coeff: float = 0.0
    """Weight of the load-balancing (Switch) loss added to the policy loss, logged apart as
    ``train/moe_aux_loss``; 0 = off, as the Qwen3-MoE RL recipes run (slime's
    ``--moe-aux-loss-coeff 0``; pre-training uses about 1e-3)."""
    routing_replay: RoutingReplay = "off"
    """Which experts the trainer's passes use (docs/trainer.md,
    "Routing replay"). ``off``: each pass routes with its own weights; ``r2``: the updates
    replay the routes of the step's ``old`` pass; ``r3``: the ``old`` pass replays the routes
    of the engine that drew each sample (the rollout asks engines for them) and the updates
    replay those. Off by default as in verl and slime; ignored for a dense model."""
    anchor_routes: AnchorRoutes = "own"
    """Routes of the policy passes on an anchor (drawn by the reference engine) under
    ``r2`` / ``r3`` (docs/algorithm.md, "Mixture-of-experts policies"): ``own``
    (the ``old`` pass routes with its weights, the updates replay it; the reference pass
    replays the reference engine's routes), ``reference`` (every pass replays the reference
    engine's routes), ``free`` (no replay on anchors)."""


@dataclass
class TrainerConfig:
    """The Megatron-core trainer: model, parallel layout, precision, optimizer."""

    model_path: str = ""
    """HF-format model directory (config.json + safetensors) to start from."""
    model_overrides: dict[str, Any] = field(default_factory=dict)
    """Entries that replace those of the model's ``config.json`` for the trainer's model and
    for the SGLang servers (``--json-model-override-args``), e.g. ``{max_position_embeddings:
    16384, rope_theta: 40000}`` to run a model whose stock context is shorter than prompt +
    response (docs/weight-sync.md, "Context length")."""
    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    cp: int = 1
    """Context-parallel size."""
    vpp: int = 1
    """Virtual pipeline stages per rank (1 = off)."""
    ep: int = 1
    """Expert-parallel size: the experts of each MoE layer are split over ``ep`` ranks
    (``num_experts % ep == 0``, ``world_size % (etp * ep * pp) == 0``); 1 for a dense model."""
    etp: Union[int, str] = "auto"  # noqa: UP007 (OmegaConf reads typing.Union)
    """Expert tensor-parallel size: each expert's weights are split over ``etp`` ranks
    (``moe_intermediate_size % etp == 0``), apart from ``tp`` (megatron-core's
    ``expert_tensor_parallel_size``). ``auto``: 1 with ``ep > 1``, as the Qwen3-MoE recipes
    run (an expert is small, 768 wide in Qwen3-30B-A3B: splitting it only adds collectives),
    ``tp`` with ``ep = 1`` (megatron-core reduces the experts' gradients right at ``ep = 1``
    only when ``etp = tp``; ``config/moe.py``)."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Mixture-of-experts settings."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs tp > 1)."""
    world_size: Union[int, str] = "auto"  # noqa: UP007 (OmegaConf reads typing.Union)
    """Trainer ranks in total (tp * pp * cp * dp). ``auto``: every GPU of the job
    (``orchestration.nodes * gpus_per_node``) colocated, those besides
    ``orchestration.rollout_gpus`` disaggregated, one rank per node in the ``cpu`` layout
    (``config/world_size.py``)."""
    allow_idle_gpus: bool = False
    """Accept a ``world_size`` that leaves GPUs of the job idle (refused at load otherwise:
    a size copied from a one-node config would train a multi-node job on one node)."""
    precision: Precision = "bf16"
    """The trainer's parameter and compute precision."""
    transformer_impl: TransformerImpl = "local"
    """``local`` (megatron-core local spec, CPU path) or ``te`` (Transformer Engine)."""
    fp8: FP8Config = field(default_factory=FP8Config)
    """FP8 settings."""
    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Floor of the LR schedule."""
    lr_unit: LrUnit = "rl_steps"
    """What ``warmup_steps`` and ``lr_decay_steps`` count: ``rl_steps`` (the LR moves once per RL
    step, as the paper's verl-based code steps its scheduler; every update of a step uses the
    same LR) | ``updates`` (once per optimizer update, ``batch / ppo_mini_batch`` per step)."""
    warmup_steps: int = 10
    """Linear warm-up from 0 over this many ``lr_unit``; the paper: 10 RL steps."""
    lr_decay_style: LrDecayStyle = "constant"
    """After the warm-up: ``constant`` (the paper), or a ``linear`` or ``cosine`` decay to
    ``min_lr``."""
    lr_decay_steps: int = 0
    """End of the decay in ``lr_unit`` (``linear``/``cosine``; must exceed ``warmup_steps``)."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon (> 0: it keeps the update of a parameter without gradient finite)."""
    grad_clip: float = 1.0
    """Global grad-norm clip (0 = off)."""
    max_skipped_updates: int = 10
    """Updates in a row skipped for a non-finite loss or gradient norm after which the run
    stops with a checkpoint and exit 65, not requeued (docs/trainer.md, non-finite guard)."""
    ppo_mini_batch: int = 4
    """Queries per optimizer update; ``batch / ppo_mini_batch`` updates per step."""
    micro_batch_tokens: int = 4096
    """Token budget of one packed micro-batch."""
    use_distributed_optimizer: bool = False
    """megatron-core distributed optimizer (ZeRO-1 over DP)."""
    recompute: bool = False
    """Full activation recomputation."""
    logprob_chunk: int = 1024
    """Sequence chunk for the vocab-parallel log-prob computation."""
    offload_train_state: bool = False
    """Colocated: move the optimizer state to CPU and free the gradient buffers after each
    weight sync, while the engines generate; restored before the next update."""
    concurrent_reference: Union[bool, str] = "auto"  # noqa: UP007 (OmegaConf reads typing.Union)
    """CPU ranks: run the reference log-prob pass on a second thread beside the policy pass,
    through a second model instance whose parameters are the stored reference copy (no copy,
    no swap; the same values bit for bit). ``auto``: on in the ``cpu`` layout with one trainer
    rank, whose node's rollout engine is idle while the trainer works; ``true`` needs the
    ``cpu`` layout and ``tp = pp = cp = 1`` (no collectives in the forward pass);
    ``false``: one pass after the other (docs/trainer.md)."""


@dataclass
class DataConfig:
    """Training and validation data."""

    train_files: list[str] = field(default_factory=list)
    """Local parquet/jsonl files (or hub names where a network exists) in the DAPO-Math schema."""
    val_files: list[str] = field(default_factory=list)
    """Validation benchmarks (DAPO-Math schema or problem/answer schema)."""
    template: Template = "dapo"
    """Prompt template (docs/data_reward.md)."""
    max_prompt_len: int = 256
    """Prompts longer than this (tokens) are dropped and counted."""
    shuffle: bool = True
    """Shuffle each epoch (deterministic from ``run.seed``)."""
    dedupe: bool = False
    """Drop training rows whose rendered prompt and answer repeat an earlier row's: the hub's
    DAPO-Math-17k holds each problem about 100 times (``armor data`` writes it deduplicated)."""
    train_limit: int = 0
    """Train on the first N prompts of ``train_files`` only (0 = all): a small training set
    that many epochs over-fit (the tiny pipeline's stage 1)."""
    retire_solved_after: int = 0
    """``K``: a prompt whose on-policy samples were all correct ``K`` draws in a row leaves
    the sampler for the rest of the run (``data/retired``; 0 = never; docs/data_reward.md)."""
    retire_max_fraction: float = 0.5
    """The largest share of the training prompts retirement takes out: the rest stays drawn,
    solved or not (a run left with a few hard prompts over-fits them, docs/benchmarks.md)."""


@dataclass
class OverlongConfig:
    """DAPO overlong penalty (docs/data_reward.md)."""

    enabled: bool = True
    """Apply the penalty."""
    buffer: int = 16
    """Penalty ramps over the last ``buffer`` tokens before ``max_new_tokens``."""
    factor: float = 1.0
    """Penalty factor."""


@dataclass
class RewardConfig:
    """Verifiers and scoring workers."""

    verifier: Verifier = "auto"
    """The verifier of every sample, or ``auto``: one per ``data_source``."""
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    """Overlong penalty."""
    timeout_s: float = 5.0
    """Per-answer verification timeout; a timeout scores as wrong and is counted."""
    num_workers: int = 2
    """Processes in the scoring pool."""


@dataclass
class ValidationConfig:
    """In-training validation."""

    every: int = 0
    """Validate every N steps (0 = off); also before the first step when > 0."""
    n_samples: int = 4
    """``k`` samples per problem (avg@k, pass@k, maj@k)."""
    temperature: float = 1.0
    """Validation temperature."""
    top_p: float = 0.7
    """Validation top-p."""
    max_problems: int = 0
    """Cap on problems per benchmark (0 = all)."""


@dataclass
class OrchestrationConfig:
    """Ray placement and the run's cadence."""

    layout: Layout = "cpu"
    """Where the trainer and the engines run (docs/architecture.md, ``placement.py``)."""
    nodes: int = 1
    """Nodes of the job (its Ray cluster); ``slurm/armor.sbatch`` passes the allocation's."""
    gpus_per_node: int = 8
    """GPUs per node; ``slurm/armor.sbatch`` passes the job's (``ARMOR_RAY_NUM_GPUS`` or
    ``SLURM_GPUS_ON_NODE``)."""
    gpu_memory_gib: float = 80.0
    """Memory of one GPU (80 for an H100, 141 for an H200): ``armor train`` refuses a colocated
    layout whose memory plan does not fit it, and ``armor plan`` plans for it by default
    (docs/profiling.md, "Memory model")."""
    rollout_gpus: int = 0
    """GPUs for rollout engines in the disaggregated layout."""
    num_reward_workers: int = 1
    """Ray reward actors."""
    ray_address: str = ""
    """Existing Ray cluster address ("" = start a local one)."""
    ray_init_timeout_s: float = 120.0
    """Seconds to wait for Ray and the actors to come up."""
    call_deadline_multiple: float = 10.0
    """A call's deadline is this many times the ``call_deadline_quantile`` of its kind's recent
    durations per unit of work, times the work it was given (docs/orchestration.md, "Stuck
    calls"); a call whose actor shows progress (a heartbeat) is never cut off."""
    call_deadline_quantile: float = 0.9
    """The quantile of a call kind's recent durations the deadline multiplies."""
    call_deadline_floor_s: float = 30.0
    """No learned deadline is shorter (a loaded machine's jitter on sub-second calls)."""
    call_deadline_cap_s: float = 3600.0
    """No deadline is longer, and a kind's first call waits this long (the environment's
    ``ARMOR_CALL_TIMEOUT_S``, when set, caps it too)."""
    stop_wait_s: float = 60.0
    """After SIGTERM/SIGINT/SIGUSR1, seconds a call may still take before the run stops
    without it (exit 75 on the newest complete checkpoint); keep it under Slurm's signal
    lead (``slurm/armor.sbatch``: 120 s) less ``shutdown_timeout_s``."""
    shutdown_timeout_s: float = 30.0
    """Seconds the end of a run takes at most: the actors close and Ray stops within them,
    then every process of the run still alive is killed."""
    threads_per_actor: int = 0
    """Torch CPU threads of each trainer rank, rollout worker and reward worker; 0 = the
    node's cores divided by the actors placed on it (never more threads than cores,
    ``placement.threads_per_actor``)."""
    async_rollout: AsyncRollout = "off"
    """``one_step``: the rollout of step t+1 runs while the trainer updates on step t, on the
    weights of step t-1 (policy samples at most one version old; the ``old`` pass uses those
    weights, kept on the trainer); a step that resets the reference drains the pipeline
    (docs/orchestration.md, "Asynchronous rollout"). ``bounded``: generation runs ahead of
    training by up to ``max_staleness`` weight versions, with partial rollouts, trained with
    the decoupled objective (docs/orchestration.md, "Bounded staleness"; docs/algorithm.md).
    Both need rollout workers on devices of their own: ``disaggregated``, or ``cpu`` with a
    core each."""
    max_staleness: int = 2
    """``bounded``: the most weight versions a trained policy token may be behind the
    trainer's (``k >= 1``); older groups are dropped."""
    partial_rollout: bool = True
    """``bounded``: a request decodes at most ``ceil(rollout.sampling.max_new_tokens /
    max_staleness)`` tokens per weight version and goes on under the next from the tokens it
    has; ``false``: every response is drawn whole on one version."""


@dataclass
class LoggingConfig:
    """Metrics, progress and profiling."""

    tensorboard: bool = True
    """Write TensorBoard event files."""
    wandb: bool = False
    """Log to Weights & Biases (needs ``wandb``: ``requirements-wandb.txt``, in the image); one
    W&B run per run directory, continued across requeues (its id: ``RUN_DIR/wandb_run_id``)."""
    wandb_project: str = "megatron_armor"
    """W&B project."""
    wandb_entity: str = ""
    """W&B entity (team or user); "" = the API key's default entity."""
    wandb_group: str = ""
    """W&B group (e.g. the seeds of one variant); "" = none."""
    wandb_mode: WandbMode = "online"
    """``offline`` for nodes without network (``wandb sync RUN_DIR/wandb/offline-run-*``
    later, from a machine with network)."""
    progress: bool = True
    """Progress bars for rollout and training phases."""
    profile: Profiler = "none"
    """The step profiler (docs/profiling.md), or ``none``."""
    profile_steps: list[int] = field(default_factory=list)
    """Steps to capture with the profiler."""
    profile_ranks: list[int] = field(default_factory=lambda: [0])
    """Trainer ranks that write torch.profiler traces."""
    exact_kl_every: int = 0
    """Steps between exact vocabulary-wide KL diagnostics (``kl/exact_*``, the paper's Fig. 2
    view; two extra forward passes over a few samples); 0 = off."""
    exact_kl_samples: int = 4
    """On-policy samples per diagnostic (evenly spaced over the step's batch)."""
    exact_kl_positions: int = 32
    """Response positions per sample (evenly spaced along the response)."""


@dataclass
class KeepBestConfig:
    """The best checkpoint by a metric, kept outside the ``keep_last`` rotation."""

    metric: str = ""
    """A logged metric (``val/aime24/avg@32``) or a ``*`` pattern averaged over the matching
    keys (``val/*/avg@32``: the mean over benchmarks); ``@k`` stands for
    ``@<validation.n_samples>``; "" = off."""
    mode: BestMode = "max"
    """Which direction of the metric is better."""


@dataclass
class OveroptConfig:
    """Over-optimization detector (``observability/overopt.py``): validation stops improving
    for ``patience`` validations while the training reward keeps rising (arXiv 2607.10481 §1,
    §5.1); the KL to the start model is logged as a secondary signal."""

    enabled: bool = False
    """Run the detector and log ``overopt/*``."""
    val_metric: str = "val/*/avg@k"
    """Validation metric (or ``*`` pattern, averaged; ``@k`` = ``@<validation.n_samples>``)
    that must keep improving."""
    reward_metric: str = "reward/policy_mean"
    """Training reward (every step)."""
    kl_metric: str = "kl/exact_reverse"
    """KL to the start model (the reference while it is never reset)."""
    patience: int = 3
    """Validations without a new best (by more than ``min_delta``) before it can fire."""
    min_delta: float = 0.0
    """A validation counts as an improvement only above ``best + min_delta``."""
    reward_window: int = 10
    """The reward trend is fitted from this many steps before the best validation to now."""
    min_reward_rise: float = 0.0
    """The least-squares line through those rewards must rise by more than this over the span
    (``overopt/reward_rise``)."""
    min_kl_growth: float = -1.0
    """Also require the same fitted rise of ``kl_metric`` above this (< 0: logged only)."""
    stop: bool = True
    """Checkpoint and end the run when it fires (``armor pipeline`` then starts stage 2)."""


@dataclass
class WatchConfig:
    """Warnings of a long run (``observability/health.py``, docs/troubleshooting.md): acceptance
    falling toward the error, host memory growing, the run directory outgrowing its disk."""

    window: int = 100
    """Steps the acceptance and host-memory trends are fitted over (least squares)."""
    memory_growth_gb: float = 1.0
    """Warn while the run's host RSS (``mem/run_gb``) grows faster than this many GB per 100
    steps."""
    repeat_every: int = 100
    """Steps between console repeats of a warning that stays on (its metric: every step)."""


@dataclass
class RunConfig:
    """Run identity, length and checkpointing."""

    name: str = "armor"
    """Run name (directory under ``output_dir``)."""
    output_dir: str = "runs"
    """Parent directory of run directories."""
    seed: int = 1
    """Global seed (data order, sampling, init)."""
    steps: int = 10
    """Training steps (each: rollout + ``batch/ppo_mini_batch`` updates)."""
    ckpt_every: int = 5
    """Checkpoint every N steps (and on SIGTERM/SIGUSR1)."""
    keep_last: int = 2
    """Complete checkpoints to keep."""
    keep_best: KeepBestConfig = field(default_factory=KeepBestConfig)
    """Also keep the best checkpoint by a metric (checkpointed at every new best)."""
    resume: str = "auto"
    """``auto`` (newest complete checkpoint in the run dir) | ``none`` | a checkpoint path."""
    max_recoveries: int = 3
    """Rollout or reward workers that died and were replaced in the run, at most, within
    ``recovery_window`` steps; one more stops the run (exit 69). 0: a dead worker stops the run
    for a requeue (exit 75) at once."""
    recovery_window: int = 50
    """Steps over which ``max_recoveries`` are counted."""


@dataclass
class ArmorConfig:
    """Root of the config tree."""

    run: RunConfig = field(default_factory=RunConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    orchestration: OrchestrationConfig = field(default_factory=OrchestrationConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    overopt: OveroptConfig = field(default_factory=OveroptConfig)
    watch: WatchConfig = field(default_factory=WatchConfig)

    @property
    def resolved(self) -> Resolved:
        """Every ``auto`` of this config decided (``config/resolve.py``): what the code reads
        instead of those settings."""
        return resolve(self)
