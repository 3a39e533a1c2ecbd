"""Our data-parallel stack on torch.distributed collectives: process groups (comm), DDP variants
(ddp, with bucketing as a pure function in buckets), ZeRO-1 optimizer sharding
(sharded_optimizer) and FSDP (fsdp). Everything degrades to plain single-process code at
world size 1, and runs on NCCL (CUDA) or gloo (CPU, and CUDA tensors staged by gloo).
"""
