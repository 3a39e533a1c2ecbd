"""The report's sections: the handout's problems in its order, one section each, then the toolkit's measurements.

Each reads frames from `common.Results` (one per result file, config keys as columns), adds tables, figures and
sentences computed from those rows to the document, and records what is missing. The sections live in one
module per area; this list is their order in the report.
"""

from cs336_systems.report.sections import (
    attention,
    distributed,
    kernels,
    leaderboard,
    memory,
    nsys_profile,
    profiling,
)
from cs336_systems.report.sections.implementations import implementation

# The handout's problems in its order (the 2025 guide's bucketed DDP and communication_accounting where that guide
# puts them), then the toolkit's own measurements.
SECTIONS = (
    profiling.benchmarking_script, nsys_profile.nsys_profile, profiling.mixed_precision_accumulation,
    profiling.benchmarking_mixed_precision, profiling.memory_profiling, memory.checkpointing_and_memory_model,
    attention.pytorch_attention, attention.compiled_attention, profiling.torch_compile_model,
    implementation("flash_forward"), implementation("flash_backward"), attention.flash_benchmarking,
    distributed.distributed_communication,
    implementation("naive_ddp"), distributed.naive_ddp_benchmarking, distributed.minimal_ddp_flat_benchmarking,
    implementation("ddp_overlap_individual_parameters"), distributed.ddp_overlap_individual_parameters_benchmarking,
    implementation("ddp_overlap_bucketed"), distributed.ddp_bucketed_benchmarking, distributed.communication_accounting,
    implementation("optimizer_state_sharding"), distributed.optimizer_state_sharding_accounting,
    implementation("fsdp"), distributed.fsdp_benchmarks, distributed.fsdp_accounting,
    distributed.alternate_ring_all_reduce, distributed.parallelism_calcs,
    leaderboard.leaderboard,
    attention.attention_tuning, kernels.fused_model_path, kernels.weight_copies, kernels.stack_profile,
    kernels.fused_cross_entropy, kernels.fused_ops,
)
