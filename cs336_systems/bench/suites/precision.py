"""The `precision` suite: the handout's mixed-precision exercises, computed by running them.

1. Four accumulation loops of 1000 x 0.01: fp32 += fp32, fp16 += fp16, fp32 += fp16, and
   fp32 += fp16 upcast first. 2. A toy model (Linear -> ReLU -> LayerNorm -> Linear) under
   autocast: the dtypes of its parameters, fc1 output, layer-norm output, logits, loss and
   gradients.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from cs336_systems.bench.common import DTYPES, add_common_arguments, print_tables
from cs336_systems.results import ResultStore, rows_to_frame


class ToyModel(nn.Module):
    def __init__(self, in_features: int = 16, out_features: int = 4):
        super().__init__()
        self.fc1 = nn.Linear(in_features, 10, bias=False)
        self.ln = nn.LayerNorm(10)
        self.fc2 = nn.Linear(10, out_features, bias=False)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.fc2(self.ln(self.relu(self.fc1(x))))


# The handout's four loops: (name, accumulator dtype, addend dtype, addend cast to fp32 before the add).
ACCUMULATION_LOOPS = (("fp32 += fp32", torch.float32, torch.float32, False),
                      ("fp16 += fp16", torch.float16, torch.float16, False),
                      ("fp32 += fp16", torch.float32, torch.float16, False),
                      ("fp32 += fp16.to(fp32)", torch.float32, torch.float16, True))


def accumulation_loops() -> dict[str, float]:
    """The four loops, 1000 additions of 0.01 each; the exact answer is 10."""
    results = {}
    for name, accumulator, addend, cast in ACCUMULATION_LOOPS:
        s = torch.tensor(0, dtype=accumulator)
        for _ in range(1000):
            x = torch.tensor(0.01, dtype=addend)
            s += x.type(torch.float32) if cast else x
        results[name] = s.item()
    return results


def autocast_dtypes(device: torch.device, dtype: torch.dtype) -> dict[str, str]:
    """Run ToyModel once under autocast and report the dtype of each named tensor."""
    torch.manual_seed(0)
    model = ToyModel().to(device)
    seen: dict[str, torch.dtype] = {}
    model.fc1.register_forward_hook(lambda m, i, o: seen.__setitem__("fc1 output", o.dtype))
    model.ln.register_forward_hook(lambda m, i, o: seen.__setitem__("layer-norm output", o.dtype))
    x = torch.randn(8, 16, device=device)
    with torch.autocast(device_type=device.type, dtype=dtype):
        seen["parameters"] = model.fc1.weight.dtype
        logits = model(x)
        seen["logits"] = logits.dtype
        loss = nn.functional.cross_entropy(logits, torch.randint(0, 4, (8,), device=device))
        seen["loss"] = loss.dtype
    loss.backward()
    seen["gradients"] = model.fc1.weight.grad.dtype
    return {name: str(d).removeprefix("torch.") for name, d in seen.items()}


def add_arguments(parser) -> None:
    parser.add_argument("--autocast-dtype", choices=["fp16", "bf16"], default=None,
                        help="autocast dtype for the toy model (default: fp16 on CUDA, bf16 on CPU)")
    add_common_arguments(parser)


def run(args) -> int:
    device = args.device
    dtype_name = args.autocast_dtype or ("fp16" if device.type == "cuda" else "bf16")
    store = ResultStore("precision", device, args.results_dir)
    for loop, value in accumulation_loops().items():
        store.add(provider="torch", config={"exercise": "accumulation", "loop": loop}, metric="sum", unit="",
                  value=value)
    for tensor, dtype in autocast_dtypes(device, DTYPES[dtype_name]).items():
        store.add(provider="torch", config={"exercise": "autocast", "autocast": dtype_name, "tensor": tensor},
                  metric="dtype", unit="", value=None, message=dtype)
    frame = rows_to_frame(store.rows)
    loops = frame[frame["exercise"] == "accumulation"][["loop", "median"]].rename(columns={"median": "sum (exact 10)"})
    casts = frame[frame["exercise"] == "autocast"][["tensor", "message"]].rename(
        columns={"message": f"dtype under {dtype_name} autocast"})
    print_tables(store, args, (None, loops), (None, casts))
    return 0
