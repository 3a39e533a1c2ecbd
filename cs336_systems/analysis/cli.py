"""`cs336-analyze`: the calculators from the command line, each printing formula and value (or --json).

    cs336-analyze collective --kind all --size 1e9 --devices 8 --bandwidth 4.5e11
    cs336-analyze ffn --strategy all --tokens 65536 --devices 64
    cs336-analyze memory                      # the handout's XXL model on 80 GB devices, then FSDP to fit 95 GB
    cs336-analyze mesh-batch                  # TPU v5p numbers, X=16 FSDP x Y=4 TP, M_X=2, M_Y=1
    cs336-analyze bucket --model-bytes 8e9 --bandwidth 1e11 --call-overhead 5e-5
"""

from __future__ import annotations

import argparse
import json
import sys

from cs336_systems.analysis import collectives, ddp_overhead, memory, parallelism
from cs336_systems.analysis.calculation import Calculation

# The handout's XXL model and TPU v5p figures (from the TPU scaling book, as the handout quotes them).
XXL = dict(d_model=16384, d_ff=53248, num_blocks=126)
V5P_FLOPS, V5P_ICI = 4.6e14, 2 * 9e10
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"got {value}; must be > 0")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"got {value}; must be >= 1")
    return value


def _mesh(text: str) -> tuple[int, int]:
    try:
        x, y = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--mesh: expected X,Y (e.g. 16,4), got {text!r}") from None
    return x, y


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cs336-analyze", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print the calculations as JSON")
    sub = parser.add_subparsers(dest="calculator", required=True)

    p = sub.add_parser("collective", help="ring all-gather / reduce-scatter / all-reduce times")
    p.add_argument("--kind", choices=[*collectives.COLLECTIVES, "all"], default="all",
                   help="which collective (default: all)")
    p.add_argument("--size", type=_positive_float, required=True, help="V: array bytes (full size)")
    p.add_argument("--devices", type=_positive_int, required=True, help="N")
    p.add_argument("--bandwidth", type=_positive_float, required=True, help="W: egress bytes/s per device")
    p.add_argument("--alpha", type=float, default=0.0, help="per-step latency, seconds (default 0)")

    p = sub.add_parser("ffn", help="FFN layer FLOPs and communication under DP, FSDP, TP, FSDP x TP")
    p.add_argument("--strategy", choices=[*parallelism.STRATEGIES, "all"], default="all",
                   help="which parallelism (default: all)")
    p.add_argument("--tokens", type=_positive_float, default=65536, help="B: tokens in the global batch")
    p.add_argument("--d-model", type=_positive_int, default=XXL["d_model"], help="D (default: the handout's XXL)")
    p.add_argument("--d-ff", type=_positive_int, default=XXL["d_ff"], help="F (default: the handout's XXL)")
    p.add_argument("--devices", type=_positive_int, default=64, help="N (default 64)")
    p.add_argument("--mesh", type=_mesh, default=None, help="X,Y for fsdp-tp (default 16,4 when N=64)")
    p.add_argument("--flops", type=_positive_float, default=V5P_FLOPS, help="C: FLOP/s per device (v5p)")
    p.add_argument("--bandwidth", type=_positive_float, default=V5P_ICI, help="W: bytes/s (v5p ICI)")
    p.add_argument("--dtype", choices=list(BYTES), default="bf16", help="bytes per value (default bf16)")

    p = sub.add_parser("memory", help="training-state memory of the XXL-style FFN stack and FSDP shards to fit")
    p.add_argument("--d-model", type=_positive_int, default=XXL["d_model"], help="D (default: the handout's XXL)")
    p.add_argument("--d-ff", type=_positive_int, default=XXL["d_ff"], help="F (default: the handout's XXL)")
    p.add_argument("--num-blocks", type=_positive_int, default=XXL["num_blocks"],
                   help="FFN blocks (default: the handout's XXL)")
    p.add_argument("--tokens", type=_positive_int, default=1, help="tokens whose activations are saved (default 1)")
    p.add_argument("--device-gb", type=_positive_float, default=80, help="device memory for the count (80: H100)")
    p.add_argument("--fsdp-device-gb", type=_positive_float, default=95, help="per-device budget for N_FSDP (v5p)")
    p.add_argument("--sharded-activations", type=float, default=0.5, help="fraction of activations sharded")

    p = sub.add_parser("mesh-batch", help="compute-bound batch of an FFN on an FSDP x TP mesh (forward)")
    p.add_argument("--d-ff", type=_positive_int, default=XXL["d_ff"], help="F (default: the handout's XXL)")
    p.add_argument("--flops", type=_positive_float, default=V5P_FLOPS, help="C: FLOP/s per device (v5p)")
    p.add_argument("--bandwidth", type=_positive_float, default=V5P_ICI, help="W: bytes/s per link (v5p ICI)")
    p.add_argument("--fsdp", type=_positive_int, default=16, help="X")
    p.add_argument("--tp", type=_positive_int, default=4, help="Y")
    p.add_argument("--links-fsdp", type=_positive_int, default=2, help="M_X")
    p.add_argument("--links-tp", type=_positive_int, default=1, help="M_Y")
    p.add_argument("--dtype", choices=list(BYTES), default="bf16", help="bytes per value (default bf16)")

    p = sub.add_parser("bucket", help="DDP overhead after backward and the optimal bucket size")
    p.add_argument("--model-bytes", type=_positive_float, required=True, help="s")
    p.add_argument("--bandwidth", type=_positive_float, required=True, help="w: all-reduce algorithm bandwidth B/s")
    p.add_argument("--call-overhead", type=_positive_float, required=True, help="o: seconds per all-reduce call")
    p.add_argument("--buckets", type=_positive_int, default=None, help="also evaluate this n_b")
    return parser


def calculate(args) -> list[Calculation]:
    if args.calculator == "collective":
        kinds = collectives.COLLECTIVES if args.kind == "all" else (args.kind,)
        return [collectives.collective_time(k, args.size, args.devices, args.bandwidth, args.alpha) for k in kinds]
    if args.calculator == "ffn":
        b = BYTES[args.dtype]
        out = list(parallelism.ffn_flops(args.tokens, args.d_model, args.d_ff))
        strategies = parallelism.STRATEGIES if args.strategy == "all" else (args.strategy,)
        for strategy in strategies:
            mesh = args.mesh
            if strategy == "fsdp-tp" and mesh is None:
                mesh = (args.devices // 4, 4) if args.devices % 4 == 0 else (args.devices, 1)
            for calc in parallelism.ffn_costs(strategy, args.tokens, args.d_model, args.d_ff, args.devices,
                                              args.flops, args.bandwidth, b, mesh):
                out.append(Calculation(f"{strategy}: {calc.name}", calc.formula, calc.value, calc.unit, calc.inputs))
            if strategy == "fsdp-tp":
                for overlapped in (True, False):
                    out += parallelism.max_devices_fsdp_tp(args.tokens, args.d_ff, args.flops, args.bandwidth, b,
                                                           overlapped)
            else:
                for phase in ("forward", "backward") if strategy != "dp" else ("backward",):
                    out.append(parallelism.max_devices_before_comm_dominates(
                        strategy, args.tokens, args.d_model, args.d_ff, args.flops, args.bandwidth, b, phase))
        return out
    if args.calculator == "memory":
        state = memory.training_state(args.d_model, args.d_ff, args.num_blocks, args.tokens, args.device_gb * 1e9)
        by_name = {c.name: c.value for c in state}
        return state + memory.fsdp_shards_to_fit(by_name["state_total"], by_name["activations"],
                                                 args.fsdp_device_gb * 1e9, args.sharded_activations)
    if args.calculator == "mesh-batch":
        return parallelism.compute_bound_batch_fsdp_tp(args.d_ff, args.flops, args.bandwidth, args.fsdp, args.tp,
                                                       args.links_fsdp, args.links_tp, BYTES[args.dtype])
    out = ddp_overhead.optimal_bucket(args.model_bytes, args.bandwidth, args.call_overhead)
    if args.buckets:
        out.append(ddp_overhead.ddp_overhead(args.model_bytes, args.bandwidth, args.call_overhead, args.buckets))
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        results = calculate(args)
    except ValueError as error:
        print(f"cs336-analyze {args.calculator}: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([c.as_dict() for c in results], indent=2))
    else:
        for calc in results:
            print(calc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
