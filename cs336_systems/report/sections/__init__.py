"""The report's sections, one function per handout problem (or toolkit measurement), in the order they appear.

Each reads frames from `common.Results` (one per result file, config keys as columns), adds tables, figures and
sentences computed from those rows to the document, and records what is missing. The sections live in one
module per area; this list is their order in the report.
"""

from cs336_systems.report.sections import (
    attention,
    distributed,
    implementations,
    kernels,
    leaderboard,
    memory,
    nsys_profile,
    profiling,
)

SECTIONS = (profiling.benchmarking_script, nsys_profile.nsys_profile, profiling.mixed_precision_accumulation,
            profiling.memory_profiling, attention.attention_benchmarks, attention.attention_tuning,
            profiling.torch_compile_model, memory.checkpointing_and_memory_model, distributed.distributed_communication,
            distributed.alternate_ring_all_reduce,
            distributed.ddp, distributed.sharding_and_fsdp, distributed.fsdp_accounting,
            distributed.parallelism_calcs,
            distributed.communication_accounting,
            kernels.fused_model_path, kernels.stack_profile, kernels.fused_cross_entropy, kernels.fused_ops,
            leaderboard.leaderboard,
            implementations.implementations)
