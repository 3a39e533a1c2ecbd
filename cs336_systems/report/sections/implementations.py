"""Sections of the handout's implementation problems: where each lives in this toolkit and which tests pin it.

These problems are code, not measurements; `implementation(problem)` makes the section of one, placed in the
report at the problem's place in the handout (beside the benchmarks of the same code)."""

from __future__ import annotations

from cs336_systems.report.document import Document, Heading, Paragraph
from cs336_systems.report.sections.common import Results

# problem -> (title, what implements it, the tests that pin it)
IMPLEMENTATION_PROBLEMS = {
    "flash_forward": (
        "the FlashAttention-2 forward, in PyTorch and in Triton",
        "The tiled PyTorch forward (`kernels/flash_attention/reference.py`) and the Triton forward (`forward.py`: a "
        "grid of query tiles x batch-heads, one loop over key tiles, fp32 accumulators, the causal case split into "
        "an unmasked and a diagonal loop, exp2 with the scale folded in; tiles through tensor descriptors on "
        "Hopper, and the Gluon kernels of `hopper_forward.py`).",
        "tests/test_kernels_flash_attention.py, tests/test_adapters_attention.py, tests/test_kernels_flash_fuzz.py"),
    "flash_backward": (
        "the backward by recomputation",
        "D = rowsum(O * dO), then P recomputed from the saved L: the torch.compile'd PyTorch version "
        "(impl='compile'), the two-pass Triton backward (dK/dV over query tiles, dQ over key tiles, no atomics) and "
        "the one-pass kernels that add dQ into fp32 rows (`dispatch.choose_backward` picks one per device, dtype "
        "and head dim). In fp32 with fp32-accurate dots, a first pass forms each row's max and inverse sum and D = "
        "rowsum(P * dP), as PyTorch's softmax backward forms it, and P is recomputed from those instead of from L, "
        "whose rounding grows with its magnitude.",
        "tests/test_kernels_flash_attention.py, tests/test_kernels_flash_fuzz.py"),
    "naive_ddp": (
        "one all-reduce per parameter after the backward",
        "`parallel/ddp.py`: one base class whose variants differ only in how gradients are synchronised; the naive "
        "one all-reduces each parameter's gradient after the backward and averages it.",
        "tests/test_parallel_ddp.py, tests/test_adapters_parallel.py"),
    "ddp_overlap_individual_parameters": (
        "all-reduces started from gradient hooks",
        "`parallel/ddp.py`: a post-accumulate-grad hook per parameter starts an asynchronous all-reduce as soon as "
        "that gradient is ready; `finish_gradient_synchronization` waits on the handles and averages.",
        "tests/test_parallel_ddp.py, tests/test_adapters_parallel.py"),
    "ddp_overlap_bucketed": (
        "gradients all-reduced in buckets as they fill",
        "`parallel/ddp.py` with `parallel/buckets.py` (a pure function filling buckets of at most the given size "
        "in reverse parameter order, the order the backward produces gradients): a bucket's all-reduce of one flat "
        "buffer starts when its last gradient arrives.",
        "tests/test_parallel_ddp.py, tests/test_adapters_parallel.py"),
    "optimizer_state_sharding": (
        "each rank keeps the optimizer state of the parameters it owns (ZeRO-1)",
        "`parallel/sharded_optimizer.py`: every parameter gets one owner rank; each rank steps the parameters it "
        "owns with the wrapped optimizer, then receives the others from their owners (one flat broadcast per owner "
        "and dtype).",
        "tests/test_parallel_sharded_optimizer.py, tests/test_adapters_parallel.py"),
    "fsdp": (
        "fully-sharded data parallel",
        "`parallel/fsdp.py`: every Linear and Embedding weight cut into row shards kept on the original modules "
        "(norms stay replicated); units all-gathered one ahead (cast to compute_dtype before they are sent), the "
        "full weights freed after use, weight gradients reduce-scattered onto the fp32 master shards.",
        "tests/test_parallel_fsdp.py, tests/test_adapters_parallel.py"),
}


def implementation(problem: str):
    """The section of one implementation problem: its heading, what implements it and which tests pin it."""
    title, implemented_by, tests = IMPLEMENTATION_PROBLEMS[problem]

    def section(doc: Document, r: Results) -> None:
        doc.add(Heading(f"{problem}: {title}"))
        doc.add(Paragraph(implemented_by))
        doc.add(Paragraph(f"Pinned by {tests} (kernels against an fp64 reference with error budgets from PyTorch's "
                          "own low-precision error; distributed code against one process, on gloo). Run them with "
                          "`python -m pytest`."))

    section.__name__ = problem
    return section
