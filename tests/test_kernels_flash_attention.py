"""FlashAttention-2: the PyTorch tiled reference and the Triton kernel.

Errors are measured against an fp64 reference; a low-precision result may be off by at
most 2x PyTorch's own naive attention at the same precision (bf16/fp16 matmuls), so no
tolerance is hand-tuned. On CPU the Triton kernel runs under TRITON_INTERPRET=1 at small
shapes in fp32; on a GPU the full matrix runs (dtypes, head dims, lengths, layouts).
"""

import math
import re

import pytest
import torch

from cs336_systems.kernels.flash_attention.reference import FlashAttentionPytorch, naive_attention
from tests._support import CopyCounter, assert_within_budget, kernel_device, requires_cuda, requires_hopper

# (batch, heads or None for 3-D, n_queries, n_keys, head_dim): odd lengths, batch 1, a single
# query tile, n_queries != n_keys both ways, non-power-of-two head dims.
SMALL_SHAPES = [(4, None, 128, 128, 64), (1, None, 37, 53, 16), (2, 3, 70, 20, 32), (1, 2, 5, 90, 24),
                (2, None, 1, 17, 16), (1, 1, 64, 64, 80)]


def _inputs(batch, heads, nq, nk, d, dtype, device, seed=0):
    torch.manual_seed(seed)
    lead = (batch,) if heads is None else (batch, heads)
    return [torch.randn(*lead, n, d, device=device, dtype=dtype, requires_grad=True) for n in (nq, nk, nk)]


def _grads(out, inputs, grad_out):
    return torch.autograd.grad(out, inputs, grad_out)


def _check_against_reference(fn, shape, causal, dtype, device):
    q, k, v = _inputs(*shape, dtype, device)
    out = fn(q, k, v, causal)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = naive_attention(*ref_in, causal)
    low = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    low_out = naive_attention(*low, causal, upcast=False)  # PyTorch's own error at this precision
    grad_out = torch.randn_like(out)
    assert_within_budget("out", out, ref, low_out)
    for name, ours, exact, torch_low in zip(("dq", "dk", "dv"), _grads(out, (q, k, v), grad_out),
                                            _grads(ref, ref_in, grad_out.double()),
                                            _grads(low_out, low, grad_out)):
        assert ours.dtype == dtype and ours.shape == exact.shape
        assert_within_budget(name, ours, exact, torch_low)
    return out


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SMALL_SHAPES)
def test_pytorch_flash_matches_reference_on_cpu(shape, causal):
    _check_against_reference(FlashAttentionPytorch.apply, shape, causal, torch.float32, "cpu")


def test_pytorch_flash_saves_l_and_is_exact_in_fp64():
    q, k, v = _inputs(2, None, 50, 50, 16, torch.float64, "cpu")
    out = FlashAttentionPytorch.apply(q, k, v, True)
    ref, lse = naive_attention(q, k, v, True, return_lse=True)
    saved = [t for t in out.grad_fn.saved_tensors if t.shape == (2, 50)]
    assert len(saved) == 1 and out.grad_fn.is_causal is True
    torch.testing.assert_close(saved[0], lse, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_naive_attention_masks_with_minus_1e6():
    q, k, v = (torch.randn(1, 4, 8, dtype=torch.float64) for _ in range(3))
    _, lse = naive_attention(q, k, v, True, return_lse=True)
    scores = q @ k.transpose(-1, -2) / math.sqrt(8)
    scores = scores + torch.triu(torch.full((4, 4), -1e6, dtype=torch.float64), diagonal=1)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1))


# ---- Triton: CPU interpreter at small shapes (fp32), the GPU for everything ----

def _triton_fn(backward="triton"):
    from cs336_systems.kernels.flash_attention.function import flash_attention

    return lambda q, k, v, causal: flash_attention(q, k, v, causal, backward=backward)


@pytest.mark.parametrize("backward", ["triton", "two-pass", "fused"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SMALL_SHAPES[1:])
def test_triton_matches_reference_small(shape, causal, backward):
    device = kernel_device()
    _check_against_reference(_triton_fn(backward), shape, causal, torch.float32, device)


# Head dims over 128 in 16 bits take the split key passes (a dV pass, then a dK pass: `choose_backward`'s
# "dkdv-split"). fp16: the interpreter's fp16 products are right (its bf16 ones are not), so this runs on the CPU.
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 3, 33, 33, 256), (1, 2, 20, 45, 200), (2, 1, 1, 7, 256)])
def test_split_key_passes_match_reference_at_wide_heads(shape, causal):
    from cs336_systems.kernels.flash_attention.dispatch import BackwardOptions, choose_backward

    if causal and shape[2] != shape[3]:
        pytest.skip("causal masks square attention here")
    device = kernel_device()
    q = torch.empty(shape[0], shape[1], shape[2], shape[4], dtype=torch.float16, device=device)
    assert choose_backward(q, q, q, q, BackwardOptions()).kernels == ("dkdv-split", "dq")
    _check_against_reference(_triton_fn(), shape, causal, torch.float16, device)


# Issue 33's two shapes that exceeded the error budget: 7 causal rows (the first sees one key) and one query row
# over 64 keys.
@pytest.mark.parametrize("implementation", ["pytorch", "triton"])
@pytest.mark.parametrize("shape, causal", [((1, None, 7, 7, 64), True), ((2, None, 1, 64, 16), False)])
def test_short_rows_within_budget(implementation, shape, causal):
    if implementation == "pytorch":
        _check_against_reference(FlashAttentionPytorch.apply, shape, causal, torch.float32, "cpu")
    else:
        _check_against_reference(_triton_fn(), shape, causal, torch.float32, kernel_device())


@pytest.mark.parametrize("causal", [False, True])
def test_fused_backward_matches_two_pass(causal):
    """Same dK/dV maths (bitwise under one config), dQ only reassociated."""
    from cs336_systems.kernels.flash_attention.function import flash_attention

    device = kernel_device()
    q, k, v = _inputs(2, 3, 70, 45 if not causal else 70, 32, torch.float32, device)
    do = torch.randn(2, 3, 70, 32, device=device)
    grads = {}
    for backward in ("triton", "fused"):
        q.grad = k.grad = v.grad = None
        flash_attention(q, k, v, causal, backward=backward).backward(do)
        grads[backward] = (q.grad.clone(), k.grad.clone(), v.grad.clone())
    (dq2, dk2, dv2), (dq1, dk1, dv1) = grads["triton"], grads["fused"]
    if device == "cpu":  # the interpreter runs both with the same tiles
        assert torch.equal(dk1, dk2) and torch.equal(dv1, dv2)
    torch.testing.assert_close(dq1, dq2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dk1, dk2, rtol=1e-5, atol=1e-5)


def test_triton_saves_exactly_one_l_and_flag():
    device = kernel_device()
    from cs336_systems.kernels.flash_attention.function import FlashAttentionTriton

    q, k, v = _inputs(2, None, 40, 40, 16, torch.float32, device)
    out = FlashAttentionTriton.apply(q, k, v, True)
    saved = out.grad_fn.saved_tensors
    assert sum(t.shape == (2, 40) for t in saved) == 1 and all(t is not None for t in saved)
    assert out.grad_fn.is_causal is True
    _, lse = naive_attention(q.double(), k.double(), v.double(), True, return_lse=True)
    torch.testing.assert_close(next(t for t in saved if t.shape == (2, 40)).double(), lse, rtol=1e-5, atol=1e-5)


def test_triton_reads_strided_views_in_place():
    """The model's heads are views of (batch, seq, heads*d): non-contiguous 4-D input."""
    device = kernel_device()
    from cs336_systems.kernels.flash_attention.function import flash_attention

    torch.manual_seed(0)
    packed = torch.randn(2, 33, 3 * 16, device=device)
    q, k, v = (packed[..., i * 16:(i + 1) * 16].reshape(2, 33, 1, 16).transpose(1, 2) for i in range(3))
    assert not q.is_contiguous()
    out = flash_attention(q, k, v, True)
    torch.testing.assert_close(out, naive_attention(q.contiguous(), k.contiguous(), v.contiguous(), True),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backward", ["triton", "fused"])
def test_triton_outputs_and_gradients_keep_the_inputs_layout(backward):
    """O, dQ, dK, dV come back in the layout of the model's head views of (batch, seq, heads x d), so merging
    the heads after attention and the gradients' way back to the projections are views, not copies."""
    device = kernel_device()
    from cs336_systems.kernels.flash_attention.function import flash_attention

    torch.manual_seed(1)
    batch, seq, heads, d = 2, 37, 3, 16
    projections = [torch.randn(batch, seq, heads * d, device=device, requires_grad=True) for _ in range(3)]
    q, k, v = (t.view(batch, seq, heads, d).transpose(1, 2) for t in projections)
    out = flash_attention(q, k, v, True, backward=backward)
    assert out.stride() == q.stride()
    merged = out.transpose(1, 2).reshape(batch, seq, heads * d)
    assert merged.data_ptr() == out.data_ptr() and merged.is_contiguous()  # a view
    dy = torch.randn_like(merged)
    merged.backward(dy)
    leaves = [t.detach().double().requires_grad_() for t in projections]
    ref = naive_attention(*(t.view(batch, seq, heads, d).transpose(1, 2) for t in leaves), True)
    ref.transpose(1, 2).reshape(batch, seq, heads * d).backward(dy.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
    for ours, exact in zip(projections, leaves):
        torch.testing.assert_close(ours.grad.double(), exact.grad, rtol=1e-4, atol=1e-5)


def test_attention_block_copies_nothing_with_our_kernels():
    """The model's attention block with our attention and RoPE: no activation is copied in forward or
    backward (the head split and merge are views end to end). Weight gradients may be (AccumulateGrad
    lays them out like their parameters)."""
    from cs336_basics.model import CausalMultiHeadSelfAttention, RotaryEmbedding
    from cs336_systems.attention import use_attention
    from cs336_systems.fused_model import _fused_rope_forward

    device = kernel_device()
    torch.manual_seed(2)
    rope = RotaryEmbedding(64, 16).to(device)
    rope.forward = _fused_rope_forward.__get__(rope)
    block = CausalMultiHeadSelfAttention(48, 3, rope).to(device)
    seq = 40
    x = torch.randn(2, seq, 48, device=device, requires_grad=True)

    with use_attention("triton"):
        out = block(x)
        with CopyCounter() as counter:
            out = block(x)
            out.sum().backward()
    assert counter.of_shape(seq) == []


@pytest.mark.parametrize("bad,match", [
    (lambda q, k, v: (q.unsqueeze(1), k, v), "same number of dims"),
    (lambda q, k, v: (q, k[:, :5], v), "same length"),
    (lambda q, k, v: (q, k, v[..., :8]), "head dim"),
    (lambda q, k, v: (q, k.double(), v), "share a dtype"),
    (lambda q, k, v: (q.double(), k.double(), v.double()), "not supported"),
    (lambda q, k, v: (q[0, 0], k[0, 0], v[0, 0]), "3-D"),
])
def test_triton_rejects_bad_input(bad, match):
    device = kernel_device()
    from cs336_systems.kernels.flash_attention.function import flash_attention

    q, k, v = (torch.randn(2, 10, 16, device=device) for _ in range(3))
    with pytest.raises(ValueError, match=match):
        flash_attention(*bad(q, k, v))


def test_triton_rejects_cpu_tensors_without_interpreter(monkeypatch):
    import cs336_systems.kernels._triton_utils as utils

    monkeypatch.setattr(utils, "interpreting", lambda: False)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        utils.check_kernel_device("flash attention", torch.randn(2))


def test_triton_rejects_too_large_head_dim():
    device = kernel_device()
    from cs336_systems.kernels.flash_attention.function import flash_attention

    q = torch.randn(1, 4, 200, device=device)
    with pytest.raises(ValueError, match="too large"):
        flash_attention(q, q, q)


def test_unknown_backward_impl():
    from cs336_systems.kernels.flash_attention.function import flash_attention

    with pytest.raises(ValueError, match="backward must be one of triton, two-pass, tl, fused, compile"):
        flash_attention(torch.randn(1, 4, 16), torch.randn(1, 4, 16), torch.randn(1, 4, 16), backward="magic")


# ---- GPU only: the full matrix ----

GPU_SHAPES = SMALL_SHAPES + [(1, 4, 1000, 1000, 128), (2, 2, 513, 257, 64), (1, 2, 300, 300, 256),
                             (1, 1, 2048, 2048, 64)]


# Our kernels' fp32 dK at (1, 1, 2048, 2048, 64), causal, was 1.66x this budget on the H200 (2026-12-02): the
# gradient dots chained every query's product through one FMA sequence. The fp32 accumulators are now
# compensated (backward.add_compensated), and those cases are expected within budget.
KNOWN_FP32_OVER_BUDGET = {
    ((2, 3, 70, 20, 32), False, "compile"): "inductor's backward: dq max error 1.69e-6 vs budget 1.59e-6 (1.06x)",
}


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("backward", ["triton", "two-pass", "fused", "compile"])
def test_triton_full_matrix_on_gpu(shape, causal, dtype, backward, request):
    if shape[-1] > 128 and dtype == torch.float32:
        pytest.skip("fp32 takes head dims up to 128")
    if dtype == torch.float32 and (shape, causal, backward) in KNOWN_FP32_OVER_BUDGET:
        # Measured on the H200 (2026-12-02): over 2x torch's fp32 error, so flagged, not hidden; strict for our
        # kernels, so a fix shows up as an unexpected pass. Inductor's kernels vary between runs (it came within
        # budget on 2026-12-03, commit 810486fe2e45), so its entry is not strict.
        request.applymarker(pytest.mark.xfail(strict=backward != "compile",
                                              reason=KNOWN_FP32_OVER_BUDGET[(shape, causal, backward)]))
    if backward == "compile" and shape[2] * shape[3] > 2048 * 2048 // 4:
        pytest.skip("the compiled backward materialises P; keep it to small shapes")
    _check_against_reference(_triton_fn(backward), shape, causal, dtype, "cuda")


@requires_cuda
@pytest.mark.parametrize("d", [64, 128])
def test_two_pass_backward_is_bit_reproducible(d):
    """backward="two-pass" sums every gradient in a fixed order (no reduction across programs), so two runs agree
    bit for bit; the default may take the one-pass kernel at some head dims, whose fp32 dQ sums are not."""
    from cs336_systems.kernels.flash_attention.function import flash_attention

    q, k, v = _inputs(2, 3, 1000, 1000, d, torch.bfloat16, "cuda")
    do = torch.randn_like(q)
    runs = []
    for _ in range(2):
        q.grad = k.grad = v.grad = None
        flash_attention(q, k, v, True, backward="two-pass").backward(do)
        runs.append((q.grad.clone(), k.grad.clone(), v.grad.clone()))
    for name, first, second in zip(("dq", "dk", "dv"), *runs):
        assert torch.equal(first, second), name


@requires_cuda
@pytest.mark.parametrize("backward", ["triton", "fused"])
def test_triton_writes_every_output_element(backward):
    from cs336_systems.kernels.flash_attention.function import flash_attention

    poison = torch.full((64 * 2**20,), float("nan"), device="cuda")  # fill the allocator's cache with NaN
    del poison
    q, k, v = _inputs(3, 5, 999, 1001, 64, torch.bfloat16, "cuda")
    out = flash_attention(q, k, v, True, backward=backward)
    out.backward(torch.randn_like(out))
    for t in (out, q.grad, k.grad, v.grad):
        assert torch.isfinite(t).all()


@requires_cuda
@pytest.mark.parametrize("backward", ["triton", "fused"])
def test_triton_memory_is_linear_in_sequence_length(backward):
    from cs336_systems.kernels.flash_attention.function import flash_attention

    n, d = 16384, 64
    q, k, v = _inputs(1, 1, n, n, d, torch.bfloat16, "cuda")
    do = torch.randn_like(q)
    # Compile and tune first: the tuner's own buffers don't count.
    flash_attention(q, k, v, True, backward=backward).backward(do)
    q.grad = k.grad = v.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    flash_attention(q, k, v, True, backward=backward).backward(do)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    # O, dQ, dK, dV, L and D (and the fused pass's fp32 dQ): a few (n x d) tensors; an (n x n) bf16
    # buffer would be 512 MiB.
    assert extra < 16 * n * d * 2, f"extra {extra / 2**20:.1f} MiB"


def test_descriptor_allocator_is_installed_per_thread():
    """Triton keeps its allocator in a ContextVar: autograd's backward thread must get one too."""
    import threading

    from triton.runtime import _allocation

    from cs336_systems.kernels.flash_attention.launches import descriptor_scratch, install_descriptor_allocator

    seen = []

    def worker():
        install_descriptor_allocator()
        seen.append(_allocation._allocator.get())

    install_descriptor_allocator()  # here first: a fresh thread still starts from the null allocator
    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == [descriptor_scratch]


@pytest.mark.parametrize("shape,causal", [((1, 2, 40, 40, 16), True), ((2, 1, 33, 50, 32), False),
                                          ((1, 2, 70, 70, 20), True)])
def test_forward_through_tensor_descriptors_matches(shape, causal):
    """The TMA forward (descriptor loads zero-fill rows past n and columns past d) computes the same O and L."""
    from cs336_systems.kernels.flash_attention.dispatch import forward_launch

    device = kernel_device()
    b, h, n, m, d = shape
    q, k, v = _inputs(b, h, n, m, d, torch.float32, device)
    plain, out, lse = forward_launch(q.detach(), k.detach(), v.detach(), causal, use_tma=False)
    tma, out_tma, lse_tma = forward_launch(q.detach(), k.detach(), v.detach(), causal, use_tma=True)
    assert tma.flags.get("USE_TMA") is True
    plain()
    tma()
    assert "USE_TMA" not in plain.flags
    torch.testing.assert_close(out_tma, out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse_tma, lse, rtol=1e-6, atol=1e-6)


def test_forward_takes_descriptors_by_default_only_on_hopper():
    from cs336_systems.kernels.flash_attention.dispatch import forward_launch
    from cs336_systems.kernels.flash_attention.launches import has_tma

    device = kernel_device()
    q, k, v = (t.detach() for t in _inputs(1, 2, 64, 64, 32, torch.bfloat16, device))
    launch, _, _ = forward_launch(q, k, v, True)
    expected = q.device.type == "cuda" and has_tma(q.device)
    assert launch.flags.get("USE_TMA", False) is expected
    odd, _, _ = forward_launch(q[..., :20], k[..., :20], v[..., :20], True)  # 40-byte rows: never eligible
    assert "USE_TMA" not in odd.flags


def test_tma_eligibility():
    from cs336_systems.kernels.flash_attention.launches import tma_eligible

    assert tma_eligible(torch.randn(2, 4, 64, 64, dtype=torch.bfloat16))
    assert not tma_eligible(torch.randn(2, 4, 64, 20, dtype=torch.bfloat16))  # 40-byte rows
    assert not tma_eligible(torch.randn(2, 4, 64, 64).transpose(-1, -2))  # d not unit-stride
    assert tma_eligible(torch.randn(2, 64, 4, 64).transpose(1, 2))  # the model's head-split view


@pytest.mark.parametrize("shape,causal", [((1, 2, 40, 40, 16), True), ((2, 1, 33, 50, 32), False),
                                          ((1, 2, 70, 70, 20), True)])
def test_backward_through_tensor_descriptors_matches(shape, causal):
    from cs336_systems.kernels.flash_attention.dispatch import backward_launches, flash_forward

    device = kernel_device()
    b, h, n, m, d = shape
    q, k, v = (t.detach() for t in _inputs(b, h, n, m, d, torch.float32, device))
    grad_out = torch.randn_like(q)
    out, lse = flash_forward(q, k, v, causal)
    grads = {}
    for use_tma in (False, True):
        preprocess, dkdv, dq_pass, finish = backward_launches(q, k, v, out, lse, grad_out, causal, use_tma=use_tma)
        assert dkdv.flags.get("USE_TMA", False) is use_tma and dq_pass.flags.get("USE_TMA", False) is use_tma
        preprocess()
        dkdv()
        dq_pass()
        grads[use_tma] = finish()
    for plain, tma in zip(grads[False], grads[True]):
        torch.testing.assert_close(tma, plain, rtol=1e-5, atol=1e-6)


def test_precompile_lists_what_the_autotuner_would_try():
    """The warm-up compiles, per kernel, exactly the candidates the autotuner keeps after its pruning; with no
    CUDA device it does nothing (the interpreter compiles nothing)."""
    from cs336_systems.kernels.flash_attention.warmup import _candidates, _launches, precompile

    device = kernel_device()
    launches = _launches(32, torch.float32, True, device=device)  # fp32-accurate dots: the row statistics pass too
    assert set(launches) == {"forward", "dkdv", "dq", "fused", "row-stats"}
    for name, launch in launches.items():
        tuner = launch.kernel
        tuner.nargs = dict(zip(tuner.arg_names, launch.args))
        try:
            assert _candidates(launch) == tuner.prune_configs(launch.flags), name
        finally:
            tuner.nargs = None
    if device == "cpu":
        assert precompile([(32, torch.float32, True)], workers=2) == []
    wide = _launches(256, torch.float16, True, device=device)  # the split key passes, each a kernel to compile
    assert set(wide) == {"forward", "dv", "dk", "dq", "fused"}
    assert [wide[name].flags["KEY_GRADS"] for name in ("dv", "dk")] == [1, 2] and _candidates(wide["dk"])


def _run_ptx_script(*args: str, script: str = "flash_ptx_schedule.py"):
    """A PTX script of scripts/ in its own process (without TRITON_INTERPRET: it compiles for sm_90), on this
    checkout's package whether installed or not (the GPU image runs the tree from PYTHONPATH)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(root), os.environ.get("PYTHONPATH"))))
    return subprocess.run([sys.executable, str(root / "scripts" / script), *args],
                          capture_output=True, text=True, timeout=300, env=env)


def test_ptx_schedule_script_compiles_for_hopper_with_pipelined_loads():
    """scripts/flash_ptx_schedule.py compiles for sm_90 on any machine; with the JIT's specialisation the dQ
    pass's loads are pipelined and its loop shows its products and waits."""
    pytest.importorskip("triton")
    done = _run_ptx_script("--kernel", "dq", "--d", "64", "--config", "64x64x4x3")
    assert done.returncode == 0, done.stderr[-2000:]
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith("dq") and int(re.search(r"cp\.async (\d+)", line).group(1)) > 0
    assert re.search(r"W\d+\|\d", line) and re.search(r"e\d+", line), line  # products, waits, exponentials


def test_gluon_backward_launches_bind_and_compile_for_hopper(tmp_path):
    """Our Gluon backward passes' launch arguments, as `backward_passes` / `fused_pass` / `one_pass` build them
    (nested stride tuples included), bind to their kernels through Triton's own JIT binder and compile for sm_90
    on any machine (scripts/gluon_jit_ptx.py); each PTX issues wgmma, and the one-pass kernels reduce dQ with
    atomics or bulk reductions."""
    pytest.importorskip("triton")
    done = _run_ptx_script("--out", str(tmp_path), "--shape", "1,2,200,128", script="gluon_jit_ptx.py")
    assert done.returncode == 0, done.stderr[-2000:]
    ptx = {path.stem: path.read_text() for path in tmp_path.glob("*.ptx")}
    assert set(ptx) == {"dkdv", "dq", "fused", "one-pass-ws"}
    for name, text in ptx.items():
        assert "wgmma.mma_async" in text, name
    for name in ("fused", "one-pass-ws"):
        assert re.search(r"red\.|atom\.|cp\.reduce\.async\.bulk", ptx[name]), name


@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_autotune_candidates_follow_the_dot_precision(head_dim, monkeypatch):
    """Each launch tunes over its own family, best-first: IEEE fp32 over the FMA tiles (the backward at d <= 32
    over the tensor-core tiles too), fp32 on tensor cores (tf32x3, tf32) over the fp32 tensor-core tiles, 16-bit
    over the tensor-core ones; every pass's list stays nested for the causal split and within the wide-head
    limit."""
    pytest.importorskip("triton")
    from cs336_systems.kernels import _triton_utils
    from cs336_systems.kernels._triton_utils import config_tile as tile
    from cs336_systems.kernels._triton_utils import configs_from_families
    from cs336_systems.kernels.flash_attention import backward, backward_tiles, forward

    monkeypatch.setenv("CS336_AUTOTUNE", "1")  # (the GPU stage runs with 0: one config per launch)
    monkeypatch.setattr(_triton_utils, "interpreting", lambda: False)  # the GPU's spaces, not the interpreter's
    passes = {"forward": (forward._prune_forward_configs, forward.TILE_FAMILIES),
              "dkdv": (backward.flash_dkdv_kernel.early_config_prune, backward_tiles.DKDV_TILE_FAMILIES),
              "fused": (backward.flash_bwd_fused_kernel.early_config_prune, backward_tiles.FUSED_TILE_FAMILIES),
              "dq": (backward.flash_dq_kernel.early_config_prune, backward_tiles.DQ_TILE_FAMILIES)}
    launches = {(torch.float32, "ieee"): "ieee", (torch.float32, "tf32x3"): "fp32-tensor-core",
                (torch.float32, "tf32"): "fp32-tensor-core", (torch.bfloat16, "tf32"): "tensor-core"}
    for name, (prune, families) in passes.items():
        assert set(families) - {"wide-tensor-core"} == {"tensor-core", "ieee", "fp32-tensor-core"}, name
        configs = configs_from_families(families)
        # Reversed: the family's own order (best-first) decides, not the autotuner's list.
        candidates = list(reversed(configs))
        big, small = (0, 1) if name in ("forward", "dq") else (1, 0)
        for (dtype, precision), family in launches.items():
            named = {"Q": torch.empty(1, dtype=dtype), "n_queries": 4096}
            kept = [tile(c) for c in prune(candidates, named, BLOCK_D=head_dim, PRECISION=precision)]
            assert kept, (name, dtype, precision)
            listed = list(families[family])
            if family == "ieee" and name != "forward" and head_dim <= 32:
                listed = list(families["tensor-core"]) + listed
            assert kept == [t for t in listed if t in kept], (name, precision, kept)  # its tiles, in its order
            assert all(t[big] % t[small] == 0 for t in kept), (name, kept)
            wide = head_dim == 128 and dtype == torch.float32  # smaller tiles (shared memory)
            assert not wide or all(t[0] * t[1] <= 64 * 64 for t in kept), (name, kept)
            assert len(kept) >= (2 if family != "ieee" or not wide else 1), (name, precision, kept)


def test_two_pass_backward_at_d256_tunes_over_the_wide_tiles(monkeypatch):
    """16-bit head dim 256: the dK/dV and dQ passes tune over their wide-head tiles, in listed order, with no
    area cap (the one-pass kernel keeps its capped tensor-core tiles); d 128 keeps the plain tensor-core tiles."""
    pytest.importorskip("triton")
    from cs336_systems.kernels import _triton_utils
    from cs336_systems.kernels._triton_utils import config_tile as tile
    from cs336_systems.kernels._triton_utils import configs_from_families
    from cs336_systems.kernels.flash_attention import backward
    from cs336_systems.kernels.flash_attention import backward_tiles as tiles_

    monkeypatch.setenv("CS336_AUTOTUNE", "1")
    monkeypatch.setattr(_triton_utils, "interpreting", lambda: False)
    named = {"Q": torch.empty(1, dtype=torch.bfloat16), "n_queries": 4096}
    for kernel, families, wide in ((backward.flash_dkdv_kernel, tiles_.DKDV_TILE_FAMILIES, tiles_.DKDV_WIDE_TILES),
                                   (backward.flash_dq_kernel, tiles_.DQ_TILE_FAMILIES, tiles_.DQ_WIDE_TILES)):
        configs = list(reversed(configs_from_families(families)))
        assert [tile(c) for c in kernel.early_config_prune(configs, named, BLOCK_D=256, PRECISION="tf32")] == list(wide)
        at_128 = [tile(c) for c in kernel.early_config_prune(configs, named, BLOCK_D=128, PRECISION="tf32")]
        assert at_128 and all(t in families["tensor-core"] for t in at_128)
    fused = [tile(c) for c in backward.flash_bwd_fused_kernel.early_config_prune(
        list(reversed(configs_from_families(tiles_.FUSED_TILE_FAMILIES))), named, BLOCK_D=256, PRECISION="tf32")]
    assert fused and all(t in tiles_.FUSED_TILE_FAMILIES["tensor-core"] and t[0] * t[1] <= 16 * 64 for t in fused)


@pytest.mark.parametrize("kernel", ["dkdv", "dq"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_wide_head_first_configs_spill_nothing_at_d256(kernel, dtype):
    """The first wide-head tile of each pass (what CS336_AUTOTUNE=0 launches at d 256) compiles for sm_90 with
    no register spills (the tiles before spilled 4.1-4.3 KB a thread in the dK/dV pass)."""
    pytest.importorskip("triton")
    done = _run_ptx_script("--kernel", kernel, "--dtype", dtype, "--d", "256")
    assert done.returncode == 0, done.stderr[-2000:]
    line = done.stdout.strip().splitlines()[-1]
    assert re.search(r"\b0 B spilled", line), line


@pytest.mark.parametrize("kernel", ["dv-split", "dk-split"])
def test_split_key_passes_run_on_wgmma_at_d256(kernel):
    """The split passes' first tile (64 x 64 on 8 warps, what CS336_AUTOTUNE=0 launches) compiles for sm_90 within
    the H200's 227 KiB, issues its products as wgmma (the fused pass's spill-free 32 x 32 tiles issue none) and
    spills at most a few words (ptxas: dV 0 B, dK 68 B)."""
    pytest.importorskip("triton")
    done = _run_ptx_script("--kernel", kernel, "--dtype", "bf16", "--d", "256")
    assert done.returncode == 0, done.stderr[-2000:]
    line = done.stdout.strip().splitlines()[-1]
    assert "64x64 w8" in line and re.search(r"\bW\d+", line), line
    shared, spilled = re.search(r"shared (\d+) KiB", line), re.search(r"(\d+) B spilled", line)
    assert shared and int(shared.group(1)) < 227 and spilled and int(spilled.group(1)) <= 128, line


@pytest.mark.parametrize("head_dim", [64, 128])
def test_ieee_fp32_kernels_sum_scores_on_fp64_tensor_cores_without_spilling(head_dim, tmp_path):
    """IEEE fp32 forms S = Q K^T in fp64 (`forward.scaled_scores`): each kernel's first IEEE tile (what
    CS336_AUTOTUNE=0 launches) compiles for sm_90 with its score product on the fp64 tensor cores and spills at most
    a few hundred bytes (tensor-core tiles spilled 53 KB in the fp32 forward at d 128, 20x slower than naive fp32;
    the 16-warp FMA tiles 1.6-9.8 KB in the backward once S was in fp64)."""
    pytest.importorskip("triton")
    done = _run_ptx_script("--kernel", "forward,dkdv,dq,row-stats", "--dtype", "fp32", "--precision", "ieee",
                           "--d", str(head_dim), "--ptx-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert [line.split()[0] for line in lines] == ["forward", "dkdv", "dq", "row-stats"], lines
    for line in lines:
        spilled = re.search(r"(\d+) B spilled", line)
        assert spilled and int(spilled.group(1)) <= 400, line
    ptx = sorted(tmp_path.glob("*.ptx"))
    assert len(ptx) == 4 and all(re.search(r"mma\.sync\.aligned\.\w+\.row\.col\.f64", p.read_text()) for p in ptx)


@pytest.mark.parametrize("kernel", ["forward", "dkdv", "fused", "dq"])
def test_fp32_tensor_core_first_configs_fit_shared_memory_at_d128(kernel):
    """fp32 tiles on tensor cores take twice a 16-bit tile's shared memory: the first config the wide-head rule
    leaves at d 128 (what CS336_AUTOTUNE=0 launches) compiles for sm_90 within the H200's 227 KiB, in tf32x3."""
    pytest.importorskip("triton")
    # Without --config the script compiles the first config the kernel's autotuner keeps for the launch.
    done = _run_ptx_script("--kernel", kernel, "--dtype", "fp32", "--precision", "tf32x3", "--d", "128")
    assert done.returncode == 0, done.stderr[-2000:]
    line = done.stdout.strip().splitlines()[-1]
    shared = re.search(r"shared (\d+) KiB", line)
    assert shared and int(shared.group(1)) < 227, line
    assert re.search(r"\bW\d+", line) or kernel != "forward", line  # the forward's dots run as wgmma


# ---- The Gluon backward passes (Hopper only) ----

# Ragged lengths (TMA zero-fill and clipped stores), n_queries != n_keys both ways, a single query row,
# 3-D input, and lengths shorter than one tile.
GLUON_SHAPES = [(1, 2, 256, 256, 128), (2, 3, 1000, 1000, 64), (1, 2, 513, 257, 128), (1, 1, 77, 300, 64),
                (2, None, 130, 130, 128), (1, 1, 1, 130, 64), (1, 2, 40, 40, 128)]


def _head_views(count, batch, seq, heads, d, seed):
    """`count` random bf16 (batch, heads, seq, d) views of (batch, seq, heads x d) tensors: the model's head split."""
    torch.manual_seed(seed)
    return [torch.randn(batch, seq, heads * d, device="cuda", dtype=torch.bfloat16).view(batch, seq, heads, d)
            .transpose(1, 2) for _ in range(count)]


def test_backward_choice_names_the_kernels_on_cpu():
    """`choose_backward` resolves every `backward=` once; on the interpreter (no Gluon) into the `tl` kernels."""
    from cs336_systems.kernels.flash_attention.dispatch import BACKWARD_OPTIONS, BackwardOptions, choose_backward

    q, k, v, do = (torch.randn(1, 2, 64, 64) for _ in range(4))
    chosen = {name: choose_backward(q, k, v, do, options).kernels for name, options in BACKWARD_OPTIONS.items()}
    assert chosen == {"triton": ("dkdv", "dq"), "two-pass": ("dkdv", "dq"), "tl": ("dkdv", "dq"), "fused": ("fused",)}
    assert choose_backward(q, k, v, do, BackwardOptions(fused=True)).accumulator == "tl"
    assert choose_backward(q, k, v, do, BackwardOptions()).accumulator is None
    assert choose_backward(q, k, v, do, BackwardOptions(use_tma=True)).kernels == ("dkdv-tma", "dq-tma")
    shifted = [t[..., 1:33] for t in (q, k, v, do)]  # bases 4 bytes past 16-byte alignment: no descriptors
    assert choose_backward(*shifted, BackwardOptions(use_tma=True)).kernels == ("dkdv", "dq")
    for d in (200, 256):  # wide heads in 16 bits: the dV and dK passes apart
        wide = [torch.randn(1, 2, 64, d, dtype=torch.float16) for _ in range(4)]
        assert choose_backward(*wide, BackwardOptions()).kernels == ("dkdv-split", "dq")
    assert choose_backward(*(t.half() for t in (q, k, v, do)), BackwardOptions()).kernels == ("dkdv", "dq")


def test_default_kernels_by_head_dim_length_and_programs():
    """The defaults as measured (hopper_backward.ONE_PASS_*, hopper_forward.WS_LONG_* / SHORT_*), on a GPU of 132
    SMs: one pass at d 64 and 128 where its programs of 128 keys fill the GPU and there are at least
    ONE_PASS_MIN_KEYS keys; the warp-specialised forward at d 128 everywhere, at d 64 where rows are long and its
    programs fill the GPU, 64 x 64 tiles for short rows; other head dims neither."""
    from cs336_systems.kernels.flash_attention import hopper_one_pass
    from cs336_systems.kernels.flash_attention.hopper_backward import (
        ONE_PASS_HEAD_DIMS,
        ONE_PASS_KEYS_PER_PROGRAM,
        one_pass_by_default,
    )
    from cs336_systems.kernels.flash_attention.hopper_forward import (
        FORWARD_CONFIG,
        SHORT_FORWARD_CONFIG,
        WS_FORWARD_CONFIG,
        WS_LONG_CONFIG,
        default_forward,
    )

    for d in ONE_PASS_HEAD_DIMS:  # the rule counts the kernel's own programs
        assert hopper_one_pass.CONFIG[d][1] == ONE_PASS_KEYS_PER_PROGRAM, d
    sms = 132
    for d in (64, 128):
        for batch, heads, seq in ((4, 32, 16384), (4, 32, 4096), (1, 1, 32768), (1, 1, 65536)):
            assert one_pass_by_default(batch, heads, seq, d, sms), (batch, heads, seq, d)
        for batch, heads, seq in ((1, 1, 8192), (1, 1, 16384), (4, 12, 2048), (4, 12, 512)):  # few programs, keys
            assert not one_pass_by_default(batch, heads, seq, d, sms), (batch, heads, seq, d)
    assert not one_pass_by_default(4, 32, 16384, 80, sms) and not one_pass_by_default(4, 32, 16384, 256, sms)

    assert default_forward(4, 32, 16384, 16384, 64, sms) == (True, WS_LONG_CONFIG[64])
    assert default_forward(1, 1, 65536, 65536, 64, sms) == (True, WS_LONG_CONFIG[64])  # 512 programs
    assert default_forward(1, 1, 16384, 16384, 64, sms) == (False, FORWARD_CONFIG[64])  # 128 programs
    assert default_forward(4, 32, 4096, 4096, 64, sms) == (False, SHORT_FORWARD_CONFIG[64])
    assert default_forward(1, 1, 512, 512, 128, sms) == (True, WS_FORWARD_CONFIG)


@requires_hopper
@pytest.mark.parametrize("d", [64, 128])
def test_backward_choice_on_hopper(d):
    """The defaults the constants of hopper_backward.py / hopper_one_pass.py name, and what each option forces."""
    from cs336_systems.kernels.flash_attention.dispatch import BACKWARD_OPTIONS, BackwardOptions, choose_backward
    from cs336_systems.kernels.flash_attention.hopper_backward import one_pass_by_default
    from cs336_systems.kernels.flash_attention.launches import sm_count

    q, k, v, do = _head_views(4, 1, 256, 2, d, seed=0)

    def kernels(options):
        return choose_backward(q, k, v, do, options).kernels

    two_gluon_passes = ("dkdv-gluon", "dq-gluon")
    assert not one_pass_by_default(1, 2, 256, d, sm_count(q.device))  # 4 programs and 256 keys: two passes
    assert kernels(BACKWARD_OPTIONS["triton"]) == two_gluon_passes
    wide = _head_views(4, 2, 4096, 16, d, seed=0)  # 2 x 16 x 32 programs of 128 keys: one pass at both
    assert choose_backward(*wide, BACKWARD_OPTIONS["triton"]).kernels == ("fused-gluon-ws",)
    assert kernels(BACKWARD_OPTIONS["two-pass"]) == two_gluon_passes
    assert kernels(BACKWARD_OPTIONS["tl"]) == ("dkdv", "dq")
    assert kernels(BackwardOptions(fused=True, warp_specialised=False)) == ("fused-gluon",)
    assert kernels(BackwardOptions(fused=True, gluon=False)) == ("fused",)
    assert kernels(BackwardOptions(use_tma=True)) == ("dkdv-tma", "dq-tma")
    one_row = [t[:, :, :1] for t in (q, k, v, do)]  # `one_pass_eligible`: more than one query row
    assert choose_backward(*one_row, BackwardOptions(fused=True)).kernels == ("fused",)


def _two_pass_grads(q, k, v, out, lse, do, causal, **options):
    """(dq, dk, dv) from the two backward passes `backward_launches(**options)` builds."""
    from cs336_systems.kernels.flash_attention.dispatch import backward_launches

    preprocess, dkdv, dq_pass, finish = backward_launches(q, k, v, out, lse, do, causal, **options)
    preprocess()
    dkdv()
    dq_pass()
    return finish()


def test_gluon_passes_only_where_eligible():
    from cs336_systems.kernels.flash_attention.dispatch import forward_launch
    from cs336_systems.kernels.flash_attention.hopper_backward import eligible
    from cs336_systems.kernels.flash_attention.hopper_forward import flash_forward_gluon_kernel, flash_forward_ws_kernel
    from cs336_systems.kernels.flash_attention.launches import GluonPass, KernelLaunch, tma_eligible

    assert not eligible(torch.randn(1, 1, 64, 64, dtype=torch.bfloat16))  # CPU tensors
    device = kernel_device()
    for dtype, d in ((torch.bfloat16, 64), (torch.float32, 64), (torch.bfloat16, 80)):
        q, k, v = (torch.randn(1, 2, 64, d, device=device, dtype=dtype) for _ in range(3))
        launch, _, _ = forward_launch(q, k, v, True, gluon=True)  # asked for, taken only where eligible
        hopper = device == "cuda" and torch.cuda.get_device_capability() == (9, 0)
        gluon = isinstance(launch, GluonPass) and launch.kernel in (flash_forward_gluon_kernel, flash_forward_ws_kernel)
        assert gluon == (hopper and eligible(q)), (dtype, d)
        assert isinstance(launch, KernelLaunch) != gluon
        launch, _, _ = forward_launch(q, k, v, True, gluon=False)
        assert isinstance(launch, KernelLaunch)
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        good = torch.randn(1, 2, 64, 128, device="cuda", dtype=torch.bfloat16)
        head_view = torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.float16).transpose(1, 2)
        assert eligible(good) and eligible(head_view)
        assert not eligible(good.float())  # fp32 takes the tl passes
        assert not eligible(good[..., :80])  # head dim 80
        strided = good[..., :96].transpose(-1, -2)[..., :64]  # d not unit-stride: TMA's check says no
        assert eligible(strided) and not tma_eligible(strided)


@requires_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", GLUON_SHAPES)
def test_gluon_backward_matches_reference(shape, causal, dtype):
    from cs336_systems.kernels.flash_attention import dispatch, function, hopper_one_pass
    from cs336_systems.kernels.flash_attention.hopper_backward import GLUON_PASSES, one_pass_by_default
    from cs336_systems.kernels.flash_attention.launches import GluonPass, sm_count

    class GluonBoth(function.FlashAttentionTriton):  # both passes in Gluon, whatever the default
        @staticmethod
        def backward(ctx, grad_out):
            lse, q, k, v, out = ctx.saved_tensors
            return (*dispatch.flash_backward(q, k, v, out, lse, grad_out, ctx.is_causal,
                                            dispatch.BackwardOptions(gluon=True)), None)

    b, h, n, m, d = shape
    probe = [torch.empty(b, *(() if h is None else (h,)), x, d, device="cuda", dtype=dtype) for x in (n, m, m)]
    out, lse = dispatch.flash_forward(*probe, causal)
    for gluon in (None, True):
        _, dkdv, dq, _ = dispatch.backward_launches(*probe, out, lse, torch.empty_like(out), causal, gluon=gluon)
        if gluon is None and n > 1 and one_pass_by_default(b, h or 1, m, d, sm_count(probe[0].device)):
            # the default is the warp-specialised one-pass kernel there
            assert dkdv.kernel is hopper_one_pass.flash_bwd_one_pass_ws_kernel and dq is None
            continue
        for name, launch in (("dkdv", dkdv), ("dq", dq)):  # the default path takes the shipped ones
            assert isinstance(launch, GluonPass) == (gluon or name in GLUON_PASSES), (gluon, name)
    _check_against_reference(_triton_fn(), shape, causal, dtype, "cuda")  # the default backward
    _check_against_reference(lambda q, k, v, c: GluonBoth.apply(q, k, v, c), shape, causal, dtype, "cuda")


@requires_hopper
@pytest.mark.parametrize("causal", [False, True])
def test_gluon_backward_agrees_with_tl_passes_on_the_models_head_views(causal):
    """The model's head split (strided 4-D views of (batch, seq, heads x d)); both implementations within
    a few bf16 ulps of each other, and dK/dV/dQ in the inputs' layout."""
    from cs336_systems.kernels.flash_attention.dispatch import flash_forward

    q, k, v, do = _head_views(4, 2, 700, 4, 128, seed=2)
    out, lse = flash_forward(q, k, v, causal)
    grads = {gluon: _two_pass_grads(q, k, v, out, lse, do, causal, gluon=gluon) for gluon in (False, True)}
    for name, tl_grad, gluon_grad in zip(("dq", "dk", "dv"), grads[False], grads[True]):
        assert gluon_grad.stride() == tl_grad.stride() == q.stride(), name
        scale = tl_grad.float().abs().max().item()
        assert (gluon_grad.float() - tl_grad.float()).abs().max().item() <= 2 ** -6 * scale, name


@requires_hopper
@pytest.mark.parametrize("d", [64, 128])
def test_gluon_register_operand_variants_agree_with_tl_passes(d):
    """K/V (dK/dV pass) and Q/dO (dQ pass) held in registers for the first two products, every choice that
    attention-tune times: the same gradients as the `tl` passes (ragged length, causal, strided head views)."""
    import dataclasses

    from cs336_systems.kernels.flash_attention.dispatch import backward_launches, flash_forward

    q, k, v, do = _head_views(4, 2, 700, 3, d, seed=5)
    out, lse = flash_forward(q, k, v, True)
    want_dq, want_dk, want_dv = _two_pass_grads(q, k, v, out, lse, do, True, gluon=False)
    for regs in (0, 1, 2):
        preprocess, dkdv, dq_pass, finish = backward_launches(q, k, v, out, lse, do, True, gluon=True)
        preprocess()
        dataclasses.replace(dkdv, flags=dkdv.flags | dict(KV_REGS=regs))()
        dataclasses.replace(dq_pass, flags=dq_pass.flags | dict(QDO_REGS=regs))()
        for name, want, got in zip(("dq", "dk", "dv"), (want_dq, want_dk, want_dv), finish()):
            scale = want.float().abs().max().item()
            error = (got.float() - want.float()).abs().max().item()
            assert error <= 2 ** -6 * scale, (name, regs, error, scale)


@requires_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", GLUON_SHAPES)
def test_gluon_one_pass_backward_matches_reference(shape, causal, dtype):
    """backward="fused" on Hopper: a Gluon one-pass kernel adding dQ's shares into fp32 rows (the
    warp-specialised one at its head dims, else the lockstep dK/dV pass with a dQ split)."""
    from cs336_systems.kernels.flash_attention import dispatch, hopper_one_pass
    from cs336_systems.kernels.flash_attention.launches import GluonPass

    b, h, n, m, d = shape
    probe = [torch.empty(b, *(() if h is None else (h,)), x, d, device="cuda", dtype=dtype) for x in (n, m, m)]
    out, lse = dispatch.flash_forward(*probe, causal)
    _, one_pass, dq_pass, _ = dispatch.backward_launches(*probe, out, lse, torch.empty_like(out), causal, fused=True)
    # One query row takes the tl one-pass kernel (dispatch.backward_launches says why).
    assert isinstance(one_pass, GluonPass) == (n > 1) and dq_pass is None
    if n > 1 and d in hopper_one_pass.HEAD_DIMS:
        assert one_pass.kernel is hopper_one_pass.flash_bwd_one_pass_ws_kernel
    elif n > 1:
        assert one_pass.flags["DQ_SPLIT"] > 0
    _check_against_reference(_triton_fn("fused"), shape, causal, dtype, "cuda")


@requires_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [shape for shape in GLUON_SHAPES if shape[2] > 1])  # (one row: the tl kernel)
def test_warp_specialised_one_pass_matches_reference(shape, causal, dtype):
    """The warp-specialised one-pass backward (hopper_one_pass.py, attention-tune kernel fused-gluon-ws), every
    tuned config: dQ, dK and dV within PyTorch's own low-precision error of the fp64 reference's."""
    import triton

    from cs336_systems.bench.suites.attention_tune import GLUON_SPACE
    from cs336_systems.kernels.flash_attention.dispatch import backward_launches, flash_forward
    from cs336_systems.kernels.flash_attention.hopper_one_pass import flash_bwd_one_pass_ws_kernel

    b, h, n, m, d = shape
    torch.manual_seed(7)
    q, k, v, do = (torch.randn(b, *(() if h is None else (h,)), x, d, device="cuda", dtype=dtype)
                   for x in (n, m, m, n))
    out, lse = flash_forward(q, k, v, causal)
    exact = [t.detach().requires_grad_() for t in (q.double(), k.double(), v.double())]
    naive_attention(*exact, causal).backward(do.double())
    low = [t.detach().requires_grad_() for t in (q, k, v)]
    naive_attention(*low, causal, upcast=False).backward(do)
    checked = 0
    for config in GLUON_SPACE["fused-gluon-ws"]:
        preprocess, one_pass, dq_pass, finish = backward_launches(q, k, v, out, lse, do, causal, fused=True,
                                                                  warp_specialised=True)
        assert one_pass.kernel is flash_bwd_one_pass_ws_kernel and dq_pass is None
        preprocess()
        try:
            one_pass.with_config(*config)()
        except triton.runtime.errors.OutOfResources:
            continue
        checked += 1
        for name, got, want, torch_low in zip(("dq", "dk", "dv"), finish(), exact, low):
            assert got.stride() == q.stride() if name == "dq" else got.stride() == k.stride()
            assert_within_budget(f"{name} {config}", got, want.grad, torch_low.grad)
    assert checked >= 1, checked


@requires_hopper
@pytest.mark.parametrize("d", [64, 128])
def test_warp_specialised_one_pass_agrees_with_two_passes_on_the_models_head_views(d):
    """The warp-specialised one-pass backward on strided head views with ragged lengths, causal and not: the
    two Gluon passes' gradients within a few bf16 ulps, in the inputs' layout. (700 queries: 11 query tiles, so at
    d 64, where the consumers take turns at dQ, each takes both odd and even counts of steps.)"""
    from cs336_systems.kernels.flash_attention.dispatch import backward_launches, flash_forward

    q, k, v, do = _head_views(4, 2, 700, 3, d, seed=8)
    for causal in (False, True):
        out, lse = flash_forward(q, k, v, causal)
        want = _two_pass_grads(q, k, v, out, lse, do, causal, gluon=True)
        preprocess, one_pass, _, finish = backward_launches(q, k, v, out, lse, do, causal, fused=True,
                                                            warp_specialised=True)
        preprocess()
        one_pass()
        for name, got, ref in zip(("dq", "dk", "dv"), finish(), want):
            assert got.stride() == ref.stride() == q.stride(), name
            scale = ref.float().abs().max().item()
            assert (got.float() - ref.float()).abs().max().item() <= 2 ** -6 * scale, (name, causal)


@pytest.mark.parametrize("d", [64, 128])
def test_warp_specialised_one_pass_compiles_for_hopper(d):
    """The warp-specialised one-pass kernel, from its PTX on any machine: Q/dO by TMA, S^T waited for with
    dP^T left in flight, and the dQ share added by TMA reduce-add."""
    done = _run_ptx_script("--kernel", "fused-gluon-ws", "--d", str(d))
    assert done.returncode == 0, done.stderr[-2000:]
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith("fused-gluon-ws") and "|1" in line, line
    assert int(re.search(r"TMA (\d+)", line).group(1)) > 0, line


@requires_hopper
@pytest.mark.parametrize("d", [64, 128])
def test_gluon_one_pass_configs_agree_with_two_passes(d):
    """Every config and dQ column split that attention-tune times gives the two-pass gradients (ragged
    lengths, causal, the model's strided head views)."""
    import dataclasses

    import triton

    from cs336_systems.bench.suites.attention_tune import FUSED_GLUON_SPACE
    from cs336_systems.kernels.flash_attention.dispatch import backward_launches, flash_forward

    q, k, v, do = _head_views(4, 2, 1000, 3, d, seed=3)
    out, lse = flash_forward(q, k, v, True)
    reference = _two_pass_grads(q, k, v, out, lse, do, True, gluon=False)
    checked = 0
    for config in FUSED_GLUON_SPACE:
        for split, reduce_by_tma in ((1, 1), (2, 1), (2, 0)):
            preprocess, one_pass, _, finish = backward_launches(q, k, v, out, lse, do, True, fused=True,
                                                                warp_specialised=False)
            preprocess()
            flags = one_pass.flags | dict(DQ_SPLIT=split, DQ_TMA=reduce_by_tma)
            try:
                dataclasses.replace(one_pass, flags=flags).with_config(*config)()
            except triton.runtime.errors.OutOfResources:
                continue  # e.g. 3 stages at d 128: attention-tune records these as unsupported
            checked += 1
            for name, want, got in zip(("dq", "dk", "dv"), reference, finish()):
                assert got.stride() == want.stride(), name
                scale = want.float().abs().max().item()
                error = (got.float() - want.float()).abs().max().item()
                assert error <= 2 ** -6 * scale, (name, config, split, reduce_by_tma, error, scale)
    assert checked >= 6, checked  # most of the space fits


@requires_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", GLUON_SHAPES)
def test_gluon_forward_matches_reference(shape, causal, dtype):
    """Both Gluon forwards (hopper_forward.py: in-warpgroup overlap, warp-specialised) against the fp64 reference:
    O within PyTorch's own low-precision error, L to fp32 rounding; and the whole default path (forward and
    gradients) on the same shapes."""
    from cs336_systems.kernels.flash_attention.dispatch import forward_launch
    from cs336_systems.kernels.flash_attention.hopper_forward import (
        GLUON_HEAD_DIMS,
        WARP_SPECIALISED_HEAD_DIMS,
        flash_forward_gluon_kernel,
        flash_forward_ws_kernel,
    )

    q, k, v = (t.detach() for t in _inputs(*shape, dtype, "cuda"))
    d = shape[-1]
    default, _, _ = forward_launch(q, k, v, causal)
    want = (None if d not in GLUON_HEAD_DIMS
            else flash_forward_ws_kernel if d in WARP_SPECIALISED_HEAD_DIMS else flash_forward_gluon_kernel)
    assert getattr(default, "kernel", None) is want
    exact, exact_lse = naive_attention(q.double(), k.double(), v.double(), causal, return_lse=True)
    low = naive_attention(q, k, v, causal, upcast=False)
    for warp_specialised, kernel in ((False, flash_forward_gluon_kernel), (True, flash_forward_ws_kernel)):
        launch, out, lse = forward_launch(q, k, v, causal, gluon=True, warp_specialised=warp_specialised)
        assert launch.kernel is kernel
        launch()
        assert_within_budget(f"out ws={warp_specialised}", out, exact, low)
        assert lse.dtype == torch.float32 and lse.shape == q.shape[:-1]
        assert (lse.double() - exact_lse).abs().max().item() <= 1e-3, warp_specialised
    _check_against_reference(_triton_fn(), shape, causal, dtype, "cuda")


@requires_hopper
@pytest.mark.parametrize("d", [64, 128])
def test_gluon_forward_configs_match_reference_on_the_models_head_views(d):
    """Every config attention-tune times (both rescale placements), on strided head views of (batch, seq,
    heads x d) with a ragged length, causal and not: O in q's layout and within budget, L to fp32 rounding."""
    import dataclasses
    import itertools

    import triton

    from cs336_systems.bench.suites.attention_tune import FORWARD_GLUON_SPACE
    from cs336_systems.kernels.flash_attention.dispatch import forward_launch

    q, k, v = _head_views(3, 2, 1000, 3, d, seed=4)
    checked = 0
    for causal in (False, True):
        exact, exact_lse = naive_attention(q.double(), k.double(), v.double(), causal, return_lse=True)
        low = naive_attention(q, k, v, causal, upcast=False)
        for config, early in itertools.product(FORWARD_GLUON_SPACE, (True, False)):
            launch, out, lse = forward_launch(q, k, v, causal, gluon=True, warp_specialised=False)
            launch = dataclasses.replace(launch, flags=launch.flags | dict(RESCALE_EARLY=early))
            try:
                launch.with_config(*config)()
            except triton.runtime.errors.OutOfResources:
                continue  # e.g. 3 stages of 128-row tiles at d 128: attention-tune records these as unsupported
            checked += 1
            assert out.stride() == q.stride(), config
            assert_within_budget(f"out {config} early={early} causal={causal}", out, exact, low)
            assert (lse.double() - exact_lse).abs().max().item() <= 1e-3, (config, early)
    assert checked >= 24, checked  # most of the space fits


def _gluon_case_inputs(shape, heads_view: bool, count: int, seed: int):
    """q, k, v (and dO where count is 4), bf16 (batch, heads, seq, d) on the GPU, for a GLUON_SHAPES case: contiguous
    (no heads: one), or the model's strided head views of the same shape (skipped where the lengths differ)."""
    batch, heads, n_queries, n_keys, d = shape
    if heads_view:
        if n_queries != n_keys:
            pytest.skip("the head views share one length")
        return _head_views(count, batch, n_queries, heads or 1, d, seed=seed)
    q, k, v = (t.detach() if t.dim() == 4 else t.detach().unsqueeze(1) for t in _inputs(*shape, torch.bfloat16, "cuda"))
    return [q, k, v, torch.randn_like(q)][:count]


@requires_hopper
@pytest.mark.parametrize("heads_view", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", GLUON_SHAPES)
def test_gluon_forward_on_host_descriptors_matches_reference(shape, causal, heads_view):
    """The in-warpgroup forward on the host's 4D tensor descriptors (attention-tune kernel forward-gluon-late-host),
    every tuned config, on contiguous inputs and on the model's strided head views of the same shape: O and L
    bit-equal to the same kernel on its own per-program descriptors (only the addressing differs), O within
    PyTorch's own bf16 error of the fp64 reference and in q's layout, L to fp32 rounding; rows past the end neither
    read from the next head nor written."""
    import triton

    from cs336_systems.bench.suites.attention_tune import FORWARD_GLUON_SPACE
    from cs336_systems.kernels.flash_attention import hopper_forward
    from cs336_systems.kernels.flash_attention.buffers import forward_buffers
    from cs336_systems.kernels.flash_attention.launches import install_descriptor_allocator

    d = shape[-1]
    q, k, v = _gluon_case_inputs(shape, heads_view, 3, seed=6)
    exact, exact_lse = naive_attention(q.double(), k.double(), v.double(), causal, return_lse=True)
    low = naive_attention(q, k, v, causal, upcast=False)
    install_descriptor_allocator(q.device)  # the shipped kernel's descriptors are made in its programs' scratch
    checked = 0
    for config in FORWARD_GLUON_SPACE:
        own_out, own_lse = forward_buffers(q)
        own = hopper_forward.forward_pass(q, k, v, own_out, own_lse, causal, d ** -0.5, warp_specialised=False)
        out, lse = forward_buffers(q)
        out.fill_(float("nan"))
        launch = hopper_forward.forward_pass(q, k, v, out, lse, causal, d ** -0.5, warp_specialised=False,
                                             host_descriptors=True)
        try:
            own.with_config(*config)()
            launch.with_config(*config)()
        except triton.runtime.errors.OutOfResources:
            continue
        checked += 1
        assert torch.equal(out, own_out) and torch.equal(lse, own_lse), config
        assert out.stride() == q.stride(), config
        assert_within_budget(f"out {config}", out, exact, low)
        assert (lse.double() - exact_lse).abs().max().item() <= 1e-3, config
    assert checked >= 6, checked


def test_on_host_descriptors_tiles_the_named_arguments_by_the_configs_rows():
    """A pass put on the host's descriptors: the tensors at the named positions become descriptors in tiles of the
    config's BLOCK_M or BLOCK_N rows (made per config), every other argument is passed as it was, HOST_DESCRIPTORS
    is set; an empty batch keeps the pass as it was."""
    from cs336_systems.kernels.flash_attention import gluon_common
    from cs336_systems.kernels.flash_attention.launches import GluonPass

    q, k = torch.zeros(2, 3, 40, 64, dtype=torch.bfloat16), torch.zeros(2, 3, 24, 64, dtype=torch.bfloat16)
    lse = torch.zeros(2, 3, 40)
    own = GluonPass(None, (q, k, lse, 7), dict(IS_CAUSAL=True), (64, 32, 4, 2), lambda m, n: (1, 6))
    host = gluon_common.on_host_descriptors(own, {0: "M", 1: "N"})
    assert host.flags == dict(IS_CAUSAL=True, HOST_DESCRIPTORS=True) and own.args_for is None
    q_tiles, k_tiles, lse_arg, seven = host.args_for(128, 32)
    assert q_tiles.base is q and list(q_tiles.block_shape) == [1, 1, 128, 64]
    assert k_tiles.base is k and list(k_tiles.block_shape) == [1, 1, 32, 64]
    assert lse_arg is lse and seven == 7
    empty = GluonPass(None, (q[:0], k[:0], lse[:0], 7), {}, (64, 32, 4, 2), lambda m, n: (1, 0))
    assert gluon_common.on_host_descriptors(empty, {0: "M", 1: "N"}) is empty


@requires_hopper
@pytest.mark.parametrize("launcher", ["native", "python"])
def test_an_empty_batch_takes_the_gluon_passes_and_gives_empty_results(launcher):
    """A batch of none: no descriptor can describe it (their sizes must be positive), so the passes keep their own
    (`forward_pass`, `backward_passes`); O and the gradients come back empty, in the inputs' shapes."""
    from cs336_systems.kernels.flash_attention.function import flash_attention

    q, k, v = (torch.randn(0, 4, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = flash_attention(q, k, v, True, launcher=launcher)
    out.backward(torch.ones_like(out))
    assert out.shape == q.shape and all(t.grad is not None and t.grad.shape == t.shape for t in (q, k, v))


@requires_hopper
@pytest.mark.parametrize("heads_view", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", GLUON_SHAPES)
def test_gluon_backward_on_host_descriptors_matches_its_own(shape, causal, heads_view):
    """The two Gluon backward passes on the host's 4D tensor descriptors (attention-tune kernels dkdv-gluon-host,
    dq-gluon-host), every tuned config of each: dQ, dK and dV bit-equal to the same passes on their own per-program
    descriptors (only the addressing differs), on contiguous inputs and the model's strided head views."""
    import triton

    from cs336_systems.bench.suites.attention_tune import GLUON_SPACE
    from cs336_systems.kernels.flash_attention import hopper_backward
    from cs336_systems.kernels.flash_attention.dispatch import backward_launches, flash_forward

    d = shape[-1]
    q, k, v, do = _gluon_case_inputs(shape, heads_view, 4, seed=7)
    out, lse = flash_forward(q, k, v, causal)
    preprocess, dkdv, dq, finish = backward_launches(q, k, v, out, lse, do, causal, gluon=True)
    preprocess()  # D, read by both versions
    host_dkdv, host_dq = hopper_backward.backward_passes(*dq.args[:7], dkdv.args[6], dkdv.args[7], causal,
                                                         d ** -0.5, host_descriptors=True)
    checked = 0
    # Each pass's own outputs among finish()'s (dq, dk, dv): the buffers both versions write.
    for own, host, space, written in ((dkdv, host_dkdv, GLUON_SPACE["dkdv-gluon-host"], (1, 2)),
                                      (dq, host_dq, GLUON_SPACE["dq-gluon-host"], (0,))):
        for config in space:
            try:
                own.with_config(*config)()
                want = [finish()[i].clone() for i in written]
                for i in written:
                    finish()[i].fill_(float("nan"))
                host.with_config(*config)()
            except triton.runtime.errors.OutOfResources:
                continue
            checked += 1
            for i, expected in zip(written, want):
                assert torch.equal(finish()[i], expected), (("dq", "dk", "dv")[i], config)
    assert checked >= 6, checked


def test_the_passes_on_host_descriptors_make_none_per_program():
    """The host-descriptor forward and backward passes compile for sm_90 (any machine) with 4D tensor copies and no
    descriptor made in the kernel, where the defaults make one per tensor and program (forward 4, dK/dV 6, dQ 5),
    and keep the same loop schedules."""
    import re

    done = _run_ptx_script("--kernel", "forward-gluon-late,forward-gluon-late-host", "--d", "64", "--config",
                           "64x64x4x2,128x128x8x2")
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    made = {(line.split()[0], line.split()[1]): int(re.search(r"descriptors made (\d+)", line).group(1))
            for line in lines}
    assert made == {("forward-gluon-late", "64x64"): 4, ("forward-gluon-late", "128x128"): 4,
                    ("forward-gluon-late-host", "64x64"): 0, ("forward-gluon-late-host", "128x128"): 0}, made
    schedules = [line.split(";")[1] for line in lines]
    assert schedules[0] == schedules[2] and schedules[1] == schedules[3], lines
    assert all("0 B spilled" in line for line in lines), lines
    done = _run_ptx_script("--kernel", "dkdv-gluon,dkdv-gluon-host,dq-gluon,dq-gluon-host", "--d", "64", "--config",
                           "64x64x4x2")
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    made = [int(re.search(r"descriptors made (\d+)", line).group(1)) for line in lines]
    assert made == [6, 0, 5, 0], lines
    assert lines[0].split(";")[1] == lines[1].split(";")[1] and lines[2].split(";")[1] == lines[3].split(";")[1]


@requires_hopper
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", GLUON_SHAPES)
def test_warp_specialised_forward_configs_match_reference(shape, causal):
    """The warp-specialised forward (attention-tune kernel forward-gluon-ws), every tuned config: O within
    PyTorch's own bf16 error of the fp64 reference, L to fp32 rounding."""
    import triton

    from cs336_systems.bench.suites.attention_tune import GLUON_SPACE
    from cs336_systems.kernels.flash_attention.dispatch import forward_launch

    q, k, v = (t.detach() for t in _inputs(*shape, torch.bfloat16, "cuda"))
    exact, exact_lse = naive_attention(q.double(), k.double(), v.double(), causal, return_lse=True)
    low = naive_attention(q, k, v, causal, upcast=False)
    checked = 0
    for config in GLUON_SPACE["forward-gluon-ws"]:
        launch, out, lse = forward_launch(q, k, v, causal, gluon=True, warp_specialised=True)
        try:
            launch.with_config(*config)()
        except triton.runtime.errors.OutOfResources:
            continue
        checked += 1
        assert_within_budget(f"out {config}", out, exact, low)
        assert (lse.double() - exact_lse).abs().max().item() <= 1e-3, config
    assert checked >= 3, checked


@requires_hopper
@pytest.mark.parametrize("d", [64, 128])
def test_warp_specialised_forward_on_the_models_head_views(d):
    """The warp-specialised forward (the default at d 128) on strided head views of (batch, seq, heads x d) with
    a ragged length, causal and not: O in q's layout and within budget, L to fp32 rounding."""
    from cs336_systems.kernels.flash_attention.dispatch import forward_launch
    from cs336_systems.kernels.flash_attention.hopper_forward import flash_forward_ws_kernel

    q, k, v = _head_views(3, 2, 1000, 3, d, seed=5)
    for causal in (False, True):
        exact, exact_lse = naive_attention(q.double(), k.double(), v.double(), causal, return_lse=True)
        launch, out, lse = forward_launch(q, k, v, causal, warp_specialised=True)
        assert launch.kernel is flash_forward_ws_kernel
        launch()
        assert out.stride() == q.stride()
        assert_within_budget(f"out causal={causal}", out, exact, naive_attention(q, k, v, causal, upcast=False))
        assert (lse.double() - exact_lse).abs().max().item() <= 1e-3, causal


def test_gluon_passes_compile_for_hopper_with_products_left_in_flight():
    """The point of the Gluon passes, checked from their PTX on any machine: the waits leave one product in
    flight (`wgmma.wait_group 1`), where the `tl` passes wait for everything (`wgmma.wait_group 0`)."""
    import re

    done = _run_ptx_script("--kernel", "dkdv-gluon,dq-gluon,fused-gluon,forward-gluon,forward-gluon-ws,dkdv", "--d",
                           "64")
    assert done.returncode == 0, done.stderr[-2000:]
    lines = {line.split()[0]: line for line in done.stdout.strip().splitlines()}
    for name in ("dkdv-gluon", "dq-gluon", "fused-gluon", "forward-gluon", "forward-gluon-ws"):
        assert int(re.search(r"TMA (\d+)", lines[name]).group(1)) > 0, lines[name]
        assert "|1" in lines[name], lines[name]
    assert "|1" not in lines["dkdv"], lines["dkdv"]


@requires_hopper
@pytest.mark.parametrize("backward", ["triton", "two-pass", "fused"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gluon_backwards_give_the_first_causal_row_exact_zeros(backward, head_dim):
    """Under a causal mask the first query sees one key: PyTorch's dQ for it is exactly 0 (and that key's dK gets
    nothing from it). Every Hopper backward (the warp-specialised one pass at d 64 and 128, the Gluon one pass, the two
    Gluon passes) zeroes that row's dS as the tl kernels do, rather than leave D's rounding residue."""
    from cs336_systems.kernels.flash_attention.function import flash_attention

    torch.manual_seed(11)
    q, k, v = (torch.randn(1, 2, 200, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    flash_attention(q, k, v, True, backward=backward).backward(torch.randn_like(q))
    assert torch.all(q.grad[..., 0, :] == 0), q.grad[..., 0, :].abs().max()
    low = [t.detach().requires_grad_() for t in (q, k, v)]
    naive_attention(*low, True, upcast=False).backward(torch.randn_like(q))
    assert torch.all(low[0].grad[..., 0, :] == 0)  # PyTorch's own, the rule's source
