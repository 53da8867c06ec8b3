"""``armor doctor``: the pre-flight of one node before a long job (versions, GPUs, TE FP8, CUDA
IPC, NCCL, an SGLang server with a weight update and a log-prob check, one trainer step), and the
pins of the GPU stack (:mod:`megatron_armor.doctor.pins`). See docs/gpu.md."""
