"""The dot precision of fp32 attention (kernels/flash_attention/precision.py): how it is chosen, that a call's
backward keeps its forward's, and that "tf32x3" is as accurate as PyTorch's own fp32 attention kernel.

"tf32x3" is the arithmetic of SDPA's efficient backend in fp32 (three TF32 tensor-core products per dot), so
its error budget is PyTorch's: 2x the larger of naive fp32 attention's and SDPA-efficient's error against fp64.
"""

import pytest
import torch

from cs336_systems.kernels.flash_attention import precision
from cs336_systems.kernels.flash_attention.reference import naive_attention
from tests._support import assert_within_budget, kernel_device, max_abs_error, requires_cuda


@pytest.fixture(autouse=True)
def _unset_precision():
    """Each test starts with no precision set and allow_tf32 off, and leaves both as it found them. Set and
    restored through the public setters: pytest's monkeypatch (9.2) undoes a setattr on torch's cuBLASModule with
    delattr, which that module does not support."""
    saved_precision, saved_tf32 = precision.fp32_dot_precision_override(), torch.backends.cuda.matmul.allow_tf32
    precision.set_fp32_dot_precision(None)
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    precision.set_fp32_dot_precision(saved_precision)
    torch.backends.cuda.matmul.allow_tf32 = saved_tf32


def test_fp32_follows_allow_tf32_until_a_precision_is_set():
    assert precision.dot_precision(torch.float32) == "ieee"
    torch.backends.cuda.matmul.allow_tf32 = True
    assert precision.dot_precision(torch.float32) == "tf32"
    precision.set_fp32_dot_precision("tf32x3")
    assert precision.dot_precision(torch.float32) == "tf32x3"
    assert precision.dot_precision(torch.bfloat16) == "tf32"  # 16-bit dots: tensor cores whatever is set
    precision.set_fp32_dot_precision(None)
    assert precision.dot_precision(torch.float32) == "tf32"


def test_precision_block_restores_the_previous_setting():
    precision.set_fp32_dot_precision("tf32")
    with precision.fp32_dot_precision("tf32x3"):
        assert precision.dot_precision(torch.float32) == "tf32x3"
        with precision.fp32_dot_precision(None):  # None leaves it as it is
            assert precision.dot_precision(torch.float32) == "tf32x3"
    assert precision.fp32_dot_precision_override() == "tf32"
    with pytest.raises(RuntimeError), precision.fp32_dot_precision("ieee"):
        raise RuntimeError("an error inside the block")
    assert precision.fp32_dot_precision_override() == "tf32"


def test_unknown_precision_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"got 'fp64'; allowed: ieee, tf32x3, tf32"):
        precision.set_fp32_dot_precision("fp64")
    assert precision.fp32_dot_precision_override() is None
    pytest.importorskip("triton")
    from cs336_systems.kernels.flash_attention.function import flash_attention

    q = torch.randn(1, 8, 16)
    with pytest.raises(ValueError, match="flash_attention: fp32_precision: got 'bf16'; allowed: ieee, tf32x3, tf32"):
        flash_attention(q, q, q, fp32_precision="bf16")


def test_environment_variable_is_checked_at_import():
    import subprocess
    import sys

    code = "import cs336_systems.kernels.flash_attention.precision as p; print(p.fp32_dot_precision_override())"
    good = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**__import__("os").environ, precision.ENV_VAR: "tf32x3"})
    assert good.returncode == 0 and good.stdout.strip() == "tf32x3", good.stderr[-1000:]
    bad = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**__import__("os").environ, precision.ENV_VAR: "fast"})
    assert bad.returncode != 0 and "CS336_FLASH_FP32: got 'fast'" in bad.stderr


def _inputs(shape, dtype, device, seed=0):
    batch, heads, n_queries, n_keys, d = shape
    generator = torch.Generator().manual_seed(seed)
    lead = (batch,) if heads is None else (batch, heads)
    return [torch.randn(*lead, n, d, generator=generator, dtype=torch.float64).to(device=device, dtype=dtype)
            .requires_grad_() for n in (n_queries, n_keys, n_keys)]


def _run(fn, inputs, grad_out):
    out = fn(*inputs)
    return (out, *torch.autograd.grad(out, inputs, grad_out))


def test_a_calls_backward_runs_in_its_forwards_precision(monkeypatch):
    """fp32_precision= holds for the call; its backward, run after the call returned, launches with the same
    PRECISION, and the process setting is back as it was."""
    pytest.importorskip("triton")
    device = kernel_device()
    from cs336_systems.kernels.flash_attention import dispatch
    from cs336_systems.kernels.flash_attention.function import flash_attention

    seen = []
    launch_shape = dispatch._launch_shape

    def recording(q, k):
        shape = launch_shape(q, k)
        seen.append(shape[2])
        return shape

    monkeypatch.setattr(dispatch, "_launch_shape", recording)
    q, k, v = _inputs((1, 2, 37, 53, 16), torch.float32, device)
    out = flash_attention(q, k, v, True, fp32_precision="tf32x3")
    forward_launches = len(seen)
    assert precision.fp32_dot_precision_override() is None
    out.backward(torch.ones_like(out))
    assert forward_launches >= 1 and len(seen) > forward_launches
    assert set(seen) == {"tf32x3"}, seen


@pytest.mark.parametrize("causal", [False, True])
def test_tf32x3_matches_reference_small(causal):
    """On the interpreter (CPU) or the GPU: the tf32x3 call against fp64, every output."""
    pytest.importorskip("triton")
    device = kernel_device()
    _check_tf32x3((1, 2, 37, 53, 16), causal, "triton", device)


def _check_tf32x3(shape, causal, backward, device):
    from cs336_systems.kernels.flash_attention.function import flash_attention

    inputs = _inputs(shape, torch.float32, device)
    grad_out = torch.randn(*inputs[0].shape, generator=torch.Generator().manual_seed(1)).to(device)
    ours = _run(lambda q, k, v: flash_attention(q, k, v, causal, backward=backward, fp32_precision="tf32x3"),
                inputs, grad_out)
    exact_inputs = [t.detach().double().requires_grad_() for t in inputs]
    exact = _run(lambda q, k, v: naive_attention(q, k, v, causal), exact_inputs, grad_out.double())
    lows = [_run(lambda q, k, v: naive_attention(q, k, v, causal, upcast=False),
                 [t.detach().clone().requires_grad_() for t in inputs], grad_out)]
    if device == "cuda":  # PyTorch's own fp32 attention kernel, in the same arithmetic
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def efficient(q, k, v):  # (the backend takes 4-D inputs only: 3-D ones get a head dim of 1)
            q4, k4, v4 = (t.unsqueeze(1) if t.dim() == 3 else t for t in (q, k, v))
            with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                out = torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, is_causal=causal)
            return out.squeeze(1) if q.dim() == 3 else out

        lows.append(_run(efficient, [t.detach().clone().requires_grad_() for t in inputs], grad_out))
    for index, name in enumerate(("out", "dq", "dk", "dv")):
        torch_low = max((low[index] for low in lows), key=lambda t: max_abs_error(t, exact[index]))
        assert_within_budget(f"{name} {shape} causal={causal} {backward}", ours[index], exact[index], torch_low)
    return ours, exact


@requires_cuda
@pytest.mark.parametrize("backward", ["triton", "fused"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(1, None, 37, 53, 16), (2, 3, 70, 20, 32), (2, 2, 513, 257, 64),
                                   (1, 4, 1000, 1000, 128), (1, 1, 2048, 2048, 64), (2, None, 1, 17, 16)])
def test_tf32x3_within_pytorchs_fp32_attention_error_on_gpu(shape, causal, backward):
    _check_tf32x3(shape, causal, backward, "cuda")


@requires_cuda
def test_tf32x3_is_far_more_accurate_than_tf32_on_gpu():
    """The setting reaches the kernels: one TF32 product keeps 10 mantissa bits (about 1e-3 relative), three
    keep about 21, so tf32x3's error is a small fraction of tf32's."""
    from cs336_systems.kernels.flash_attention.function import flash_attention

    q, k, v = (t.detach() for t in _inputs((1, 2, 1024, 1024, 64), torch.float32, "cuda"))
    exact = naive_attention(q.double(), k.double(), v.double(), True)
    errors = {name: max_abs_error(flash_attention(q, k, v, True, fp32_precision=name), exact)
              for name in ("tf32", "tf32x3", "ieee")}
    assert errors["tf32x3"] * 50 < errors["tf32"], errors
    assert errors["tf32x3"] < 8 * errors["ieee"] + 1e-6, errors
