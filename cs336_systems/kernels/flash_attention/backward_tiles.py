"""The backward passes' tile sizes (BLOCK_M, BLOCK_N, warps, stages) per tile family, and how each autotuner prunes
them to the launch's family, head dim and shared memory (`prune_backward`). The kernels are in backward.py.
"""

from __future__ import annotations

from cs336_systems.kernels._triton_utils import autotune_enabled, configs_for_family, tile_family

# Tile sizes from `cs336-bench attention-tune` on the H200 (results/attention-tune.jsonl, bf16 causal
# 1x32x32768x128 and 4x32x16384x64): each list holds the winners at d 64 and d 128 first, then smaller
# tiles that fit wide heads (fp32 at d 128, d 256).
# IEEE fp32 (fp32 without allow_tf32) runs FMA dots, and forms S in fp64 on the fp64 tensor cores
# (`forward.scaled_scores`), whose operands and accumulator double a tile's registers: the 16-warp tiles that fit the
# FMA dots alone spilled 4.6-9.8 KB (dK/dV) and 1.8-4.6 KB (dQ) with them. Each family's first spills nothing at
# d 64 (dK/dV 16 x 32 on 8 warps, dQ 32 x 32 on 8; the row statistics, on dQ's tiles, 16 B); at d 128 the wide-head
# rule keeps the same first (328 B and 20 B; the row statistics 0 B).
# `python scripts/flash_ptx_schedule.py --kernel dkdv,dq,row-stats --dtype fp32 --d 128`.
DKDV_IEEE_FP32_TILES = ((16, 32, 8, 2), (16, 64, 8, 2), (32, 32, 8, 2), (16, 16, 4, 2), (64, 64, 16, 2))
DQ_IEEE_FP32_TILES = ((32, 32, 8, 2), (64, 16, 8, 2), (32, 16, 4, 2), (64, 32, 8, 2), (64, 64, 16, 2))
# fp32 on tensor cores (tf32x3, tf32): fp32 tiles take twice a 16-bit tile's shared memory, and tf32x3 (with
# the compensated accumulators) holds split operands and two accumulators per gradient. ptxas, sm_90, tf32x3:
# the dK/dV pass spills 20 B (32 x 32) to 3 KB (64 x 64 on 8 warps) at d 64, and 1.3-9.6 KB at d 128 where
# every tile spills; the dQ pass 0-124 B at d 64, 48 B-2.8 KB at d 128. Each list's first fits d 64, and the
# first the wide-head rule leaves at d 128 fits the H200's 227 KiB of shared memory (dK/dV 32 x 64 in 3 stages:
# 224 KiB; one pass 32 x 32: 120 KiB; dQ 64 x 32: 192 KiB).
# `python scripts/flash_ptx_schedule.py --kernel dkdv,dq,fused --dtype fp32 --precision tf32x3 --d 128`.
DKDV_FP32_TENSOR_CORE_TILES = ((64, 64, 8, 2), (32, 64, 4, 3), (32, 32, 4, 2), (16, 64, 4, 2), (32, 32, 8, 2),
                               (16, 32, 8, 2))
DQ_FP32_TENSOR_CORE_TILES = ((128, 64, 8, 2), (64, 32, 4, 2), (128, 32, 8, 2), (64, 64, 8, 2), (32, 32, 8, 2),
                             (32, 16, 8, 2))
# Head dim 256 in 16 bits ("wide-tensor-core"): the pass's gradient tiles, 256 columns each, must stay in
# registers. ptxas, sm_90, bf16 and fp16, causal or not: the area-capped tensor-core tiles the dK/dV pass took
# before (32 x 64 and 16 x 64 on 4 warps) spilled 4.1-4.3 KB a thread, the dQ pass's 32-132 B (issue 35: the
# d 256 backward took 11x the d 128 time for 2x the FLOPs); these spill nothing (dK/dV 32 x 32 on 8 warps:
# 170-203 registers; dQ 64 x 32 on 8 warps: 214-216), the old tiles last, for the autotuner to weigh. Timed on the
# H200 (4a2f69e3b6db) they did not help: the 32 x 32 dK/dV tiles issue no wgmma, and fwd+bwd stayed 8x the d 128
# time; by default d 256 now takes the split key passes below, and these serve the TMA variant (`dkdv-tma`).
# `python scripts/flash_ptx_schedule.py --kernel dkdv,dq --d 256 --config 32x32x8x3,64x32x8x2`.
WIDE_HEAD_DIM = 256
DKDV_WIDE_TILES = ((32, 32, 8, 3), (32, 32, 8, 2), (16, 32, 8, 2), (32, 64, 4, 3), (16, 64, 4, 2))
DQ_WIDE_TILES = ((64, 32, 8, 2), (64, 32, 8, 3), (128, 32, 8, 2), (64, 16, 8, 2), (64, 32, 4, 3), (64, 16, 4, 2))
DKDV_TILE_FAMILIES = {
    "tensor-core": ((64, 64, 4, 2), (64, 64, 4, 4), (64, 128, 8, 3), (32, 64, 4, 3), (16, 64, 4, 2)),
    "ieee": DKDV_IEEE_FP32_TILES, "fp32-tensor-core": DKDV_FP32_TENSOR_CORE_TILES,
    "wide-tensor-core": DKDV_WIDE_TILES}
# The split key passes at d 256 in 16 bits (`flash_key_grad_kernel`): a dV pass and a dK pass, each holding one
# (BLOCK_N, 256) fp32 accumulator where the fused dK/dV pass holds two, so 64-row tiles fit (the fused pass's
# spill-free 32 x 32 tiles starve the tensor cores: fwd+bwd at d 256 took 8.0x the d 128 time at seq 131072,
# results/attention.jsonl, 4a2f69e3b6db).
SPLIT_KEY_TILES = ((64, 64, 8, 2), (64, 64, 8, 3), (32, 64, 8, 2), (64, 128, 8, 2), (64, 64, 4, 2))
# The one-pass backward (dQ reduced into fp32) extends the dK/dV pass: its tiles, but its own 16-bit winners (and
# at d 256 still the area cap: its extra dQ tile in shared memory was not checked with the wide tiles).
FUSED_TILE_FAMILIES = {family: tiles for family, tiles in DKDV_TILE_FAMILIES.items()
                       if family != "wide-tensor-core"} | {
    "tensor-core": ((64, 64, 4, 2), (64, 128, 8, 2), (64, 128, 8, 3), (64, 64, 4, 3), (32, 64, 4, 3),
                    (16, 64, 4, 2))}
DQ_TILE_FAMILIES = {
    "tensor-core": ((128, 64, 8, 3), (128, 64, 4, 2), (128, 32, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3),
                    (64, 16, 4, 2)),
    "ieee": DQ_IEEE_FP32_TILES, "fp32-tensor-core": DQ_FP32_TENSOR_CORE_TILES, "wide-tensor-core": DQ_WIDE_TILES}


def prune_backward(divisible_by: str, divides: str, families: dict[str, tuple], wide_max_tile: int = 32 * 64):
    """Keep the launch's tile family (`tile_family`, `families`), and in it the configs whose tile sizes nest
    (needed by the causal loop split) and that fit on chip: wide heads (d 256, or fp32 at d 128) take
    BLOCK_M x BLOCK_N <= wide_max_tile (the fused pass holds one more tile of dQ in shared memory: (32, 64)
    overflowed the H200's 227 KiB by 2 KiB at d 256).
    IEEE fp32 at d <= 32 tunes over the tensor-core tiles too: they do not spill there, and on the H200 they won
    at long sequences (fp32 d 32 causal seq 32768: backward 13.7 ms against 23.4 ms on the FMA tiles alone,
    results/attention.jsonl), the FMA tiles at short ones (seq 2048: 0.44 against 0.53 ms)."""

    def prune(configs, named_args, **kwargs):
        head_dim = kwargs.get("BLOCK_D", named_args.get("BLOCK_D"))
        family = tile_family(kwargs.get("PRECISION"), named_args["Q"].element_size())
        if family == "tensor-core" and head_dim >= WIDE_HEAD_DIM and "wide-tensor-core" in families:
            candidates = configs_for_family(configs, families, "wide-tensor-core")  # chosen for d 256: no cap
            return candidates if autotune_enabled() else candidates[:1]
        candidates = configs_for_family(configs, families, family)
        if family == "ieee" and head_dim <= 32:
            candidates = configs_for_family(configs, families, "tensor-core") + candidates  # (no tile in both)
        wide = head_dim >= 256 or named_args["Q"].element_size() == 4 and head_dim >= 128
        kept = [c for c in candidates if c.kwargs[divisible_by] % c.kwargs[divides] == 0
                and (not wide or c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= wide_max_tile)]
        kept = kept or candidates[-1:]
        return kept if autotune_enabled() else kept[:1]  # configs are listed best-first

    return prune


BACKWARD_TUNING_KEY = ["n_queries_bucket", "n_keys_bucket", "BLOCK_D", "IS_CAUSAL", "PRECISION"]


def prune_split(configs, named_args, **kwargs):
    """The split passes' tiles as listed (each nests: BLOCK_N a multiple of BLOCK_M), or the first alone."""
    return configs if autotune_enabled() else configs[:1]
