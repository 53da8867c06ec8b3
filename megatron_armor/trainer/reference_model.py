"""The reference pass beside the policy pass, on a CPU rank (``trainer.concurrent_reference``).

A step's log-prob work is two forward passes over the same micro-batches: the policy weights
(``lp_old``) and the reference weights (``lp_ref``, which the mixed ratio needs, the paper's
Eq. 5). On one rank they normally run one after the other, the reference pass under the
reference copy swapped into the live model (``weight_store.py``). On a CPU rank whose node has
a core to spare while the trainer works — the ``cpu`` layout with one trainer rank: the
rollout engine's thread share sits idle until the trainer is done — the reference pass runs on
a second thread, at the same time as the policy pass, through a second instance of the rank's
``GPTModel`` whose parameters *are* the stored reference copy (the same tensors, aliased: no
memory, no copy, no swap).

The two instances compute with the same kernels on the same values, so ``lp_ref`` and the
exact-KL diagnostic's reference rows are the sequential pass's, bit for bit
(``tests/dist/test_trainer_step_dist.py``).

Only where the forward pass runs no collectives (``tp = pp = cp = 1``: two threads issuing
collectives on one process group could interleave them differently on different ranks) and on
CPU (a GPU runs one pass at a time at full occupancy, and the stored copy is host memory).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from megatron_armor.config.resolve import concurrent_reference_setting
from megatron_armor.trainer.cpu_compat import enable_cpu_mode
from megatron_armor.trainer.model import build_model
from megatron_armor.trainer.schedule import run_schedule


def concurrent_reference(config, spec, live: torch.nn.Module) -> ConcurrentReference | None:
    """The rank's :class:`ConcurrentReference` where ``trainer.concurrent_reference`` is
    decided on (``config.resolved``) and the rank runs on CPU; ``auto`` on a CUDA rank is off,
    ``true`` an error."""
    if not config.resolved.concurrent_reference:
        return None
    if torch.cuda.is_available():
        if concurrent_reference_setting(config.trainer.concurrent_reference) == "auto":
            return None
        raise ValueError(
            "trainer.concurrent_reference=true on a rank with CUDA: the concurrent reference "
            "pass is for CPU ranks; set trainer.concurrent_reference=auto or false"
        )
    return ConcurrentReference(spec, config.trainer, live)


class ConcurrentReference:
    """A second ``GPTModel`` of this rank whose parameters are a stored weight copy, and the
    thread its forward-only passes run on (:meth:`submit`)."""

    def __init__(self, spec, trainer_config, live: torch.nn.Module):
        self.model = build_model(spec, trainer_config)
        self.model.config.calculate_per_token_loss = live.config.calculate_per_token_loss
        self.model.eval()
        self._keys = _store_keys(live, self.model)
        self._bound: dict[str, torch.Tensor] | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reference-pass")

    def bind(self, copy: dict[str, torch.Tensor]) -> None:
        """Make ``copy`` (a :class:`WeightStore` copy: live-model parameter name -> tensor)
        this instance's parameters (aliased; a copy replaced in the store is bound anew)."""
        if copy is self._bound:
            return
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                stored = copy[self._keys[name]]
                if stored.shape != param.shape or stored.dtype != param.dtype:
                    raise ValueError(
                        f"stored weights for {name}: {tuple(stored.shape)} {stored.dtype}, "
                        f"the model's {tuple(param.shape)} {param.dtype}"
                    )
                param.data = stored
        self._bound = copy

    def submit(
        self, copy: dict[str, torch.Tensor], micro_batches: list, builder, routing=None
    ) -> Future:
        """Start a forward-only pass of ``builder`` (a ``schedule`` loss builder) over
        ``micro_batches`` under ``copy`` (``routing``: its MoE routing, on this instance's
        routers); its outputs are the future's result. One pass at a time: the caller waits
        for it before the next."""
        self.bind(copy)
        return self._pool.submit(self._run, micro_batches, builder, routing)

    def _run(self, micro_batches: list, builder, routing=None) -> list:
        enable_cpu_mode()  # per thread: the torch function mode is thread-local
        with torch.no_grad():
            return run_schedule(self.model, micro_batches, builder, True, routing)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _store_keys(live: torch.nn.Module, model: torch.nn.Module) -> dict[str, str]:
    """For each parameter name of ``model`` (a bare ``GPTModel``), the name of the same
    parameter in ``live`` (the same model wrapped, e.g. in megatron DDP: every name behind one
    prefix, ``module.``), under which the store keeps it."""
    live_names = [name for name, _ in live.named_parameters()]
    names = [name for name, _ in model.named_parameters()]
    if len(names) != len(live_names) or not names or not live_names[0].endswith(names[0]):
        raise ValueError(
            f"the reference model's {len(names)} parameters do not line up with the live "
            f"model's {len(live_names)}"
        )
    prefix = live_names[0][: len(live_names[0]) - len(names[0])]
    keys = {name: prefix + name for name in names}
    if sorted(keys.values()) != sorted(live_names):
        raise ValueError(
            f"the live model's parameters are not the reference model's behind {prefix!r}"
        )
    return keys
