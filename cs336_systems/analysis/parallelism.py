"""FLOPs and communication of one FFN layer (x @ W_in @ W_out, W_in: D x F, W_out: F x D, no
activation) over B tokens, under data parallelism (DP), FSDP, tensor parallelism (TP, W_in split
by columns and W_out by rows, Megatron style) and FSDP x TP on an X x Y mesh.

Per layer, b bytes per element (2 for bf16/fp16), C FLOP/s per device, W bytes/s egress:
    FLOPs: forward 4 B D F (two matmuls), backward 8 B D F.
    DP over N:    forward no communication; backward all-reduce of the 2 D F gradient:
                  2 (N-1)/N * 2 D F b / W.
    FSDP over N:  forward all-gather of the weights, (N-1)/N * 2 D F b / W; backward all-gather
                  again plus reduce-scatter of the gradients: 2 x that.
    TP over N:    forward all-gather of x and reduce-scatter of the output, each (N-1)/N * B D b / W;
                  backward the same two on the gradients.
    FSDP x TP:    the FSDP terms on the X axis for a 1/Y weight shard, the TP terms on the Y axis for
                  a B/X batch.
Compute time is FLOPs / (N C). Communication *dominates* when it exceeds compute: with overlap,
when a phase's collectives outlast the compute they hide under; without overlap, when the step's
communication outlasts its compute. The largest device count before it dominates solves
comm(N) = compute(N) for N.
"""

from __future__ import annotations

import math

from cs336_systems.analysis.calculation import Calculation, positive

STRATEGIES = ("dp", "fsdp", "tp", "fsdp-tp")


def ffn_flops(tokens: float, d_model: float, d_ff: float) -> tuple[Calculation, Calculation]:
    inputs = dict(B=tokens, D=d_model, F=d_ff)
    return (Calculation("FLOPs_forward", "4 B D F", 4 * tokens * d_model * d_ff, "FLOP", inputs),
            Calculation("FLOPs_backward", "8 B D F", 8 * tokens * d_model * d_ff, "FLOP", inputs))


def ffn_costs(strategy: str, tokens: float, d_model: float, d_ff: float, devices: int, flops_per_s: float,
              bandwidth: float, bytes_per_element: int = 2, mesh: tuple[int, int] | None = None
              ) -> list[Calculation]:
    """Compute and communication times of forward and backward of one FFN layer under `strategy`."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    for name, value in (("tokens", tokens), ("d_model", d_model), ("d_ff", d_ff), ("flops_per_s", flops_per_s),
                        ("bandwidth", bandwidth)):
        positive(name, value)
    B, D, F, b, C, W = tokens, d_model, d_ff, bytes_per_element, flops_per_s, bandwidth
    if strategy == "fsdp-tp":
        if mesh is None or mesh[0] * mesh[1] != devices:
            raise ValueError(f"fsdp-tp needs mesh=(X, Y) with X*Y == devices ({devices}), got {mesh!r}")
        X, Y = mesh
    N = devices
    inputs = dict(B=B, D=D, F=F, b=b, C=C, W=W, N=N)
    fwd = 4 * B * D * F / (N * C)
    out = [Calculation("T_compute_forward", "4 B D F / (N C)", fwd, "s", inputs),
           Calculation("T_compute_backward", "8 B D F / (N C)", 2 * fwd, "s", inputs)]
    ring = (N - 1) / N
    if strategy == "dp":
        out += [Calculation("T_comm_forward", "0", 0.0, "s", inputs),
                Calculation("T_comm_backward", "2 (N-1)/N * 2 D F b / W", 2 * ring * 2 * D * F * b / W, "s", inputs)]
    elif strategy == "fsdp":
        gather = ring * 2 * D * F * b / W
        out += [Calculation("T_comm_forward", "(N-1)/N * 2 D F b / W", gather, "s", inputs),
                Calculation("T_comm_backward", "2 (N-1)/N * 2 D F b / W", 2 * gather, "s", inputs)]
    elif strategy == "tp":
        act = ring * B * D * b / W
        out += [Calculation("T_comm_forward", "2 (N-1)/N * B D b / W", 2 * act, "s", inputs),
                Calculation("T_comm_backward", "2 (N-1)/N * B D b / W", 2 * act, "s", inputs)]
    else:
        inputs = inputs | dict(X=X, Y=Y)
        gather = (X - 1) / X * 2 * D * F * b / (Y * W)
        act = (Y - 1) / Y * (B / X) * D * b / W
        out += [Calculation("T_comm_forward", "(X-1)/X * 2 D F b / (Y W) + 2 (Y-1)/Y * (B/X) D b / W",
                            gather + 2 * act, "s", inputs),
                Calculation("T_comm_backward", "2 (X-1)/X * 2 D F b / (Y W) + 2 (Y-1)/Y * (B/X) D b / W",
                            2 * gather + 2 * act, "s", inputs)]
    return out


def max_devices_before_comm_dominates(strategy: str, tokens: float, d_model: float, d_ff: float,
                                      flops_per_s: float, bandwidth: float, bytes_per_element: int = 2,
                                      overlapped: bool = True) -> Calculation:
    """Largest N (large-N limit, (N-1)/N -> 1) before communication dominates.

    Overlapped: each phase's communication must hide under that phase's compute (forward
    collectives under forward matmuls, backward under backward); the tighter phase binds.
    Not overlapped: the step's total communication must stay below its total compute (12 B D F / (N C)).
    DP:   backward 4 D F b / W vs 8 B D F / (N C)         -> N <= 2 B W / (b C); total: 3 B W / (b C).
    FSDP: forward 2 D F b / W vs 4 B D F / (N C), backward 4 D F b / W vs 8 B D F / (N C)
                                                           -> N <= 2 B W / (b C); total 6 D F b / W: the same.
    TP:   each phase 2 B D b / W vs 4 (or 8) B D F / (N C)  -> N <= 2 F W / (b C); total 4 B D b / W: 3 F W / (b C).
    """
    B, D, F, b, C, W = tokens, d_model, d_ff, bytes_per_element, flops_per_s, bandwidth
    inputs = dict(B=B, D=D, F=F, b=b, C=C, W=W, overlapped=overlapped)
    table = {  # strategy: (overlapped formula, value), (not overlapped formula, value)
        "dp": (("2 B W / (b C)", 2 * B * W / (b * C)), ("3 B W / (b C)", 3 * B * W / (b * C))),
        "fsdp": (("2 B W / (b C)", 2 * B * W / (b * C)), ("2 B W / (b C)", 2 * B * W / (b * C))),
        "tp": (("2 F W / (b C)", 2 * F * W / (b * C)), ("3 F W / (b C)", 3 * F * W / (b * C))),
    }
    if strategy not in table:
        raise ValueError(f"strategy must be dp, fsdp or tp for a device count, got {strategy!r}")
    formula, n = table[strategy][0 if overlapped else 1]
    return Calculation(f"N_max_{strategy}{'' if overlapped else '_no_overlap'}", formula, math.floor(n), "devices",
                       inputs)


def compute_bound_batch_fsdp_tp(d_ff: float, flops_per_s: float, bandwidth: float, fsdp: int, tp: int,
                                links_fsdp: int = 1, links_tp: int = 1, bytes_per_element: int = 2
                                ) -> list[Calculation]:
    """Forward pass of an FFN on an X (FSDP) x Y (TP) mesh: the per-device and overall batch (tokens)
    at which compute covers the FSDP all-gather (M_X links on that axis), and whether the TP
    collectives (M_Y links) are covered. From 4 B D F / (X Y C) >= 2 D F b / (Y W M_X):
    B/X >= b C / (2 W M_X); and from 4 B D F / (X Y C) >= 2 (B/X) D b / (W M_Y): Y <= 2 F W M_Y / (b C)."""
    C, W, X, Y, b = flops_per_s, bandwidth, fsdp, tp, bytes_per_element
    inputs = dict(C=C, W=W, X=X, Y=Y, M_X=links_fsdp, M_Y=links_tp, F=d_ff, b=b)
    per_group = b * C / (2 * W * links_fsdp)
    return [Calculation("B_per_device", "b C / (2 W M_X) / Y", per_group / Y, "tokens", inputs),
            Calculation("B_overall", "X * b C / (2 W M_X)", X * per_group, "tokens", inputs),
            Calculation("Y_max_tp", "2 F W M_Y / (b C)", 2 * d_ff * W * links_tp / (b * C), "devices", inputs)]
