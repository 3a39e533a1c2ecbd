"""Saved-tensor accounting: every tensor autograd keeps for backward, and who saved it.

`with SavedTensorLog(model) as log: loss = model(x)...` records, through
`torch.autograd.graph.saved_tensors_hooks`, each saved tensor's shape, dtype and bytes, the
torch function that saved it (tracked with a TorchFunctionMode around each call) and the
innermost module it was saved in (forward pre/post hooks). Parameters are left out (they are
not activations), and a storage saved several times (a view saved by two ops) counts once.
`summary()` gives the total, per-module totals and the top operations with their share.

The tensors themselves are returned to autograd unchanged: this measures, it does not move.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode


@dataclass(frozen=True)
class SavedRecord:
    shape: tuple[int, ...]
    dtype: str
    bytes: int  # 0 when its storage was already counted
    op: str
    module: str


class _OpTracker(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.stack: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.stack.append(getattr(func, "__name__", str(func)))
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.stack.pop()


class SavedTensorLog:
    def __init__(self, model: nn.Module | None = None):
        self.model = model
        self.records: list[SavedRecord] = []
        self._seen_storages: set[int] = set()
        self._parameter_ptrs: set[int] = set()
        self._module_stack: list[str] = []
        self._handles = []
        self._ops = _OpTracker()

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._parameter_ptrs:
            fresh = ptr not in self._seen_storages
            self._seen_storages.add(ptr)
            self.records.append(SavedRecord(
                shape=tuple(tensor.shape), dtype=str(tensor.dtype).removeprefix("torch."),
                bytes=storage.nbytes() if fresh else 0,
                op=self._ops.stack[-1] if self._ops.stack else "(autograd)",
                module=self._module_stack[-1] if self._module_stack else "(top)"))
        return tensor

    def _enter_module(self, label: str):
        def hook(module, args):
            self._module_stack.append(label)  # returns None: the input is left alone
        return hook

    def _leave_module(self, module, args, output) -> None:
        self._module_stack.pop()  # a forward hook that returned a value would replace the output

    def __enter__(self) -> SavedTensorLog:
        # (read here, not when the log is made: `apply_fused_kernels` may have moved the parameters in between)
        parameters = self.model.parameters() if self.model is not None else ()
        self._parameter_ptrs = {p.untyped_storage().data_ptr() for p in parameters}
        if self.model is not None:
            for name, module in self.model.named_modules():
                label = name or type(module).__name__
                self._handles.append(module.register_forward_pre_hook(self._enter_module(label)))
                self._handles.append(module.register_forward_hook(self._leave_module))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        self._ops.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ops.__exit__(*exc)
        self._hooks.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @property
    def total_bytes(self) -> int:
        return sum(r.bytes for r in self.records)

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame([r.__dict__ for r in self.records], columns=["shape", "dtype", "bytes", "op", "module"])

    def summary(self, top: int = 10, module_depth: int | None = None) -> dict[str, pd.DataFrame | int]:
        """total bytes; bytes per module (cut to `module_depth` name parts); the top ops by bytes."""
        frame = self.frame()
        if module_depth is not None:
            frame["module"] = [".".join(m.split(".")[:module_depth]) for m in frame["module"]]
        per_module = frame.groupby("module", sort=False)["bytes"].sum().reset_index()
        ops = frame.groupby("op")["bytes"].agg(["sum", "size"]).rename(columns={"sum": "bytes", "size": "tensors"})
        ops = ops.sort_values("bytes", ascending=False).head(top).reset_index()
        total = int(frame["bytes"].sum())
        ops["share"] = ops["bytes"] / total if total else 0.0
        return {"total_bytes": total, "per_module": per_module, "top_ops": ops}
