"""DDP's communication overhead after backward, with gradients in n_b equal buckets.

Model (the handout's assumptions: computing a bucket's gradients takes as long as communicating
it): buckets overlap with backward except the last one, whose all-reduce starts when backward
ends; every all-reduce call costs a fixed overhead o on top of its transfer. With s bytes of
parameters and all-reduce algorithm bandwidth w (bytes per rank / time):
    overhead(n_b) = s / (n_b w) + n_b o
(the last bucket's transfer, plus the per-call overheads, which serialise on the one
communication stream). d/dn_b = 0 gives n_b* = sqrt(s / (w o)), i.e. the optimal bucket size
    b* = s / n_b* = sqrt(s w o),   overhead* = 2 sqrt(s o / w).
"""

from __future__ import annotations

import math

from cs336_systems.analysis.calculation import Calculation, positive


def ddp_overhead(model_bytes: float, bandwidth: float, call_overhead: float, buckets: int) -> Calculation:
    s, w, o = positive("model_bytes", model_bytes), positive("bandwidth", bandwidth), call_overhead
    if buckets < 1:
        raise ValueError(f"buckets must be >= 1, got {buckets}")
    return Calculation("overhead", "s / (n_b w) + n_b o", s / (buckets * w) + buckets * o, "s",
                       dict(s=s, w=w, o=o, n_b=buckets))


def optimal_bucket(model_bytes: float, bandwidth: float, call_overhead: float) -> list[Calculation]:
    s, w, o = positive("model_bytes", model_bytes), positive("bandwidth", bandwidth), \
        positive("call_overhead", call_overhead)
    inputs = dict(s=s, w=w, o=o)
    return [Calculation("n_b_opt", "sqrt(s / (w o))", math.sqrt(s / (w * o)), "buckets", inputs),
            Calculation("bucket_bytes_opt", "sqrt(s w o)", math.sqrt(s * w * o), "B", inputs),
            Calculation("overhead_opt", "2 sqrt(s o / w)", 2 * math.sqrt(s * o / w), "s", inputs)]
