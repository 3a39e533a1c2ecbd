"""cs336-systems: benchmark, profile and speed up the cs336_basics Transformer LM.

Subpackages: `config` (model presets), `kernels` (Triton kernels with references),
`memory` (checkpointing, saved-tensor accounting, memory model), `parallel` (DDP,
ZeRO-1, FSDP on torch.distributed), `profiling` (timing, FLOPs, NVTX, traces),
`bench` (the `cs336-bench` CLI and result store).
"""

__version__ = "0.1.0"
