"""The calculators against values derived by hand, and the CLI's output and errors."""

import json
import math

import pytest

from cs336_systems.analysis import collectives, ddp_overhead, memory, parallelism
from cs336_systems.analysis.cli import main


@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_collectives(n):
    v, w = 1e9, 1e11
    ag = collectives.collective_time("all-gather", v, n, w).value
    assert ag == pytest.approx((n - 1) / n * 0.01)
    assert collectives.collective_time("reduce-scatter", v, n, w).value == pytest.approx(ag)
    assert collectives.collective_time("all-reduce", v, n, w).value == pytest.approx(2 * ag)
    assert collectives.collective_time("all-reduce-alternate", v, n, w).value == pytest.approx((n - 1) * 0.01)
    # Latency: 2(N-1) steps of alpha for the ring all-reduce.
    assert collectives.collective_time("all-reduce", v, n, w, alpha=1e-5).value == pytest.approx(
        2 * ag + 2 * (n - 1) * 1e-5)


def test_ffn_costs_by_hand():
    # The handout's FFN: W1, W2 (D x F), W3 (F x D). B=1024 tokens, D=1024, F=4096, fp16, N=4, C=1e14, W=1e11.
    B, D, F, N, C, W = 1024, 1024, 4096, 4, 1e14, 1e11
    fwd, bwd = parallelism.ffn_flops(B, D, F)
    assert fwd.value == 3 * 2 * B * D * F and bwd.value == 2 * fwd.value  # three matmuls; two products each back
    assert parallelism.ffn_flops(B, D, F, devices=4)[0].value == fwd.value / 4
    dp = {c.name: c.value for c in parallelism.ffn_costs("dp", B, D, F, N, C, W)}
    assert dp["T_compute_forward"] == pytest.approx(fwd.value / (4 * 1e14))
    assert dp["T_comm_forward"] == 0
    assert dp["T_comm_backward"] == pytest.approx(2 * 0.75 * 3 * D * F * 2 / W)  # all-reduce of 3 D F grads
    fsdp = {c.name: c.value for c in parallelism.ffn_costs("fsdp", B, D, F, N, C, W)}
    assert fsdp["T_comm_forward"] == pytest.approx(0.75 * 3 * D * F * 2 / W)  # all-gather of the 3 weights
    assert fsdp["T_comm_backward"] == pytest.approx(2 * fsdp["T_comm_forward"])  # all-gather + reduce-scatter
    tp = {c.name: c.value for c in parallelism.ffn_costs("tp", B, D, F, N, C, W)}
    assert tp["T_comm_forward"] == tp["T_comm_backward"] == pytest.approx(2 * 0.75 * B * D * 2 / W)  # all-reduce
    mixed = {c.name: c.value for c in parallelism.ffn_costs("fsdp-tp", B, D, F, N, C, W, mesh=(2, 2))}
    assert mixed["T_comm_forward_fsdp_axis"] == pytest.approx(0.5 * 3 * D * F * 2 / (2 * W))
    assert mixed["T_comm_forward_tp_axis"] == pytest.approx(2 * 0.5 * 512 * D * 2 / W)
    assert mixed["T_comm_forward"] == max(mixed["T_comm_forward_fsdp_axis"], mixed["T_comm_forward_tp_axis"])
    with pytest.raises(ValueError, match="mesh"):
        parallelism.ffn_costs("fsdp-tp", B, D, F, N, C, W, mesh=(3, 2))


def test_device_limits_by_hand():
    B, D, F, C, W = 65536, 16384, 53248, 4.6e14, 1.8e11
    # DP: 6DFb/W = 12BDF/(NC)  =>  N = 2BW/(bC) = 2*65536*1.8e11/(2*4.6e14) = 25.6.
    assert parallelism.max_devices_before_comm_dominates("dp", B, D, F, C, W).value == 25
    for phase in ("forward", "backward"):  # FSDP: the same bound in both phases
        assert parallelism.max_devices_before_comm_dominates("fsdp", B, D, F, C, W, phase=phase).value == 25
    # TP forward: 2BDb/W = 6BDF/(NC)  =>  N = 3FW/(bC) = 31.26; backward 6FW/(bC) = 62.5.
    assert parallelism.max_devices_before_comm_dominates("tp", B, D, F, C, W, phase="forward").value == 31
    assert parallelism.max_devices_before_comm_dominates("tp", B, D, F, C, W, phase="backward").value == 62
    with pytest.raises(ValueError, match="no device limit for 'dp' in the forward"):
        parallelism.max_devices_before_comm_dominates("dp", B, D, F, C, W, phase="forward")


def test_fsdp_tp_limits_by_hand():
    B, F, C, W, b = 65536, 53248, 4.6e14, 1.8e11, 2
    x, y, n = (c.value for c in parallelism.max_devices_fsdp_tp(B, F, C, W))
    assert x == pytest.approx(2 * B * W / (b * C)) and y == pytest.approx(3 * F * W / (b * C)) and n == x * y
    bx, by, shared = (c.value for c in parallelism.max_devices_fsdp_tp(B, F, C, W, overlapped=False))
    assert shared == pytest.approx(n / 4)
    assert bx * by == pytest.approx(shared)
    # At the best split the summed communication equals the compute exactly (per D b / W units).
    assert 3 * F * bx + 2 * B * by == pytest.approx(6 * B * F * W / (b * C))


def test_xxl_memory_by_hand():
    P = 126 * 2 * 16384 * 53248  # 2.1986e11 parameters
    calcs = {c.name: c.value for c in memory.training_state(16384, 53248, 126, tokens=1, device_bytes=80e9)}
    assert calcs["state_total"] == 16 * P
    assert calcs["devices_for_state"] == math.ceil(16 * P / 80e9) == 44
    fit = {c.name: c.value for c in memory.fsdp_shards_to_fit(16 * P, 0.0, 95e9)}
    assert fit["N_FSDP_min"] == 38 and fit["memory_per_device"] < 95e9  # 3518 GB / 37 = 95.07 GB > 95 GB
    assert 16 * P / 37 > 95e9
    with pytest.raises(ValueError, match="no N_FSDP fits"):
        memory.fsdp_shards_to_fit(1e12, 300e9, 95e9)


def test_mesh_batch_by_hand():
    b_dev, b_all, y_max = parallelism.compute_bound_batch_fsdp_tp(53248, 4.6e14, 1.8e11, 16, 4, 2, 1)
    assert b_all.value == pytest.approx(16 * 2 * 4.6e14 / (2 * 1.8e11 * 2))  # 20444 tokens
    assert b_dev.value == pytest.approx(b_all.value / 64)
    assert y_max.value == pytest.approx(2 * 53248 * 1.8e11 / (2 * 4.6e14))


def test_bucket_optimum_by_hand():
    opt = {c.name: c.value for c in ddp_overhead.optimal_bucket(8e9, 1e11, 5e-5)}
    assert opt["bucket_bytes_opt"] == pytest.approx(math.sqrt(8e9 * 1e11 * 5e-5))  # 2e8 bytes
    assert opt["n_b_opt"] == pytest.approx(40)
    best = ddp_overhead.ddp_overhead(8e9, 1e11, 5e-5, 40).value
    assert best == pytest.approx(opt["overhead_opt"])
    assert all(ddp_overhead.ddp_overhead(8e9, 1e11, 5e-5, n).value > best for n in (10, 20, 80, 160))


def test_cli_prints_formulas_and_json(capsys):
    assert main(["collective", "--size", "1e9", "--devices", "4", "--bandwidth", "1e11"]) == 0
    out = capsys.readouterr().out
    assert "T_all-reduce = 2(N-1)/N * V/W = 15 ms" in out
    assert main(["--json", "bucket", "--model-bytes", "8e9", "--bandwidth", "1e11", "--call-overhead", "5e-5"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[1]["name"] == "bucket_bytes_opt" and rows[1]["value"] == pytest.approx(2e8)


def test_cli_rejects_bad_input(capsys):
    with pytest.raises(SystemExit):
        main(["collective", "--size", "-1", "--devices", "4", "--bandwidth", "1e11"])
    assert "must be > 0" in capsys.readouterr().err
