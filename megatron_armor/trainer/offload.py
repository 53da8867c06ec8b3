"""Free the trainer's GPU memory that only the update needs while colocated engines generate.

``trainer.offload_train_state: true`` (colocated layout): after the weight sync the Adam state
(and, with bf16/fp16, the fp32 main parameters) moves to CPU and the gradient buffers are
freed; log-prob passes need only the model weights, and the next update brings both back.
megatron-core 0.16 provides the pieces for RL (``MegatronOptimizer.offload_to_cpu`` /
``restore_from_cpu``, ``DistributedDataParallel.offload_grad_buffers`` /
``restore_grad_buffers``, which resize the buffers' storage to 0 and back, zeroed).

With fp32 training the optimizer's parameters *are* the model's (or views into its buffer),
so only the optimizer state moves; moving ``param.data`` would detach the optimizer from the
model. On CPU (no CUDA) the optimizer tensors stay where they are and only the gradient
storage is released, which is what the tests check.

Freed tensors stay in PyTorch's caching allocator (reserved, not allocated): another process on
the GPU cannot have them until :func:`return_cached_blocks` gives them back to the driver.
"""

from __future__ import annotations

import torch


def _inner_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _move_state(optimizer, device: str) -> None:
    inner = getattr(optimizer, "optimizer", None)
    if inner is None:
        return
    for state in inner.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device.type != device:
                state[key] = value.to(device)


class TrainStateOffloader:
    """Moves the optimizer state and gradient buffers of ``ddp`` / ``optimizer`` out and back."""

    def __init__(self, ddp, optimizer, mixed_precision: bool) -> None:
        self.ddp, self.optimizer, self.mixed = ddp, optimizer, mixed_precision
        self.offloaded = False

    def offload(self) -> None:
        """Optimizer state to CPU, gradient buffers freed (idempotent)."""
        if self.offloaded:
            return
        cuda = torch.cuda.is_available()
        for opt in _inner_optimizers(self.optimizer):
            if self.mixed:
                opt.offload_to_cpu()  # fp32 main params and state
            elif cuda:
                _move_state(opt, "cpu")
        self.ddp.offload_grad_buffers(synchronize=cuda, empty_cache=cuda)
        self.offloaded = True

    def restore(self) -> None:
        """Back to the update's layout (idempotent); the gradient buffers come back zeroed."""
        if not self.offloaded:
            return
        cuda = torch.cuda.is_available()
        for opt in _inner_optimizers(self.optimizer):
            if self.mixed:
                opt.restore_from_cpu()
            elif cuda:
                _move_state(opt, "cuda")
        self.ddp.restore_grad_buffers(synchronize=cuda)
        self.offloaded = False

    def grad_bytes_resident(self) -> int:
        """Bytes of gradient-buffer storage currently allocated (0 while offloaded)."""
        total = 0
        for buffer in list(self.ddp.buffers) + list(self.ddp.expert_parallel_buffers):
            if buffer.grad_data is not None:
                total += buffer.grad_data.untyped_storage().size()
        return total


def return_cached_blocks() -> None:
    """Wait for this rank's queued kernels and give the caching allocator's free blocks back to
    CUDA, so that a colocated engine that resumes its memory next finds it free: after the
    log-prob and training passes the allocator still holds their activation and logit peak.
    Nothing to do without CUDA."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return
    torch.cuda.synchronize()
    torch.cuda.ipc_collect()  # blocks shared by CUDA IPC (a pushed bucket) that the server let go
    torch.cuda.empty_cache()
