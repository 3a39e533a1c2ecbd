"""FLOPs and communication of the handout's FFN (section 8: x1 = x W1, x2 = x W2, z = f(x1) * x2, y = z W3 with
W1, W2 of shape (D, F) and W3 of shape (F, D)) over B tokens, under data parallelism (DP), FSDP, tensor
parallelism (TP: W1, W2 column parallel, W3 row parallel) and FSDP x TP on an N_FSDP x N_TP mesh; the answers
of problems data_parallel_calcs, fsdp_calcs, tp_calcs and fsdp_tp_calcs, as formulas and as numbers.

The handout's cost model: ring all-gather and reduce-scatter of S bytes take (N-1)/N * S / W, an all-reduce twice
that; b bytes per value (2: fp16), C FLOP/s per device, W bytes/s egress; non-matmul work ignored.
    FLOPs:   forward 3 matmuls of 2 B D F = 6 B D F; backward two products per matmul = 12 B D F; per device / N.
    DP:      backward all-reduce of the gradients of the 3 D F weights: 2 (N-1)/N * 3 D F b / W.
    FSDP:    forward all-gather of the weights, (N-1)/N * 3 D F b / W; backward all-gather again and
             reduce-scatter of the gradients: 2 (N-1)/N * 3 D F b / W.
    TP:      forward all-reduce of y (B x D), 2 (N-1)/N * B D b / W; backward all-reduce of dx, the same.
    FSDP x TP (forward; X = N_FSDP, Y = N_TP): all-gather of a 1/Y weight shard over X, (X-1)/X * 3 D F b / (Y W),
             and all-reduce of the (B/X) x D output over Y, 2 (Y-1)/Y * (B/X) D b / W; overlapped, the larger.
Communication is the bottleneck when it outlasts the compute it overlaps; the device limits take the large-N
limit ((N-1)/N -> 1).
"""

from __future__ import annotations

import math

from cs336_systems.analysis.calculation import Calculation, positive

STRATEGIES = ("dp", "fsdp", "tp", "fsdp-tp")

# tp_calcs (a): the backward of the TP strategy on device i, given dy (B x D) replicated on every device.
TP_BACKWARD = (
    "dz(i)  = dy W3(i)^T                                  (B x F/N)",
    "dW3(i) = z(i)^T dy                                   (F/N x D)",
    "dx2(i) = dz(i) * f(x1(i))",
    "dx1(i) = dz(i) * x2(i) * f'(x1(i))",
    "dW1(i) = x^T dx1(i),   dW2(i) = x^T dx2(i)           (D x F/N)",
    "dx     = all-reduce_i( dx1(i) W1(i)^T + dx2(i) W2(i)^T )   (B x D)",
)


def ffn_flops(tokens: float, d_model: float, d_ff: float, devices: int = 1) -> tuple[Calculation, Calculation]:
    """(forward, backward) matmul FLOPs per device of the FFN over `tokens`, split over `devices` (any strategy here
    splits the work evenly)."""
    inputs = dict(B=tokens, D=d_model, F=d_ff, N=devices)
    per = "" if devices == 1 else " / N"
    return (Calculation("FLOPs_forward", f"6 B D F{per}", 6 * tokens * d_model * d_ff / devices, "FLOP", inputs),
            Calculation("FLOPs_backward", f"12 B D F{per}", 12 * tokens * d_model * d_ff / devices, "FLOP", inputs))


def ffn_costs(strategy: str, tokens: float, d_model: float, d_ff: float, devices: int, flops_per_s: float,
              bandwidth: float, bytes_per_element: int = 2, mesh: tuple[int, int] | None = None
              ) -> list[Calculation]:
    """Compute and communication times of the FFN's forward and backward under `strategy` (fsdp-tp: mesh=(X, Y))."""
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
    fwd = 6 * B * D * F / (N * C)
    out = [Calculation("T_compute_forward", "6 B D F / (N C)", fwd, "s", inputs),
           Calculation("T_compute_backward", "12 B D F / (N C)", 2 * fwd, "s", inputs)]
    ring = (N - 1) / N
    if strategy == "dp":
        out += [Calculation("T_comm_forward", "0", 0.0, "s", inputs),
                Calculation("T_comm_backward", "2 (N-1)/N * 3 D F b / W", 2 * ring * 3 * D * F * b / W, "s", inputs)]
    elif strategy == "fsdp":
        gather = ring * 3 * D * F * b / W
        out += [Calculation("T_comm_forward", "(N-1)/N * 3 D F b / W", gather, "s", inputs),
                Calculation("T_comm_backward", "2 (N-1)/N * 3 D F b / W", 2 * gather, "s", inputs)]
    elif strategy == "tp":
        reduce = 2 * ring * B * D * b / W
        out += [Calculation("T_comm_forward", "2 (N-1)/N * B D b / W", reduce, "s", inputs),
                Calculation("T_comm_backward", "2 (N-1)/N * B D b / W", reduce, "s", inputs)]
    else:
        inputs = inputs | dict(X=X, Y=Y)
        gather = (X - 1) / X * 3 * D * F * b / (Y * W)
        reduce = 2 * (Y - 1) / Y * (B / X) * D * b / W
        out += [Calculation("T_comm_forward_fsdp_axis", "(X-1)/X * 3 D F b / (Y W)", gather, "s", inputs),
                Calculation("T_comm_forward_tp_axis", "2 (Y-1)/Y * (B/X) D b / W", reduce, "s", inputs),
                Calculation("T_comm_forward", "max(FSDP axis, TP axis)", max(gather, reduce), "s", inputs)]
    return out


def max_devices_before_comm_dominates(strategy: str, tokens: float, d_model: float, d_ff: float,
                                      flops_per_s: float, bandwidth: float, bytes_per_element: int = 2,
                                      phase: str = "backward") -> Calculation:
    """Largest N (large-N limit) before the `phase`'s communication outlasts its compute:
    DP backward: 6 D F b / W <= 12 B D F / (N C)       -> N <= 2 B W / (b C)   (the forward communicates nothing)
    FSDP forward: 3 D F b / W <= 6 B D F / (N C)       -> N <= 2 B W / (b C); backward 6 D F b / W vs 12 B D F /
                                                          (N C): the same bound
    TP forward: 2 B D b / W <= 6 B D F / (N C)         -> N <= 3 F W / (b C); backward 2 B D b / W vs 12 B D F /
                                                          (N C): N <= 6 F W / (b C)."""
    if phase not in ("forward", "backward"):
        raise ValueError(f"phase must be forward or backward, got {phase!r}")
    B, D, F, b, C, W = tokens, d_model, d_ff, bytes_per_element, flops_per_s, bandwidth
    inputs = dict(B=B, D=D, F=F, b=b, C=C, W=W)
    table = {
        ("dp", "backward"): ("2 B W / (b C)", 2 * B * W / (b * C)),
        ("fsdp", "forward"): ("2 B W / (b C)", 2 * B * W / (b * C)),
        ("fsdp", "backward"): ("2 B W / (b C)", 2 * B * W / (b * C)),
        ("tp", "forward"): ("3 F W / (b C)", 3 * F * W / (b * C)),
        ("tp", "backward"): ("6 F W / (b C)", 6 * F * W / (b * C)),
    }
    if (strategy, phase) not in table:
        raise ValueError(f"no device limit for {strategy!r} in the {phase}: allowed dp backward, fsdp or tp either")
    formula, n = table[(strategy, phase)]
    return Calculation(f"N_max_{strategy}_{phase}", formula, math.floor(n), "devices", inputs)


def max_devices_fsdp_tp(tokens: float, d_ff: float, flops_per_s: float, bandwidth: float,
                        bytes_per_element: int = 2, overlapped: bool = True) -> list[Calculation]:
    """fsdp_tp_calcs (c) and (d): the largest N = X Y (X = N_FSDP, Y = N_TP) before the forward is communication
    bound, at the best split, with the split itself.
    Overlapped axes: each axis on its own, 3 D F b / (Y W) <= 6 B D F / (X Y C) -> X <= 2 B W / (b C), and
    2 (B/X) D b / W <= 6 B D F / (X Y C) -> Y <= 3 F W / (b C); so N <= 6 B F W^2 / (b^2 C^2).
    Shared links: the sum, 3 D F b / (Y W) + 2 B D b / (X W) <= 6 B D F / (X Y C), i.e. 3 F X + 2 B Y <= K with
    K = 6 B F W / (b C); for a given N = X Y the left side is smallest at 3 F X = 2 B Y (AM-GM: it is then
    2 sqrt(6 B F N)), so N <= K^2 / (24 B F) = 3 B F W^2 / (2 b^2 C^2), a quarter of the overlapped bound."""
    B, F, b, C, W = tokens, d_ff, bytes_per_element, flops_per_s, bandwidth
    for name, value in (("tokens", B), ("d_ff", F), ("flops_per_s", C), ("bandwidth", W)):
        positive(name, value)
    inputs = dict(B=B, F=F, b=b, C=C, W=W, overlapped=overlapped)
    if overlapped:
        x, y = 2 * B * W / (b * C), 3 * F * W / (b * C)
        return [Calculation("N_FSDP_max", "2 B W / (b C)", x, "devices", inputs),
                Calculation("N_TP_max", "3 F W / (b C)", y, "devices", inputs),
                Calculation("N_max", "6 B F W^2 / (b^2 C^2)", x * y, "devices", inputs)]
    k = 6 * B * F * W / (b * C)
    x, y = k / (6 * F), k / (4 * B)  # 3 F X = 2 B Y = K / 2
    return [Calculation("N_FSDP_best", "K / (6 F) = B W / (b C)", x, "devices", inputs),
            Calculation("N_TP_best", "K / (4 B) = 3 F W / (2 b C)", y, "devices", inputs),
            Calculation("N_max_shared_links", "3 B F W^2 / (2 b^2 C^2)", k * k / (24 * B * F), "devices", inputs)]


def compute_bound_batch_fsdp_tp(d_ff: float, flops_per_s: float, bandwidth: float, fsdp: int, tp: int,
                                links_fsdp: int = 1, links_tp: int = 1, bytes_per_element: int = 2
                                ) -> list[Calculation]:
    """communication_accounting (c), the 2025 guide's XXL block of two linear layers (forward 4 B D F) on an
    X (FSDP) x Y (TP) mesh: the per-device and overall batch (tokens) at which compute covers the FSDP all-gather
    (M_X links on that axis), and whether the TP collectives (M_Y links) are covered. From
    4 B D F / (X Y C) >= 2 D F b / (Y W M_X): B/X >= b C / (2 W M_X); and from 4 B D F / (X Y C) >=
    2 (B/X) D b / (W M_Y): Y <= 2 F W M_Y / (b C)."""
    C, W, X, Y, b = flops_per_s, bandwidth, fsdp, tp, bytes_per_element
    inputs = dict(C=C, W=W, X=X, Y=Y, M_X=links_fsdp, M_Y=links_tp, F=d_ff, b=b)
    per_group = b * C / (2 * W * links_fsdp)
    return [Calculation("B_per_device", "b C / (2 W M_X) / Y", per_group / Y, "tokens", inputs),
            Calculation("B_overall", "X * b C / (2 W M_X)", X * per_group, "tokens", inputs),
            Calculation("Y_max_tp", "2 F W M_Y / (b C)", 2 * d_ff * W * links_tp / (b * C), "devices", inputs)]
