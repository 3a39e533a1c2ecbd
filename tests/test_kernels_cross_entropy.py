"""Fused LM head + cross-entropy against the materialised reference."""

import pytest
import torch

from cs336_systems.kernels.cross_entropy import lm_head_cross_entropy, lm_head_cross_entropy_reference


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_matches_reference_fp64(reduction, chunk):
    torch.manual_seed(0)
    h = torch.randn(3, 17, 24, dtype=torch.float64, requires_grad=True)
    w = torch.randn(101, 24, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 101, (3, 17))
    t[0, :5] = -100  # ignored
    loss = lm_head_cross_entropy(h, w, t, reduction=reduction, chunk_tokens=chunk)
    ref = lm_head_cross_entropy_reference(h, w, t, reduction=reduction)
    torch.testing.assert_close(loss.double(), ref.double(), rtol=1e-6, atol=1e-6)
    g = torch.autograd.grad(loss * 1.7, (h, w))
    r = torch.autograd.grad(ref * 1.7, (h, w))
    for a, b in zip(g, r):
        torch.testing.assert_close(a.double(), b, rtol=1e-6, atol=1e-8)
    assert g[0][0, :5].abs().max() == 0  # ignored tokens get no gradient


def test_bf16_error_within_budget_of_torch_bf16():
    torch.manual_seed(0)
    h = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(500, 32) * 0.2).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, 500, (64,))
    exact = lm_head_cross_entropy_reference(h.double(), w.double(), t)
    ours = lm_head_cross_entropy(h, w, t, chunk_tokens=16)
    torch_bf16 = lm_head_cross_entropy_reference(h, w, t)
    assert abs(ours.double() - exact) <= 2 * abs(torch_bf16.double() - exact) + 2 * torch.finfo(torch.bfloat16).eps
    assert ours.dtype == torch.float32


@pytest.mark.parametrize("path", ["kernel", "eager"])
@pytest.mark.parametrize("vocab", [37, 4099])  # one partial vocab step; a full one and a ragged one
def test_fp32_both_paths_match_fp64(path, vocab, monkeypatch):
    """The Triton softmax-gradient kernel (interpreter on CPU) and the eager fallback agree with fp64."""
    import cs336_systems.kernels.cross_entropy as ce
    from tests._support import kernel_device

    device = kernel_device() if path == "kernel" else "cpu"
    monkeypatch.setattr(ce, "_uses_kernel", lambda hidden: path == "kernel")
    torch.manual_seed(1)
    h = torch.randn(2, 9, 16, device=device, requires_grad=True)
    w = torch.randn(vocab, 16, device=device, requires_grad=True)
    t = torch.randint(0, vocab, (2, 9), device=device)
    t[1, 3] = -100
    loss = lm_head_cross_entropy(h, w, t, chunk_tokens=5)
    ref = lm_head_cross_entropy_reference(h.double(), w.double(), t)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(loss, (h, w))
    exact = torch.autograd.grad(ref, (h, w))  # through the casts: fp64 maths, fp32 results
    for ours, want in zip(grads, exact):
        torch.testing.assert_close(ours.double(), want.double(), rtol=1e-4, atol=1e-6)
    assert grads[0][1, 3].abs().max() == 0


def test_bad_input():
    h, w, t = torch.randn(4, 8), torch.randn(10, 8), torch.randint(0, 10, (4,))
    with pytest.raises(ValueError, match="reduction"):
        lm_head_cross_entropy(h, w, t, reduction="none")
    with pytest.raises(ValueError, match="weight must be"):
        lm_head_cross_entropy(h, torch.randn(10, 7), t)
    with pytest.raises(ValueError, match="targets must have shape"):
        lm_head_cross_entropy(h, w, t[:3])
    with pytest.raises(TypeError, match="integer"):
        lm_head_cross_entropy(h, w, t.float())


def test_backward_makes_no_fp32_copy_of_the_head_gradient(monkeypatch):
    """The backward scales the fp32 dW it saved straight into the weight's dtype: no fp32 temporary the size of the
    head (1.16 GiB for the 8B model's head in bf16 would otherwise be 2.3 GiB more at the peak)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import cs336_systems.kernels.cross_entropy as ce

    monkeypatch.setattr(ce, "interpreting", lambda: False)  # the eager maths: bf16 on the CPU
    hidden = torch.randn(2, 6, 16, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(37, 16, dtype=torch.bfloat16, requires_grad=True)
    loss = lm_head_cross_entropy(hidden, weight, torch.randint(0, 37, (2, 6)), chunk_tokens=5)

    class Outputs(TorchDispatchMode):
        made: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.made.append((t.dtype, tuple(t.shape)))
            return out

    with Outputs():
        loss.backward(torch.tensor(0.5))
    assert (torch.float32, tuple(weight.shape)) not in Outputs.made, Outputs.made
    assert (torch.bfloat16, tuple(weight.shape)) in Outputs.made
    assert weight.grad.dtype == torch.bfloat16


def _chunked_in_weight_dtype_reference(h, w, t, chunk):
    """PyTorch's own error for dW accumulated chunk by chunk in the weight's dtype: the same order of roundings
    (fp32 softmax gradient rounded to the input dtype, one addmm into a 16-bit dW per chunk)."""
    grad_w = torch.zeros_like(w)
    for start in range(0, h.shape[0], chunk):
        hc, tc = h[start:start + chunk], t[start:start + chunk]
        probs = torch.softmax((hc @ w.T).float(), dim=-1)
        probs[torch.arange(hc.shape[0]), tc] -= 1
        grad_w.addmm_((probs / h.shape[0]).to(w.dtype).T, hc)
    return grad_w


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_weight_dtype_accumulation_within_budget(dtype):
    """weight_grad_accumulation="weight": exact where the weight's dtype is fp32/fp64; in bf16 within 2x of
    PyTorch's error for the same chunked accumulation (one rounding per chunk, as Liger-Kernel)."""
    from tests._support import assert_within_budget, kernel_device

    device = kernel_device()
    torch.manual_seed(3)
    h = torch.randn(96, 32, device=device).to(dtype).requires_grad_()
    w = (torch.randn(300, 32, device=device) * 0.2).to(dtype).requires_grad_()
    t = torch.randint(0, 300, (96,), device=device)
    loss = lm_head_cross_entropy(h, w, t, chunk_tokens=16, weight_grad_accumulation="weight")
    dh, dw = torch.autograd.grad(loss, (h, w))
    assert dw.dtype == dtype and dh.dtype == dtype
    ref = lm_head_cross_entropy_reference(h.detach().double().requires_grad_(), w.detach().double(), t)
    w64 = w.detach().double().requires_grad_()
    exact_dw = torch.autograd.grad(lm_head_cross_entropy_reference(h.detach().double(), w64, t), w64)[0]
    assert torch.isclose(loss.double(), ref, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6)
    if dtype == torch.bfloat16:
        low = _chunked_in_weight_dtype_reference(h.detach().cpu(), w.detach().cpu(), t.cpu(), 16)
        assert_within_budget("dw", dw.cpu(), exact_dw.cpu(), low)
    else:
        torch.testing.assert_close(dw.double(), exact_dw, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("accumulation", ["fp32", "weight"])
def test_backward_hands_over_its_gradients_without_copies(accumulation, monkeypatch):
    """The backward scales dH (and a dW already in the weight's dtype) in place: no tensor the size of the hidden
    states or of the head is made; a second backward through the same loss is refused."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import cs336_systems.kernels.cross_entropy as ce

    monkeypatch.setattr(ce, "interpreting", lambda: False)  # the eager maths on the CPU
    hidden = torch.randn(2, 6, 16, requires_grad=True)
    weight = torch.randn(37, 16, requires_grad=True)
    loss = lm_head_cross_entropy(hidden, weight, torch.randint(0, 37, (2, 6)), chunk_tokens=5,
                                 weight_grad_accumulation=accumulation)

    class Outputs(TorchDispatchMode):
        made: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not (func.is_view or func._schema.is_mutable):  # views and in-place ops make no new storage
                for t in out if isinstance(out, (tuple, list)) else [out]:
                    if isinstance(t, torch.Tensor):
                        self.made.append((func.__name__, tuple(t.shape)))
            return out

    with Outputs():
        loss.backward(torch.tensor(0.5))  # the gradients reach .grad as they are (AccumulateGrad steals them)
    shapes = [shape for _, shape in Outputs.made]
    assert (12, 16) not in shapes and (2, 6, 16) not in shapes, Outputs.made
    assert (37, 16) not in shapes, Outputs.made  # dW is in the weight's dtype (fp32 here) either way
    again = lm_head_cross_entropy(hidden, weight, torch.randint(0, 37, (2, 6)), chunk_tokens=5,
                                  weight_grad_accumulation=accumulation)
    again.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        again.backward()


def test_weight_grad_accumulation_is_checked():
    h, w, t = torch.randn(4, 8), torch.randn(10, 8), torch.randint(0, 10, (4,))
    with pytest.raises(ValueError, match="weight_grad_accumulation must be one of fp32, weight, got 'bf16'"):
        lm_head_cross_entropy(h, w, t, weight_grad_accumulation="bf16")


@pytest.mark.parametrize("path", ["kernel", "eager"])
def test_one_chunk_of_logits_is_alive_at_a_time(path, monkeypatch):
    """When a chunk's logits are made, no earlier chunk's vocab-wide tensor is still alive (the loss's peak holds
    one chunk, not two): every (chunk, vocab) tensor an op makes is watched through a weak reference."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode

    import cs336_systems.kernels.cross_entropy as ce
    from tests._support import kernel_device

    vocab, chunk = 4099, 4
    device = kernel_device() if path == "kernel" else "cpu"
    monkeypatch.setattr(ce, "_uses_kernel", lambda hidden: path == "kernel")

    class VocabWideTensors(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.alive, self.most = [], 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.dim() == 2 and out.shape == (chunk, vocab) and out._base is None:
                self.alive = [ref for ref in self.alive if ref() is not None]
                self.alive.append(weakref.ref(out))
                self.most = max(self.most, len({ref().untyped_storage().data_ptr() for ref in self.alive
                                                if ref() is not None}))
            return out

    h = torch.randn(4 * chunk, 16, device=device, requires_grad=True)
    w = torch.randn(vocab, 16, device=device, requires_grad=True)
    t = torch.randint(0, vocab, (4 * chunk,), device=device)
    watch = VocabWideTensors()
    with watch:
        lm_head_cross_entropy(h, w, t, chunk_tokens=chunk).backward()
    # fp32 inputs: both paths turn the logits into their gradient in place
    assert watch.most == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 0.37, -2.5])
def test_scale_in_place_skips_a_scale_of_one(dtype, scale):
    """The backward's in-place scaling (Triton on CUDA or the interpreter): t * scale in fp32, rounded once to t's
    dtype, over a ragged last block; a scale of 1 leaves every element as it was. (The interpreter's cast to bf16
    may round the other way: one bf16 step allowed there, none on CUDA.)"""
    import cs336_systems.kernels.cross_entropy as ce
    from tests._support import kernel_device

    device = kernel_device()
    t = torch.randn(3, ce.SCALE_BLOCK // 2 + 5, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    before = t.clone()
    grad_loss = torch.tensor(scale, device=device)
    assert ce._scale_(t, grad_loss) is t
    step = 2 ** -7 if dtype == torch.bfloat16 and device == "cpu" and scale != 1.0 else 0
    torch.testing.assert_close(t, (before.float() * scale).to(dtype), rtol=step, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_first_chunk_product_ignores_the_accumulator(dtype):
    """The first chunk writes dW = a @ b over an uninitialised accumulator (NaN here): nothing of it is read; later
    chunks add to it."""
    from cs336_systems.kernels.cross_entropy import _accumulate_product_

    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(6, 5, generator=g).to(dtype), torch.randn(5, 4, generator=g).to(dtype)
    for acc_dtype in {dtype, torch.float32}:
        acc = torch.full((6, 4), float("nan"), dtype=acc_dtype)
        _accumulate_product_(acc, a, b, first=True)
        exact = a.double() @ b.double()
        torch.testing.assert_close(acc.double(), exact, rtol=1e-2, atol=1e-2)
        _accumulate_product_(acc, a, b)
        torch.testing.assert_close(acc.double(), 2 * exact, rtol=2e-2, atol=2e-2)
