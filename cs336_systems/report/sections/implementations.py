"""Section: where each implementation problem of the handout lives in this toolkit and its tests."""

from __future__ import annotations

import pandas as pd

from cs336_systems.report.document import Document, Heading, Paragraph, Table
from cs336_systems.report.sections.common import Results

IMPLEMENTATION_PROBLEMS = (
    ("flash_forward", "Tiled PyTorch FlashAttention-2 forward (`kernels/flash_attention/reference.py`) and the Triton "
     "forward (`forward.py`: grid of query tiles x batch-heads, one loop over key tiles, fp32 accumulators, causal "
     "split into an unmasked and a diagonal loop, exp2 with the scale folded in; tiles through tensor "
     "descriptors on Hopper).",
     "tests/test_kernels_flash_attention.py, tests/test_adapters_attention.py"),
    ("flash_backward", "Backward by recomputation with D = rowsum(O * dO): the torch.compile'd PyTorch version "
     "(impl='compile') and the two-pass Triton backward (dK/dV over query tiles, dQ over key tiles, no atomics).",
     "tests/test_kernels_flash_attention.py"),
    ("naive_ddp, minimal_ddp_flat, ddp_overlap_individual_parameters, ddp_overlap_bucketed",
     "`parallel/ddp.py`: one base class, variants differing only in gradient synchronisation; buckets in "
     "`parallel/buckets.py` (a pure function).", "tests/test_parallel_ddp.py, tests/test_adapters_parallel.py"),
    ("optimizer_state_sharding", "`parallel/sharded_optimizer.py`: ZeRO-1 (each rank steps the parameters it owns, "
     "then broadcasts them).", "tests/test_parallel_sharded_optimizer.py"),
    ("fsdp", "`parallel/fsdp.py`: parameters sharded on the original modules, all-gathered one unit ahead, "
     "gradients reduce-scattered.", "tests/test_parallel_fsdp.py"),
)


def implementations(doc: Document, r: Results) -> None:
    doc.add(Heading("Implementation problems: what checks them"))
    doc.add(Paragraph("These problems are code, not measurements; each is pinned by tests (kernels against an "
                      "fp64 reference with error budgets of 2x PyTorch's own low-precision error; distributed code "
                      "against a single process on gloo). Run them with `python -m pytest`."))
    doc.add(Table(pd.DataFrame(IMPLEMENTATION_PROBLEMS, columns=["problem", "implementation", "tests"])))
