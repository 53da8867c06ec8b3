"""``MegatronTrainer``: one megatron-core policy rank behind :class:`TrainerInterface`.

Construction starts torch.distributed and megatron's parallel groups (``parallel.py``), builds
this rank's ``GPTModel`` stage from ``trainer.model_path`` (``model.py``), loads its slices of
the HF weights (``hf_weights.py``), wraps it in megatron DDP with the megatron optimizer and a
LR schedule counted in RL steps or updates (``optim.py``) and stores the reference copy
(``weight_store.py``). Every method is collective over all trainer ranks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent import futures

import torch
import torch.distributed as dist

from megatron_armor.algo.losses import LossSettings, finalize_metrics
from megatron_armor.config.moe import expert_groups_span_dp
from megatron_armor.config.schema import ArmorConfig
from megatron_armor.config.validate import updates_per_step, validate_runtime
from megatron_armor.trainer import checkpoint, parallel, routing_replay
from megatron_armor.trainer.batching import (
    filler_micro_batch,
    holding_counts,
    plan_micro_batches,
    split_minibatches,
    token_multiple,
    with_samples,
)
from megatron_armor.trainer.cpu_compat import enable_cpu_mode
from megatron_armor.trainer.hf_weights import (
    export_hf_weights,
    load_hf_weights,
    require_finite,
    unwrap,
)
from megatron_armor.trainer.interface import TrainerInterface
from megatron_armor.trainer.model import build_model, read_hf_spec
from megatron_armor.trainer.moe import aux_loss_metrics, scale_aux_loss
from megatron_armor.trainer.offload import TrainStateOffloader, return_cached_blocks
from megatron_armor.trainer.optim import (
    advance_lr_schedule,
    build_optimizer,
    guarded_step,
    wrap_ddp,
)
from megatron_armor.trainer.reference_model import concurrent_reference
from megatron_armor.trainer.schedule import (
    LogprobSettings,
    capture_builder,
    exact_kl_builder,
    exact_kl_sums,
    global_units,
    kl_selection,
    logprob_builder,
    logprob_kl_builder,
    padding_fraction,
    policy_loss_builder,
    reduce_metric_sums,
    run_schedule,
)
from megatron_armor.trainer.weight_store import BEHAVIOR, WeightStore
from megatron_armor.types import ROUTES_KEY, has_route

AGREE_NAMES = ("moe/route_agree_policy", "moe/route_agree_anchor")
"""The routing agreement of a step's log-prob passes, per source (docs/metrics.md)."""
UPDATE_AGREE_NAMES = ("moe/route_agree_update", "moe/route_agree_update_anchor")


def exact_kl_means(sums: dict[str, float]) -> dict[str, float]:
    """``kl/exact_*`` sums over the diagnostic's positions -> means (maxima stay maxima)."""
    count = sums.pop("kl/exact_positions", 0.0)
    out = {"kl/exact_positions": count}
    for key, value in sums.items():
        out[key] = value if key.endswith("_max") else value / max(count, 1.0)
    return out


class MegatronTrainer(TrainerInterface):
    """A megatron-core policy trainer rank (see module docstring)."""

    def __init__(
        self,
        config: ArmorConfig,
        rank: int = 0,
        world_size: int = 1,
        master_addr: str = "127.0.0.1",
        master_port: int = 29500,
    ):
        t = config.trainer
        validate_runtime(config)  # the rest of the config was checked at load
        layout = parallel.ParallelLayout(
            tp=t.tp, pp=t.pp, cp=t.cp, vpp=t.vpp, ep=t.ep, etp=config.resolved.etp
        )
        parallel.init_parallel(layout, rank, world_size, master_addr, master_port, config.run.seed)
        self.config = config
        self.spec = read_hf_spec(t.model_path, dict(t.model_overrides))
        model = build_model(self.spec, t)
        load_hf_weights(model, t.model_path, self.spec)
        self.model = wrap_ddp(model, t)
        self.optimizer, self.scheduler = build_optimizer(self.model, t)
        self.offloader = TrainStateOffloader(self.model, self.optimizer, t.precision != "fp32")
        self.store = WeightStore(self.model)
        self.store.snapshot("ref")
        self.reference = concurrent_reference(config, self.spec, self.model)
        self._routers = routing_replay.routers(self.model)  # [] for a dense model
        self.recorded_routes: routing_replay.RecordedRoutes | None = None
        """The routes the step's ``old`` pass recorded for its updates (by sample id)."""
        self.loss_settings = LossSettings.from_algo_config(config.algo, config.resolved.alpha)
        self.lp = LogprobSettings(
            vocab_size=self.spec.vocab_size,
            temperature=config.rollout.sampling.temperature,
            chunk=t.logprob_chunk,
        )
        self.updates = 0
        self.updates_per_step = updates_per_step(config)

    # --- helpers ---------------------------------------------------------------------------

    def _pad_multiple(self) -> int:
        t = self.config.trainer
        return token_multiple(t.tp, t.sequence_parallel, t.fp8.enabled)

    def _micro_batches(self, batch):
        """This rank's micro-batches: bucketed by length; packed (``thd``, no padding) with
        Transformer Engine, padded ``[n, L]`` with the local spec (CPU)."""
        t = self.config.trainer
        return plan_micro_batches(
            batch, parallel.dp_rank(), parallel.dp_size(), t.micro_batch_tokens,
            self._pad_multiple(), packed=t.transformer_impl == "te",
            equal_counts=self._equal_counts(),
        )  # fmt: skip

    def _equal_counts(self) -> bool:
        """Every DP rank must run as many micro-batches: a MoE model whose expert groups span
        DP ranks (``config/moe.py``: :func:`expert_groups_span_dp`)."""
        t = self.config.trainer
        spans = expert_groups_span_dp(t.tp, t.cp, t.ep, self.config.resolved.etp)
        return self.spec.moe is not None and spans

    def _diagnostic_micro_batches(self, batch, mbs, kl_mask):
        """The reference pass of the exact-KL diagnostic without reference log-probs: each
        micro-batch holding diagnostic tokens with only the samples that hold them (in the same
        order, so the rows line up with the policy pass's), its index into ``mbs``; the first
        micro-batch alone where none holds any (every rank runs the collective schedule).
        With :meth:`_equal_counts`, fillers (index ``None``, no diagnostic token) up to the
        most such micro-batches of any DP rank."""
        out = []
        for i, mb in enumerate(mbs):
            rows = mb.sample_index[kl_selection(mb, kl_mask)].unique().tolist()
            if rows:
                ids = [mb.samples[r] for r in sorted(rows)]
                if len(ids) < len(mb.samples):
                    mb = with_samples(batch, mb, ids, self._pad_multiple())
                out.append((i, mb))
        out = out or [(0, mbs[0])]
        if not self._equal_counts():
            return out
        t = self.config.trainer
        selected = kl_mask.bool() & (batch.loss_mask != 0)
        counts = holding_counts(batch, selected, parallel.dp_size(), t.micro_batch_tokens,
                                packed=t.transformer_impl == "te")  # fmt: skip
        filler = filler_micro_batch(batch, t.transformer_impl == "te", self._pad_multiple())
        return out + [(None, filler)] * (max(counts) - len(out))

    @staticmethod
    def _rows(captured: list[torch.Tensor], i: int | None) -> torch.Tensor:
        """The policy pass's diagnostic rows of micro-batch ``i``; none for a filler."""
        return captured[0][:0] if i is None else captured[i]

    def _under(self, weights: str):
        """The block under stored ``weights`` (no swap for the live ``policy``)."""
        return contextlib.nullcontext() if weights == "policy" else self.store.swapped(weights)

    def _update(self, minibatch) -> dict[str, float]:
        """One optimizer update on one mini-batch; metrics reduced over DP. A non-finite loss
        or gradient norm on any rank skips it on every rank (``optim.guarded_step``): no
        step, the weights as they were, ``train/skipped`` 1 (it keeps its place in the LR
        schedule: ``self.updates`` counts it)."""
        mbs = self._micro_batches(minibatch)
        normalizer = global_units(mbs, self.loss_settings.loss_agg) or 1.0
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        t = self.config.trainer
        advance_lr_schedule(self.scheduler, self.updates, self.updates_per_step, t.lr_unit)
        builder = policy_loss_builder(self.lp, self.loss_settings, normalizer)
        plan = self._replay_plan()
        routing = None
        if plan is not None:
            held = None
            if plan.mode != "off":  # collective over the data-parallel group
                held = routing_replay.update_routes(
                    self.recorded_routes, minibatch, parallel.dp_rank(), parallel.dp_size(),
                    parallel.dp_group(),
                )  # fmt: skip
            routing = plan.update_pass(minibatch, self._routers, held)
        if self.spec.moe is not None:  # the load-balancing loss's share of this update
            scale_aux_loss(unwrap(self.model), t.moe.aux_loss_coeff, mbs)
        outputs = run_schedule(self.model, mbs, builder, forward_only=False, routing=routing)
        finite = all(bool(torch.isfinite(o["loss/objective"])) for o in outputs)
        applied, grad_norm = guarded_step(self.optimizer, finite)
        if applied:
            self.store.live_changed()  # the reference (if reset since) is no longer the policy
        self.updates += 1
        sums = reduce_metric_sums(outputs)
        objective = sums.pop("loss/objective", 0.0)
        metrics = finalize_metrics(sums)
        metrics["loss/objective"] = objective
        metrics["loss/grad_norm"] = grad_norm
        metrics["train/skipped"] = 0.0 if applied else 1.0
        metrics["lr"] = float(self.optimizer.param_groups[0]["lr"])
        metrics["train/padding_fraction"] = padding_fraction(mbs)
        if self.spec.moe is not None:
            metrics.update(aux_loss_metrics(unwrap(self.model), self.spec.moe, len(mbs)))
            metrics.update(plan.metrics([routing], None, UPDATE_AGREE_NAMES))
        return metrics

    # --- TrainerInterface ------------------------------------------------------------------

    def compute_logprobs(self, batch, weights: str = "policy") -> torch.Tensor | None:
        enable_cpu_mode()  # per thread (no-op with CUDA)
        mbs = self._micro_batches(batch)
        self.model.eval()
        with self.store.swapped(weights), torch.no_grad():
            outputs = run_schedule(self.model, mbs, logprob_builder(self.lp), forward_only=True)
        return self._gather_logprobs(outputs, batch)

    def _gather_logprobs(self, outputs: list[dict], batch, shared: bool = False):
        """The ``[total]`` log-probs of ``batch`` (zero off the loss mask) from a log-prob
        pass's outputs; ``None`` on ranks that do not report. With ``shared``, every rank
        gets the whole tensor: the reporting ranks' parts summed over the world group (each
        token is in exactly one part and zero in the others, so the sum is exact)."""
        reporting = parallel.is_reporting_rank()
        if not reporting and not shared:
            return None
        out = torch.zeros(batch.num_tokens)
        if reporting:
            for o in outputs:
                out[o["index"]] = o["logp"].float().cpu()
            out = out * batch.loss_mask.float()
        if shared and dist.get_world_size() > 1:
            total = out.to(parallel.collective_device())
            dist.all_reduce(total)
            out = total.cpu()
        return out

    def step_logprobs(
        self,
        batch,
        with_ref: bool,
        kl_mask: torch.Tensor | None = None,
        shared: bool = False,
        old_weights: str = "policy",
    ):
        """The log-prob work of a step in one call: ``(old, ref, exact_kl)``.

        ``old``: policy log-probs (one pass over ``batch``); ``ref``: reference log-probs when
        ``with_ref`` (a second pass), else ``None``; ``exact_kl``: with ``kl_mask`` (``[total]``,
        the diagnostic's tokens), the ``kl/exact_*`` metrics of :meth:`exact_kl` from the logit
        rows of those tokens in the policy pass and the reference pass — which then runs only
        over the samples holding such tokens when ``with_ref`` is off (a few samples, not the
        batch: :meth:`_diagnostic_micro_batches`). ``{}`` without.
        ``shared``: every rank returns the whole ``old`` / ``ref`` (one all-reduce each), so the
        step's updates can run on the batch the ranks already hold.

        While the reference copy equals the live weights (a reset and no update since: under a
        ``reset: every 1`` schedule, every step) the reference pass would repeat the policy
        pass bit for bit, so it is not run: ``ref`` is a copy of ``old`` and the exact KLs are
        taken between the policy pass's rows and themselves (zero, as the pass would give).
        With ``trainer.concurrent_reference`` the reference pass runs beside the policy pass
        (:meth:`_concurrent_passes`), with the same results bit for bit.

        ``old_weights``: the weights of the ``old`` pass, ``policy`` (the live weights) or
        ``behavior`` (the copy of :meth:`snapshot_behavior`: the weights the engines generated
        a one-step-off batch with, ``orchestration.async_rollout``)."""
        enable_cpu_mode()  # per thread (no-op with CUDA)
        mbs = self._micro_batches(batch)
        self.model.eval()
        captured: list[torch.Tensor] = []
        policy = logprob_kl_builder(self.lp, kl_mask, captured, None)
        live_old = old_weights == "policy" or self.store.matches_live(old_weights)
        # no reference pass, or one that would repeat this one
        single = (not with_ref and kl_mask is None) or (live_old and self.store.matches_live("ref"))
        routing = self._step_routing(batch, single)
        with torch.no_grad():
            if single:
                with self._under(old_weights):
                    outputs = run_schedule(self.model, mbs, policy, True, routing[0])
                old = self._gather_logprobs(outputs, batch, shared)
                ref = old.clone() if with_ref and old is not None else None
                extra = self._finish_routing(batch, *routing)
                return old, ref, {**self._self_kl(kl_mask, captured), **extra}
            passes = (
                list(enumerate(mbs))
                if with_ref
                else self._diagnostic_micro_batches(batch, mbs, kl_mask)
            )
            if self.reference is not None:
                outputs, ref_outputs = self._concurrent_passes(
                    mbs, policy, passes, kl_mask, captured, old_weights, routing
                )
            else:
                with self._under(old_weights):  # never nested: one swap buffer
                    outputs = run_schedule(self.model, mbs, policy, True, routing[0])
                compare = [self._rows(captured, i) for i, _ in passes] if captured else []
                builder = logprob_kl_builder(self.lp, kl_mask, [], compare)
                with self.store.swapped("ref"):
                    ref_outputs = run_schedule(
                        self.model, [mb for _, mb in passes], builder, True, routing[1]
                    )
            old = self._gather_logprobs(outputs, batch, shared)
        ref = self._gather_logprobs(ref_outputs, batch, shared) if with_ref else None
        extra = self._finish_routing(batch, *routing)
        if kl_mask is None:
            return old, ref, extra
        kl_outputs = [{k: v for k, v in o.items() if k.startswith("kl/")} for o in ref_outputs]
        return old, ref, {**exact_kl_means(reduce_metric_sums(kl_outputs)), **extra}

    def _replay_plan(self) -> routing_replay.ReplayPlan | None:
        """The routing of this call's passes (``trainer.moe``, read per call); ``None`` for a
        dense model."""
        moe = self.spec.moe
        if moe is None:
            return None
        t = self.config.trainer
        sp = (parallel.tp_rank(), parallel.tp_size()) if t.sequence_parallel else (0, 1)
        sparse = tuple(i for i, s in enumerate(moe.sparse_layers) if s)
        return routing_replay.ReplayPlan(t.moe.routing_replay, t.moe.anchor_routes,
                                         self.spec.num_layers, moe.num_experts, moe.topk,
                                         sparse, sp, t.recompute)  # fmt: skip

    def _step_routing(self, batch, single: bool) -> tuple:
        """``(old pass, reference pass)`` routings of :meth:`step_logprobs` (``None`` s for
        a dense model; the reference one ``None`` when ``single``: no reference pass)."""
        plan = self._replay_plan()
        if plan is None:
            return None, None
        old = plan.old_pass(batch, self._routers, single)
        if single:
            return old, None
        ref_model = self.reference.model if self.reference is not None else self.model
        return old, plan.ref_pass(batch, routing_replay.routers(ref_model))

    def _finish_routing(self, batch, old_routing, ref_routing) -> dict[str, float]:
        """After the passes of a step: the ``old`` pass's routes of this rank's samples kept
        for the step's updates (:attr:`recorded_routes`; they replay them,
        ``routing_replay.update_routes``) and the ``moe/*`` routing metrics (collective)."""
        if old_routing is None:
            return {}
        plan = self._replay_plan()
        self.recorded_routes = None
        if old_routing.spec.record:
            dp_rank, dp_size = parallel.dp_rank(), parallel.dp_size()
            self.recorded_routes = plan.recorded(old_routing, batch, dp_rank, dp_size)
        passes = [p for p in (old_routing, ref_routing) if p is not None]
        engine = batch.token_data.get(ROUTES_KEY)
        share = float(has_route(engine).float().mean()) if engine is not None else 0.0
        return {**plan.metrics(passes, old_routing, AGREE_NAMES), "moe/routes_share": share}

    def _concurrent_passes(
        self, mbs, policy, passes, kl_mask, captured, old_weights="policy", routing=(None, None)
    ):
        """The policy pass over ``mbs`` here and the reference pass over ``passes`` on the
        reference model's thread, at once (``trainer.concurrent_reference``,
        ``reference_model.py``); the reference outputs then get the exact-KL sums the
        sequential pass computes in its loss function, from the same rows. Returns
        ``(policy outputs, reference outputs)``."""
        ref_rows: list[torch.Tensor] = []
        builder = logprob_kl_builder(self.lp, kl_mask, ref_rows, None)
        pending = self.reference.submit(
            self.store.get("ref"), [mb for _, mb in passes], builder, routing[1]
        )
        try:
            with self._under(old_weights):
                outputs = run_schedule(self.model, mbs, policy, True, routing[0])
        except BaseException:
            futures.wait([pending])  # never leave the pass running behind the error
            raise
        ref_outputs = pending.result()
        if kl_mask is not None:
            for (i, _), out, rows in zip(passes, ref_outputs, ref_rows, strict=True):
                out.update(exact_kl_sums(self._rows(captured, i), rows, self.lp, rows.device))
        return outputs, ref_outputs

    def _self_kl(self, kl_mask, captured: list[torch.Tensor]) -> dict[str, float]:
        """The exact-KL metrics of a reference pass whose rows are the policy pass's own."""
        if kl_mask is None:
            return {}
        dev = parallel.collective_device()
        return exact_kl_means(
            reduce_metric_sums([exact_kl_sums(r, r, self.lp, dev) for r in captured])
        )

    def exact_kl(self, batch) -> dict[str, float]:
        """Exact ``KL(policy || ref)`` (``kl/exact_reverse``) and ``KL(ref || policy)``
        (``kl/exact_forward``) over the whole vocabulary at the tokens of ``batch`` with
        ``loss_mask`` set (docs/metrics.md, the paper's Fig. 2 diagnostic): means, maxima and
        ``kl/exact_positions``. Two forward passes (policy, then reference), vocab-parallel."""
        enable_cpu_mode()  # per thread (no-op with CUDA)
        mbs = self._micro_batches(batch)
        self.model.eval()
        captured: list[torch.Tensor] = []
        with torch.no_grad():
            run_schedule(self.model, mbs, capture_builder(captured), forward_only=True)
            with self.store.swapped("ref"):
                outputs = run_schedule(
                    self.model, mbs, exact_kl_builder(self.lp, captured), forward_only=True
                )
        return exact_kl_means(reduce_metric_sums(outputs))

    def offload_train_state(self) -> None:
        """Optimizer state to CPU and gradient buffers freed until the next update
        (``trainer.offload_train_state``, colocated rollouts; ``offload.py``)."""
        enable_cpu_mode()  # per thread (no-op with CUDA)
        self.offloader.offload()

    def hand_over_memory(self) -> None:
        """Before colocated engines take their memory back: the update state out
        (``trainer.offload_train_state``), then every cached block returned to CUDA
        (``offload.return_cached_blocks``)."""
        enable_cpu_mode()  # per thread (no-op with CUDA)
        if self.config.trainer.offload_train_state:
            self.offloader.offload()
        return_cached_blocks()

    def train_step(self, batch, num_minibatches: int) -> dict[str, float]:
        enable_cpu_mode()  # per thread (no-op with CUDA)
        self.offloader.restore()
        per_update = [self._update(mb) for mb in split_minibatches(batch, num_minibatches)]
        keys = set().union(*per_update)
        return {
            k: sum(m[k] for m in per_update if k in m) / sum(1 for m in per_update if k in m)
            for k in sorted(keys)
        }

    def end_step(self) -> None:
        self.recorded_routes = None

    def reset_reference(self) -> None:
        enable_cpu_mode()  # per thread (no-op with CUDA)
        self.store.snapshot("ref")

    def snapshot_behavior(self) -> None:
        """Keep the live weights as ``behavior``: the engines generate the next step's batch
        with them while this step's updates change the live ones
        (``orchestration.async_rollout: one_step``); that batch's ``old`` pass runs under
        them (:meth:`step_logprobs` with ``old_weights="behavior"``) and a checkpoint keeps
        them (``checkpoint.py``)."""
        enable_cpu_mode()  # per thread (no-op with CUDA)
        self.store.snapshot(BEHAVIOR)

    def export_weights(
        self, weights: str = "policy", device: str | None = "cpu", every_rank: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """HF tensors of ``weights`` (``hf_weights.export_hf_weights``: on ``device``, from
        the export ranks or ``every_rank``)."""
        enable_cpu_mode()  # per thread (no-op with CUDA)
        with self.store.swapped(weights):
            yield from export_hf_weights(self.model, self.spec, device, every_rank)

    def save_checkpoint(self, path: str, run_state: dict) -> None:
        enable_cpu_mode()  # per thread (no-op with CUDA)
        self.offloader.restore()  # the optimizer state is saved from where it trains
        checkpoint.save_trainer(self, path, run_state)

    def load_checkpoint(self, path: str) -> dict:
        enable_cpu_mode()  # per thread (no-op with CUDA)
        self.offloader.restore()
        run_state = checkpoint.load_trainer(self, path)
        for name, param in self.model.named_parameters():
            require_finite(param.data, f"checkpoint {path}: parameter {name}")
        self.store.live_changed()
        # saved right after a reset, the reference is the policy: found so on every rank, the
        # step after the resume skips its reference pass as the uninterrupted run does
        if parallel.all_ranks_agree(self.store.equals_live("ref")):
            self.store.mark_live("ref")
        return run_state

    def close(self) -> None:
        """Destroy the process groups (the rank can be torn down afterwards)."""
        if self.reference is not None:
            self.reference.close()
        parallel.destroy_parallel()
