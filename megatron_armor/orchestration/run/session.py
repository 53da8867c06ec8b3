"""Set-up and tear-down of a run: Ray, actor handles, data, schedule, sinks, checkpoints.

:class:`Session` owns every long-lived object of a run so the loop
(``orchestration/step/loop.py``) reads as verbs only. ``save``/``restore`` implement the
checkpoint contract of docs/algorithm.md, reference reset: the trainer writes model,
optimizer, reference weights and RNG; the orchestrator writes
:class:`~megatron_armor.orchestration.run.run_state.RunState` next to it; the directory is
renamed into place only when complete.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_armor.algo.reset import ResetSchedule
from megatron_armor.config.benchmarks import benchmark_name
from megatron_armor.config.schema import ArmorConfig
from megatron_armor.config.validate import (
    runs_async_rollout,
    runs_bounded_staleness,
    updates_per_step,
)
from megatron_armor.data.dataset import load_prompt_dataset
from megatron_armor.data.sampler import ResumableSampler, sampled_prompt_count
from megatron_armor.observability.metrics import (
    MetricsLogger,
    WandbSettings,
    read_metrics,
)
from megatron_armor.observability.profiler import profile_steps_after_resume
from megatron_armor.observability.throughput import (
    ThroughputMeter,
    compute_precision,
    gpu_memory_metrics,
    peak_tflops,
)
from megatron_armor.observability.timers import PhaseTimers
from megatron_armor.orchestration.actors import placement
from megatron_armor.orchestration.actors.actor_handles import (
    RewardActors,
    TrainerActors,
    close_actors,
    max_peak,
)
from megatron_armor.orchestration.actors.call_watch import CallWatch
from megatron_armor.orchestration.actors.placement import (
    LayoutPlan,
    create_bundles,
    init_ray,
    plan_layout,
    rollout_hosts,
)
from megatron_armor.orchestration.actors.recovery import Recovery
from megatron_armor.orchestration.actors.rollout_draws import PolicyDraws, ReferenceDraws
from megatron_armor.orchestration.actors.rollout_fleet import (
    RolloutFleet,
    RolloutMemory,
    RolloutSide,
    ServerHealth,
)
from megatron_armor.orchestration.actors.weight_sync import WeightSync, make_weight_sync
from megatron_armor.orchestration.actors.workers import freeze_heap, load_model_tokenizer
from megatron_armor.orchestration.run import checkpoints
from megatron_armor.orchestration.run.control_plane import (
    ControlPlaneProbe,
    health_check_environment,
)
from megatron_armor.orchestration.run.disk_space import (
    check_free_space,
    estimated_checkpoint_bytes,
    no_space_error,
)
from megatron_armor.orchestration.run.host_usage import HostMemory, disk_metrics
from megatron_armor.orchestration.run.run_dir import announce_resume, open_run_dir
from megatron_armor.orchestration.run.run_lock import RunLock
from megatron_armor.orchestration.run.run_state import RunState
from megatron_armor.orchestration.run.run_watch import RunWatch
from megatron_armor.orchestration.step.anchor_rollout import caches_anchors
from megatron_armor.orchestration.step.progress import PhaseProgress
from megatron_armor.orchestration.step.step_metrics import compress_anchor_files
from megatron_armor.planner.model import load_model_dims
from megatron_armor.rollout.backends import backend_of

MIN_RAY_SHUTDOWN_S = 5.0


def run_dir_of(config: ArmorConfig) -> Path:
    return Path(config.run.output_dir) / config.run.name


def profile_after_resume(config: ArmorConfig, resume_from: Path | None) -> None:
    """Profile steps the resumed run would never reach move after its resume step (the
    trainer ranks' profilers are made from the config)."""
    log = config.logging
    if resume_from is None or log.profile == "none" or not log.profile_steps:
        return
    steps, note = profile_steps_after_resume(log.profile_steps, RunState.load(resume_from).step)
    if note:
        print(note, flush=True)
        log.profile_steps = steps


def check_resume_mode(config: ArmorConfig, resume_from: Path | None) -> None:
    """A checkpoint that holds the next step's rollout (``orchestration.async_rollout:
    one_step``) or partial rollouts (``bounded``) resumes only with its mode: the sampler is
    past those queries, which only that pipeline trains on. Checked before anything starts."""
    if resume_from is None:
        return
    state = RunState.load(resume_from)
    partial = "partial_rollouts" in state.pending
    if partial and not runs_bounded_staleness(config):
        raise checkpoints.CheckpointError(
            f"{resume_from} (step {state.step}) holds partial rollouts in flight, drawn with "
            "orchestration.async_rollout=bounded; resume with orchestration.async_rollout="
            "bounded (docs/orchestration.md, 'Bounded staleness')"
        )
    if state.pending and not partial and not runs_async_rollout(config):
        raise checkpoints.CheckpointError(
            f"{resume_from} (step {state.step}) holds the rollout of step {state.step + 1}, "
            "drawn during its step with orchestration.async_rollout=one_step; resume with "
            "orchestration.async_rollout=one_step, or from the checkpoint of a step that "
            "drained the pipeline (a reset step: docs/orchestration.md, 'Asynchronous rollout')"
        )


def train_size(config: ArmorConfig, dataset) -> int:
    """Prompts the sampler draws from: the first ``data.train_limit`` (0 = all)."""
    return sampled_prompt_count(len(dataset), config.data.train_limit)


def load_val_datasets(config: ArmorConfig, tokenizer) -> dict:
    """One prompt dataset per validation file, named by the file stem."""
    out = {}
    for file in config.data.val_files:
        name = benchmark_name(file)
        out[name] = load_prompt_dataset(
            [file], tokenizer, config.data.template, config.data.max_prompt_len
        )
    return out


def rollout_side(config: ArmorConfig, fleet: RolloutFleet, sync: WeightSync) -> RolloutSide:
    """The driver's rollout side over ``fleet``, by concern; reference samples swap through
    the run's weight transport ``sync`` (chosen once), and a healed server is re-synced by it."""
    reference = ReferenceDraws(fleet, caches_anchors(config), sync.reference_swapped,
                               sync.swaps_into_policy_servers())  # fmt: skip
    return RolloutSide(fleet, PolicyDraws(fleet), reference, RolloutMemory(fleet),
                       ServerHealth(fleet, sync.resync))  # fmt: skip


def make_meter(config: ArmorConfig, plan: LayoutPlan, device_name: str) -> ThroughputMeter:
    """Tokens/s always; FLOPs and MFU where the model dims and the GPU's peak are known."""
    try:
        dims = load_model_dims(config.trainer.model_path)
    except (OSError, ValueError, KeyError):
        dims = None  # not an HF config.json the planner knows: tokens/s only
    gpus = plan.trainer_ranks if plan.layout != "cpu" else 0
    t = config.trainer
    precision = compute_precision(t.precision, t.fp8.enabled)
    peak = peak_tflops(device_name, precision) if gpus else None
    return ThroughputMeter(dims=dims, num_gpus=max(gpus, 1), peak_tflops_per_gpu=peak)


@dataclass
class Session:
    config: ArmorConfig
    run_dir: Path
    trainer: TrainerActors
    rollout: RolloutSide
    reward: RewardActors
    dataset: object
    val_datasets: dict
    sampler: ResumableSampler
    schedule: ResetSchedule
    logger: MetricsLogger
    timers: PhaseTimers
    meter: ThroughputMeter
    tokenizer: object
    progress: PhaseProgress
    num_minibatches: int
    state: RunState
    watch: RunWatch
    lock: RunLock
    resume_from: Path | None
    weight_sync: WeightSync
    host_memory: HostMemory
    recovery: Recovery
    call_watch: CallWatch
    probe: ControlPlaneProbe | None = None
    """The driver's probe of its raylet and the GCS (``control_plane.py``)."""

    @classmethod
    def start(cls, config: ArmorConfig, call_watch: CallWatch, resume: str = "auto",
              announce=None) -> Session:  # fmt: skip
        """Lock the run directory and decide the resume checkpoint (``--resume
        auto|none|PATH``, see ``run_dir.py``), then start everything for the next step, every
        actor watched by ``call_watch``; ``announce()`` runs once the directory is this
        run's (a refused run never says it started)."""
        run_dir = run_dir_of(config)
        lock, resume_from = open_run_dir(config, run_dir, resume)
        try:
            check_resume_mode(config, resume_from)
            profile_after_resume(config, resume_from)
            if announce is not None:
                announce()
            session = cls._start(config, run_dir, call_watch)
        except BaseException:
            lock.release()
            raise
        session.lock, session.resume_from = lock, resume_from
        freeze_heap()  # the driver's start-up objects too (workers.freeze_heap)
        return session

    @classmethod
    def _start(cls, config: ArmorConfig, run_dir: Path, call_watch: CallWatch) -> Session:
        """Everything up and ready for step 1 (or the resumed step)."""
        tokenizer = load_model_tokenizer(config.trainer.model_path)
        d = config.data
        dataset = load_prompt_dataset(
            d.train_files, tokenizer, d.template, d.max_prompt_len, dedupe=d.dedupe
        )
        val = load_val_datasets(config, tokenizer) if config.validation.every > 0 else {}
        plan = plan_layout(config)
        health_check_environment()  # before the local head starts: its GCS reads them
        init_ray(config, plan, run_dir)
        probe = ControlPlaneProbe.start()  # a frozen raylet or GCS: named, exit 75
        built: list = []
        try:  # a failed start must not leave actors or SGLang servers behind
            pg, order, where = create_bundles(plan, config.orchestration.ray_init_timeout_s)
            trainer = TrainerActors.start(config, plan, call_watch, pg, order,
                                          str(run_dir / "profile"))  # fmt: skip
            built.append(trainer)
            fleet = RolloutFleet.start(config, plan, call_watch, pg, order,
                                       rollout_hosts(plan, where))  # fmt: skip
            built.append(fleet)
            reward = RewardActors.start(config, plan, call_watch)
            built.append(reward)
            trainer.init()
            host_memory = HostMemory.start(trainer, fleet, reward, call_watch)
        except BaseException:
            probe.stop()
            close_actors(built, call_watch)
            raise
        weight_sync = make_weight_sync(config, trainer, fleet)
        r = config.algo.reset
        log = config.logging
        from omegaconf import OmegaConf

        wandb = WandbSettings(log.wandb_project, log.wandb_entity, log.wandb_group, log.wandb_mode)
        logger = MetricsLogger(run_dir, log.tensorboard, log.wandb, config=OmegaConf.to_container(
            OmegaConf.structured(config)), run_name=config.run.name, wandb_settings=wandb)  # fmt: skip
        return cls(
            config=config, run_dir=run_dir, trainer=trainer,
            rollout=rollout_side(config, fleet, weight_sync), reward=reward,
            dataset=dataset, val_datasets=val,
            sampler=ResumableSampler(train_size(config, dataset), config.run.seed, d.shuffle,
                                     d.retire_solved_after, d.retire_max_fraction),
            schedule=ResetSchedule(r.schedule, r.every, r.until), logger=logger,
            timers=PhaseTimers(), progress=PhaseProgress(log.progress), tokenizer=tokenizer,
            meter=make_meter(config, plan, trainer.info.get("device_name", "cpu")),
            num_minibatches=updates_per_step(config), state=RunState(), watch=RunWatch(config), lock=None,
            resume_from=None, weight_sync=weight_sync, host_memory=host_memory,
            recovery=Recovery(config), call_watch=call_watch, probe=probe,
        )  # fmt: skip

    # ------------------------------------------------------------------ checkpoints
    def save(self, step: int, metrics_line: dict | None = None, in_flight: dict | None = None
             ) -> Path:  # fmt: skip
        """Atomic checkpoint of ``step`` (trainer + orchestrator), keeping the last K; it
        carries the step's ``metrics.jsonl`` line (``metrics_line``) for :meth:`restore`, and
        the next step's rollout drawn during this one (``in_flight``, as
        ``async_rollout.collected_state`` writes it; none by default). The
        free space is checked first; a save that runs out of it is removed and raises
        :class:`~megatron_armor.orchestration.run.disk_space.DiskFullError` (``disk_space.py``)."""
        t = self.config.trainer
        estimate = estimated_checkpoint_bytes(t.model_path, t.precision)
        need = check_free_space(self.run_dir, step, estimate)
        tmp = checkpoints.begin_checkpoint(self.run_dir, step)
        try:
            return self._save_into(tmp, step, metrics_line, in_flight or {})
        except Exception as err:
            full = no_space_error(self.run_dir, step, tmp, err, need)
            if full is None:
                raise
            raise full from err

    def _save_into(self, tmp: Path, step: int, metrics_line: dict | None,
                   in_flight: dict) -> Path:  # fmt: skip
        self.state.step = step
        self.state.metrics_line = dict(metrics_line or {})
        self.state.pending = in_flight
        self.state.sampler = self.sampler.state_dict()
        self.state.reset = self.schedule.state_dict()
        # a rollout worker that died since its step's rollout is replaced
        # (orchestration/actors/recovery.py)
        self.state.rollout = self.recovery.guard(self, step, "checkpoint",
                                                 self.rollout.reference.state_dicts)  # fmt: skip
        self.state.watch = self.watch.state_dict()
        self.state.capture_rng()
        offload = self.config.trainer.offload_train_state
        colocated = self.config.orchestration.layout == "colocated"
        if offload and colocated:  # the save brings the update state back: engines step aside
            self.rollout.memory.release()
        self.trainer.save_checkpoint(str(tmp / "trainer"), {"step": step})
        if offload:
            self.trainer.hand_over_memory()
            if colocated:
                self.resume_engines()
        self.state.save(tmp)
        self.watch.publish(self.run_dir)  # the best is protected before the rotation runs
        earlier = checkpoints.list_checkpoints(self.run_dir)
        final = checkpoints.commit_checkpoint(self.run_dir, tmp, step, self.config.run.keep_last)
        if earlier:  # anchor files up to the previous checkpoint are final: gzip them
            compress_anchor_files(self.run_dir, earlier[-1][0])
        return final

    def resume_engines(self) -> None:
        """Colocated engines take their memory back after a release outside the step's sync.
        SGLang policy servers released their weights (only the reference pool keeps a host
        copy, ``launch.server_args_for``): they take the weights' memory, get the policy pushed
        again, then take their KV cache."""
        if not backend_of(self.config).serves_over_http:
            self.rollout.memory.resume()
            return
        self.rollout.memory.resume(["weights"])
        self.push_policy(self.state.policy_version)
        self.rollout.memory.resume(["kv_cache"])

    def push_policy(self, version: int) -> int:
        """Load the trainer's policy into the engines (``orchestration/actors/weight_sync.py``)."""
        return self.weight_sync.push_policy(version)

    def offload_for_rollout(self) -> None:
        """``trainer.offload_train_state``: the first rollout (or the first after a resume)
        runs without the update state on the GPUs too."""
        if self.config.trainer.offload_train_state:
            self.trainer.offload_train_state()

    def push_reference(self, version: int, reset: bool = False) -> None:
        """Serve the trainer's reference at ``version`` (start-up, resume, or a ``reset``)."""
        self.weight_sync.push_reference(version, reset)

    def heal_rollout(self, step: int) -> int:
        """Every ``rollout.sglang.health_check_every`` steps: restart dead SGLang servers and
        re-sync their weights before they serve again; returns how many were restarted."""
        every = self.config.rollout.sglang.health_check_every
        if not backend_of(self.config).serves_over_http or every <= 0 or step % every:
            return 0
        return self.rollout.health.heal()

    def gpu_memory_metrics(self) -> dict[str, float]:
        """``perf/peak_gpu_mem_*``: the actors' peaks since the last call (none on CPU runs)."""
        if self.config.orchestration.layout == "cpu":
            return {}
        rollout = max_peak(self.rollout.fleet.peak_gpu_memory())
        return gpu_memory_metrics(self.trainer.peak_gpu_memory_gb(), rollout)

    def host_metrics(self, checkpoint_step: bool) -> dict[str, float]:
        """``mem/*`` (every step) and, at a step of the periodic checkpoints, ``disk/*`` before
        its checkpoint is written (``orchestration/run/host_usage.py``)."""
        out = self.host_memory.metrics()
        if checkpoint_step:
            out.update(disk_metrics(self.run_dir))
        return out

    def restore(self) -> int:
        """Load the checkpoint chosen at start-up (or start fresh); returns the step to
        continue after."""
        path = self.resume_from
        if path is None:
            self.logger.rewind(-1)
            self.watch.publish(self.run_dir)  # no best yet (a stale best.json goes)
            self.push_policy(0)
            self.push_reference(0)
            self.offload_for_rollout()
            return 0
        state = RunState.load(path)
        self.trainer.load_checkpoint(str(path / "trainer"))
        self.sampler.load_state_dict(state.sampler)
        self.schedule.load_state_dict(state.reset)
        self.watch.load_state_dict(state.watch)
        self.watch.publish(self.run_dir)
        state.restore_rng()
        self.push_policy(state.policy_version)
        self.push_reference(state.ref_version)
        self.rollout.reference.load_state_dicts(state.rollout)
        self.logger.rewind(state.step)  # metrics.jsonl, TensorBoard and W&B alike
        self.restore_metrics_line(state)
        self.state = state
        self.offload_for_rollout()
        announce_resume(self.run_dir, self.config, state.step, path)  # resumes.jsonl: it succeeded
        print(f"resumed from {path} at step {state.step}", flush=True)
        return state.step

    def restore_metrics_line(self, state: RunState) -> None:
        """Write the checkpoint's own step line back when ``metrics.jsonl`` lacks it (the
        process died after the checkpoint was committed, before the line was appended)."""
        line = state.metrics_line
        if not line or any(int(r["step"]) == state.step for r in read_metrics(self.run_dir)):
            return
        self.logger.write(line)
        print(f"metrics.jsonl: the line of step {state.step} written back from its checkpoint",
              flush=True)  # fmt: skip

    def close(self, shutdown_ray: bool = True) -> None:
        """Stop the actors and Ray (best effort: a failing close must not hide the real error),
        each within ``orchestration.shutdown_timeout_s``; what does not answer is killed."""
        self.progress.close()
        try:
            self.logger.close()  # flushes TensorBoard: fails on a full disk
        except OSError as err:
            print(f"warning: closing the metrics sinks failed: {err}", flush=True)
        if self.probe is not None:  # Ray goes now: unanswered probes are no lost GCS
            self.probe.stop()
        budget = self.config.orchestration.shutdown_timeout_s
        end = time.monotonic() + budget
        close_actors([self.trainer, self.rollout.fleet, self.reward], self.call_watch, budget)
        if shutdown_ray:  # what is left of the budget (a few seconds at least)
            placement.shutdown_ray(max(end - time.monotonic(), MIN_RAY_SHUTDOWN_S))
        if self.lock is not None:
            self.lock.release()
        gc.unfreeze()  # what this session held can be collected again (a pipeline's next stage)
