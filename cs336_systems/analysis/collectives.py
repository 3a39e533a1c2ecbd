"""Collective times in the bandwidth model: N devices on a ring, each sending at W bytes/s
(egress), an array of V bytes (its full size, as every device holds it after an all-gather).

Ring reduce-scatter / all-gather: N - 1 steps, each moving a V/N chunk per device:
    T = (N - 1) / N * V / W.
Ring all-reduce = reduce-scatter then all-gather: T = 2 (N - 1) / N * V / W.
The alternate ring all-reduce (each device passes its whole running sum around the ring, no
chunking): N - 1 steps of V bytes, T = (N - 1) * V / W: about N/2 times slower than the
chunked ring for large N, which is why NCCL chunks.
An optional per-step latency `alpha` (seconds) adds (steps) * alpha: the latency-bound regime
of small messages.
"""

from __future__ import annotations

from cs336_systems.analysis.calculation import Calculation, positive

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-reduce-alternate")


def collective_time(kind: str, size_bytes: float, devices: int, bandwidth: float, alpha: float = 0.0
                    ) -> Calculation:
    """Time of one ring collective of `size_bytes` over `devices` at `bandwidth` bytes/s egress."""
    if kind not in COLLECTIVES:
        raise ValueError(f"collective must be one of {', '.join(COLLECTIVES)}, got {kind!r}")
    positive("size_bytes", size_bytes)
    positive("bandwidth", bandwidth)
    if not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices must be a positive int, got {devices!r}")
    n, v, w = devices, size_bytes, bandwidth
    if kind in ("all-gather", "reduce-scatter"):
        steps, per_step, formula = n - 1, v / n, "(N-1)/N * V/W"
    elif kind == "all-reduce":
        steps, per_step, formula = 2 * (n - 1), v / n, "2(N-1)/N * V/W"
    else:
        steps, per_step, formula = n - 1, v, "(N-1) * V/W"
    if alpha:
        formula += f" + {'2(N-1)' if kind == 'all-reduce' else '(N-1)'} * alpha"
    value = steps * per_step / w + steps * alpha
    return Calculation(f"T_{kind}", formula, value, "s", dict(N=n, V=v, W=w, alpha=alpha))


def bus_bandwidth(kind: str, size_bytes: float, devices: int, seconds: float) -> Calculation:
    """NCCL-tests' bus bandwidth: algorithm bandwidth V/T times the ring factor, comparable across N."""
    factor = {"all-gather": (devices - 1) / devices, "reduce-scatter": (devices - 1) / devices,
              "all-reduce": 2 * (devices - 1) / devices}[kind]
    return Calculation(f"busbw_{kind}", "V/T * factor(N)", size_bytes / seconds * factor, "B/s",
                       dict(V=size_bytes, N=devices, T=seconds, factor=factor))
