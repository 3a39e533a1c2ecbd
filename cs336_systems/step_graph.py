"""A whole training step captured as CUDA graphs: the host launches two graphs a step instead of every kernel.

Why: at the sizes most people run (small at context 512, batch 4) a step is host-bound. Our kernels take 0.80x the
baseline's GPU time there, yet the steps are level, because Python, dispatch, dynamo's guard checks and the launches
take as long as the GPU's work (notes/model_sizes.md). torch.compile's reduce-overhead replays each compiled region
as a graph, but everything between the regions (the loss, the optimizer, autograd's engine) still runs on the host.
Captured whole, a step costs the host a replay; then the step takes the GPU's time.

    graphed = StepGraph([forward_backward, optimizer.step],
                        prepare=[lambda: optimizer.zero_grad(set_to_none=True), optimizer.prepare_capture])
    for batch in batches:
        tokens.copy_(batch)   # the graph reads its inputs from fixed tensors
        graphed()             # the first call warms up and captures; later calls replay

`parts` run in order, one graph each, sharing one memory pool: the forward and backward in the first, the optimizer
in the second, so that an optimizer which builds host-side tables from the gradients' addresses
(`FusedAdamW.prepare_capture`) can do so between the captures, once the captured backward has placed the gradients.
What the graph reads and writes stays at the addresses it had during the capture: inputs are copied into the tensors
the step reads; the gradients live in the graphs' pool (the step's own `zero_grad(set_to_none=True)` places them
there; drop the warm-up's in the first part's `prepare` too: freed inside the capture, they would stay in the
ordinary pool beside the graph's, one set of gradients more at the capture's peak); the optimizer's state must exist
before its capture (the warm-up steps make it). Outputs (a loss) are overwritten by the next replay.

Before capturing, `warmup` eager steps run on a side stream (torch.compile compiles, Triton autotunes, the allocator
settles there, as PyTorch's CUDA-graph notes ask). A step that synchronises with the host, or allocates pinned
memory, cannot be captured: CUDA raises during the capture.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

Part = Callable[[], object]


class StepGraph:
    """Call it like the step it captures: the first call runs `warmup` eager steps on a side stream, then captures
    each part as a CUDA graph (after that part's `prepare`, if any); every call after replays the graphs."""

    def __init__(self, parts: Sequence[Part], *, prepare: Sequence[Callable[[], object] | None] | None = None,
                 warmup: int = 3):
        if not parts:
            raise ValueError("StepGraph: parts must name at least one callable, got none")
        prepare = list(prepare) if prepare is not None else [None] * len(parts)
        if len(prepare) != len(parts):
            raise ValueError(f"StepGraph: prepare must have one entry (or None) per part: {len(parts)} parts, "
                             f"got {len(prepare)}")
        if warmup < 1:
            raise ValueError(f"StepGraph: warmup must be >= 1 (the capture needs compiled, autotuned code and the "
                             f"optimizer's state), got {warmup}")
        if not torch.cuda.is_available():
            raise RuntimeError("StepGraph: CUDA graphs need a CUDA device; none is available")
        self.parts, self.prepare, self.warmup = list(parts), prepare, warmup
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.outputs: list[object] = []  # what each part returned during its capture (rewritten by each replay)

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    def __call__(self) -> list[object]:
        """Run one step: (warm up and) capture on the first call, replay afterwards; returns the parts' outputs as
        they were captured (tensors whose contents the replay has just rewritten)."""
        if not self.graphs:
            self._capture()
        for graph in self.graphs:
            graph.replay()
        return self.outputs

    def _capture(self) -> None:
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                for part in self.parts:
                    part()
        current.wait_stream(side)
        torch.cuda.synchronize()
        pool = None
        graphs, outputs = [], []
        for part, prepare in zip(self.parts, self.prepare):
            if prepare is not None:
                prepare()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                outputs.append(part())
            pool = graph.pool()  # the next part's allocations share this graph's pool
            graphs.append(graph)
        self.graphs, self.outputs = graphs, outputs


def make_capturable(optimizer: torch.optim.Optimizer) -> Callable[[], object] | None:
    """Switch `optimizer` to its capturable form (device-side step counts); returns what to call before its step's
    capture (FusedAdamW's `prepare_capture`), or None. Refuses an optimizer that has no such form."""
    if hasattr(optimizer, "prepare_capture"):  # our FusedAdamW
        optimizer.capturable = True
        return optimizer.prepare_capture
    if "capturable" in optimizer.defaults:  # torch.optim's Adam, AdamW, SGD, ...
        for group in optimizer.param_groups:
            group["capturable"] = True
        return None
    raise ValueError(f"StepGraph: {type(optimizer).__module__}.{type(optimizer).__name__} has no capturable form (its "
                     "step reads host numbers a CUDA graph would freeze); use our FusedAdamW or torch's AdamW")
