"""Fused RMSNorm and SwiGLU gate against fp64 references, with budgets from PyTorch's own low-precision
error (CUDA, or CPU under the interpreter); and the model with them installed."""

import types

import pytest
import torch
import torch.utils._python_dispatch

from cs336_basics.model import RMSNorm
from cs336_systems.attention import use_attention
from cs336_systems.config import ModelConfig
from cs336_systems.fused_model import apply_fused_kernels
from cs336_systems.kernels.rmsnorm import rmsnorm, rmsnorm_reference
from cs336_systems.kernels.swiglu import silu_mul, silu_mul_packed, silu_mul_reference
from tests._support import assert_within_budget, kernel_device

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _grads(fn, *inputs, grad_out):
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(grad_out.to(out.dtype))
    return out, [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 17, 64), (1, 1, 100), (5, 256), (2, 3, 4, 48)])
def test_rmsnorm_matches_reference(shape, dtype):
    device = kernel_device()
    torch.manual_seed(0)
    x = torch.randn(shape, device=device) * 3 + 0.5
    w = torch.rand(shape[-1], device=device) + 0.5
    dy = torch.randn(shape, device=device)
    ref, ref_grads = _grads(lambda a, b: rmsnorm_reference(a, b), x.double(), w.double(), grad_out=dy.double())
    ours, our_grads = _grads(lambda a, b: rmsnorm(a, b), x.to(dtype), w.to(dtype), grad_out=dy)
    low, low_grads = _grads(lambda a, b: RMSNorm.forward(_norm_with(b), a), x.to(dtype), w.to(dtype), grad_out=dy)
    assert ours.dtype == dtype and ours.shape == x.shape
    assert_within_budget("y", ours, ref, low)
    for name, g, r, lo in zip(("dx", "dw"), our_grads, ref_grads, low_grads):
        assert g.dtype == dtype
        assert_within_budget(name, g, r, lo)


@pytest.mark.parametrize("programs", [1, 3, 7, 256])
def test_rmsnorm_backward_takes_every_row_once_over_programs(programs, monkeypatch):
    """The backward's programs each take a strided set of rows and a partial dW: 51 rows over 1, 3, 7 or 256
    programs (51, 17, 8 or 7, and 1 or no rows each) give dx and dw as the fp64 reference does."""
    import cs336_systems.kernels.rmsnorm as rmsnorm_module

    monkeypatch.setattr(rmsnorm_module, "DW_PROGRAMS", programs)
    device = kernel_device()
    torch.manual_seed(3)
    x = torch.randn(3, 17, 100, device=device) * 2
    w = torch.rand(100, device=device) + 0.5
    dy = torch.randn(3, 17, 100, device=device)
    ref, (ref_dx, ref_dw) = _grads(lambda a, b: rmsnorm_reference(a, b), x.double(), w.double(), grad_out=dy.double())
    ours, (dx, dw) = _grads(lambda a, b: rmsnorm(a, b), x, w, grad_out=dy)
    torch.testing.assert_close(dx.double(), ref_dx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw.double(), ref_dw, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
def test_rmsnorm_out_dtype_rounds_the_fp32_result_once(out_dtype):
    """out_dtype: the result is the fp32 norm rounded once to that dtype (what a cast after an fp32 RMSNorm gives),
    and the gradient arrives in that dtype and comes back in x's (fp32), as through that cast. (On the CPU the
    interpreter's bf16 stores may round the other way: one bf16 step there.)"""
    device = kernel_device()
    torch.manual_seed(2)
    x = torch.randn(3, 5, 72, device=device) * 2
    w = torch.rand(72, device=device) + 0.5
    dy = torch.randn(3, 5, 72, device=device).to(out_dtype)
    ours, (dx, dw) = _grads(lambda a, b: rmsnorm(a, b, out_dtype=out_dtype), x, w, grad_out=dy)
    cast, (dx_cast, dw_cast) = _grads(lambda a, b: rmsnorm(a, b).to(out_dtype), x, w, grad_out=dy)
    assert ours.dtype == out_dtype and dx.dtype == torch.float32 and dw.dtype == torch.float32
    step = 2 ** -7 if out_dtype == torch.bfloat16 and device == "cpu" else 0
    torch.testing.assert_close(ours, cast, rtol=step, atol=0)
    torch.testing.assert_close(dx, dx_cast, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dw, dw_cast, rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="out_dtype must be None, float32, bfloat16 or float16, got torch.int32"):
        rmsnorm(x, w, out_dtype=torch.int32)


ADD_DTYPES = [(torch.float32, torch.bfloat16), (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
              (torch.float16, torch.float16)]


@pytest.mark.parametrize("x_dtype, delta_dtype", ADD_DTYPES, ids=["fp32+bf16", "fp32", "bf16", "fp16"])
@pytest.mark.parametrize("shape", [(3, 17, 64), (1, 1, 100), (2, 3, 4, 48), (5, 1000)])
def test_add_rmsnorm_matches_the_add_then_the_norm(shape, x_dtype, delta_dtype):
    """(h, y) = (x + delta, rmsnorm(x + delta)) with both outputs' gradients arriving (the residual path's and the
    norm's): h in torch's promoted dtype, each addend's gradient in its own, and every output and gradient within
    budget of the fp64 reference against PyTorch's add and RMSNorm at the same precision."""
    from cs336_systems.kernels.rmsnorm import add_rmsnorm

    device = kernel_device()
    torch.manual_seed(1)
    x = torch.randn(shape, device=device) * 3 + 0.5
    delta = torch.randn(shape, device=device)
    w = torch.rand(shape[-1], device=device) + 0.5
    grad_h, grad_y = torch.randn(shape, device=device), torch.randn(shape, device=device)

    def run(fn, x, delta, w):
        leaves = [t.detach().requires_grad_() for t in (x, delta, w)]
        h, y = fn(*leaves)
        ((h * grad_h.to(h.dtype)).sum() + (y * grad_y.to(y.dtype)).sum()).backward()
        return (h, y), [t.grad for t in leaves]

    w_dtype = torch.float32 if x_dtype != delta_dtype else x_dtype
    low_inputs = (x.to(x_dtype), delta.to(delta_dtype), w.to(w_dtype))
    ref_out, ref_grads = run(lambda a, b, c: _then(a + b, lambda h: rmsnorm_reference(h, c)), x.double(),
                             delta.double(), w.double())
    low_out, low_grads = run(lambda a, b, c: _then(a + b, lambda h: RMSNorm.forward(_norm_with(c), h)), *low_inputs)
    ours_out, our_grads = run(lambda a, b, c: add_rmsnorm(a, b, c), *low_inputs)
    h_dtype = torch.promote_types(x_dtype, delta_dtype)
    assert [t.dtype for t in ours_out] == [h_dtype, h_dtype] and ours_out[0].shape == x.shape
    assert [g.dtype for g in our_grads] == [x_dtype, delta_dtype, w_dtype]
    for name, ours, ref, low in zip(("h", "y", "dx", "ddelta", "dw"), [*ours_out, *our_grads], [*ref_out, *ref_grads],
                                    [*low_out, *low_grads]):
        assert_within_budget(name, ours, ref, low)


@pytest.mark.parametrize("programs", [1, 7, 256])
def test_add_rmsnorm_stores_autocasts_dtype_as_the_unfused_norm_does(programs, monkeypatch):
    """The model's case: an fp32 residual stream, autocast's bf16 delta (the attention's output), the norm stored in
    bf16. The same values as the add and then `rmsnorm(..., out_dtype)`, and the same gradients (h's gradient joined
    with the norm's in fp32, then rounded once for delta), over any number of backward programs."""
    import cs336_systems.kernels.rmsnorm as rmsnorm_module

    monkeypatch.setattr(rmsnorm_module, "DW_PROGRAMS", programs)
    device = kernel_device()
    torch.manual_seed(4)
    x = torch.randn(3, 17, 72, device=device) * 2
    delta = torch.randn(3, 17, 72, device=device).to(torch.bfloat16)
    w = torch.rand(72, device=device) + 0.5
    grad_h, grad_y = torch.randn(3, 17, 72, device=device), torch.randn(3, 17, 72, device=device).to(torch.bfloat16)

    def run(fn):
        leaves = [t.detach().requires_grad_() for t in (x, delta, w)]
        h, y = fn(*leaves)
        torch.autograd.backward((h, y), (grad_h, grad_y))
        return h, y, [t.grad for t in leaves]

    fused = run(lambda a, b, c: rmsnorm_module.add_rmsnorm(a, b, c, out_dtype=torch.bfloat16))
    unfused = run(lambda a, b, c: _then(a + b, lambda h: rmsnorm(h, c, out_dtype=torch.bfloat16)))
    assert fused[1].dtype == torch.bfloat16 and fused[2][1].dtype == torch.bfloat16
    torch.testing.assert_close(fused[0], unfused[0], rtol=0, atol=0)  # the fp32 sum, exactly
    step = 2 ** -7 if device == "cpu" else 0  # (the interpreter's bf16 stores may round the other way)
    torch.testing.assert_close(fused[1], unfused[1], rtol=step, atol=0)
    for name, a, b in zip(("dx", "ddelta", "dw"), fused[2], unfused[2]):
        torch.testing.assert_close(a.float(), b.float(), rtol=max(step, 1e-5), atol=1e-5, msg=name)


def _then(h, norm):
    """(h, norm(h)): one sum, both its uses (the residual path's gradient and the norm's join on it, as in a block)."""
    return h, norm(h)


def test_add_rmsnorm_bad_inputs():
    from cs336_systems.kernels.rmsnorm import add_rmsnorm

    x, w = torch.randn(2, 8), torch.randn(8)
    with pytest.raises(ValueError, match=r"add_rmsnorm: delta must have x's shape \(2, 8\), got \(2, 4\)"):
        add_rmsnorm(x, torch.randn(2, 4), w)
    with pytest.raises(TypeError, match="add_rmsnorm: delta must be float32, bfloat16 or float16, got torch.int64"):
        add_rmsnorm(x, torch.ones(2, 8, dtype=torch.long), w)
    with pytest.raises(ValueError, match=r"add_rmsnorm: weight must have shape \(8,\), got \(4,\)"):
        add_rmsnorm(x, x, torch.randn(4))
    with pytest.raises(ValueError, match="add_rmsnorm: eps must be positive, got 0"):
        add_rmsnorm(x, x, w, eps=0)


@pytest.mark.parametrize("autocast", [False, True])
def test_fused_blocks_add_the_residual_in_their_norm_and_compute_the_same_function(autocast, monkeypatch):
    """With `residual_norm` (the default) each block's mid-block add runs inside its second norm (`add_rmsnorm`,
    once per block), and the model computes what it computes with the add and the norm apart (residual_norm=False;
    under autocast each output and gradient within budget of the fp32 model against the unfused one's bf16 error); a
    hook on the second norm makes the block call it as a module, so the hook sees it."""
    import cs336_systems.fused_model as fused_model

    device = kernel_device()
    cfg = ModelConfig.from_name("tiny", num_layers=2, context_length=16)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), device=device)
    calls = []
    real = fused_model.add_rmsnorm
    monkeypatch.setattr(fused_model, "add_rmsnorm", lambda *args, **options: calls.append(1) or real(*args, **options))

    def run(residual_norm, hook=False, autocast=autocast):
        torch.manual_seed(0)
        model = apply_fused_kernels(cfg.build(device=device), residual_norm=residual_norm)
        if hook:
            model.layers[0].ln2.register_forward_hook(lambda *_: calls.append("hook"))
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            out = model(tokens)
        out.float().square().mean().backward()
        return [out, *(p.grad for p in model.parameters())]

    unfused = run(False)
    assert not calls
    fused = run(True)
    assert calls == [1] * cfg.num_layers
    if autocast:  # each against the fp32 model, within twice the unfused model's bf16 error
        reference = run(False, autocast=False)
        for ours, ref, low in zip(fused, reference, unfused):
            assert_within_budget("output or gradient", ours.float(), ref, low.float())
    else:
        for a, b in zip(fused, unfused):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    calls.clear()
    run(True, hook=True)
    assert calls == ["hook", 1]  # the hooked block called its norm; the other fused it


def test_fused_block_norms_store_the_autocast_dtype():
    """Under autocast a block's two norms return autocast's dtype (their products cast to it anyway) and the final
    norm its input's; without autocast every norm returns its input's dtype."""
    model, tokens = _fused_pair(True)
    dtypes = {}
    for name in ("layers.0.ln1", "layers.0.ln2", "ln_final"):
        model.get_submodule(name).register_forward_hook(
            lambda module, args, out, name=name: dtypes.__setitem__(name, out.dtype))
    for autocast, block_dtype in ((True, torch.bfloat16), (False, torch.float32)):
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=autocast):
            model(tokens)
        assert dtypes == {"layers.0.ln1": block_dtype, "layers.0.ln2": block_dtype, "ln_final": torch.float32}


def _norm_with(weight):
    """Stands in for `self` of cs336_basics' RMSNorm (the eager module being replaced), holding the leaf `weight`."""
    return types.SimpleNamespace(weight=weight, eps=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 33), (1, 2049), (2, 3, 1000)])
def test_silu_mul_matches_reference(shape, dtype):
    device = kernel_device()
    torch.manual_seed(1)
    a, b, dy = (torch.randn(shape, device=device) * 2 for _ in range(3))
    ref, ref_grads = _grads(silu_mul_reference, a.double(), b.double(), grad_out=dy.double())
    ours, our_grads = _grads(silu_mul, a.to(dtype), b.to(dtype), grad_out=dy)
    low, low_grads = _grads(silu_mul_reference, a.to(dtype), b.to(dtype), grad_out=dy)
    assert_within_budget("y", ours, ref, low)
    for name, g, r, lo in zip(("da", "db"), our_grads, ref_grads, low_grads):
        assert_within_budget(name, g, r, lo)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_backward_in_place_writes_the_same_gradients_over_its_inputs(dtype):
    device = kernel_device()
    torch.manual_seed(2)
    a0, b0, dy = (torch.randn(5, 333, device=device, dtype=dtype) for _ in range(3))

    def run(in_place):
        a_leaf, b_leaf = (t.clone().requires_grad_() for t in (a0, b0))
        a, b = a_leaf * 1, b_leaf * 1  # non-leaf products, as w1 x and w3 x are
        silu_mul(a, b, backward_in_place=in_place).backward(dy)
        return a, b, a_leaf.grad, b_leaf.grad

    a, b, da, db = run(True)
    _, _, want_da, want_db = run(False)
    assert torch.equal(da, want_da) and torch.equal(db, want_db)
    assert torch.equal(a, da) and torch.equal(b, db)  # the gradients were written over the saved inputs


def test_silu_mul_backward_in_place_refuses_leaves_and_is_loud_about_other_readers():
    device = kernel_device()
    a, b = (torch.randn(4, 8, device=device, requires_grad=True) for _ in range(2))
    with pytest.raises(ValueError, match="backward_in_place=True .* leaf"):
        silu_mul(a, b, backward_in_place=True)
    with torch.no_grad():  # no backward, nothing overwritten: leaves are fine
        silu_mul(a, b, backward_in_place=True)
    x = a * 1
    other = torch.sin(x)  # saves x for its own backward, which runs after the gate's
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (silu_mul(x, b * 1, backward_in_place=True).sum() + other.sum()).backward()


def _packed_reference(gate_up):
    d_ff = gate_up.shape[-1] // 2
    return silu_mul_reference(gate_up[..., :d_ff], gate_up[..., d_ff:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 66), (1, 4098), (2, 3, 2000), (3, 2)])
def test_silu_mul_packed_matches_reference(shape, dtype):
    """The gate over one (..., 2 d_ff) product (a | b): output and its one gradient (da | db) within budget, d_ff odd
    and over one block of columns too."""
    device = kernel_device()
    torch.manual_seed(4)
    gate_up = torch.randn(shape, device=device) * 2
    dy = torch.randn(*shape[:-1], shape[-1] // 2, device=device)
    ref, (ref_grad,) = _grads(_packed_reference, gate_up.double(), grad_out=dy.double())
    ours, (our_grad,) = _grads(silu_mul_packed, gate_up.to(dtype), grad_out=dy)
    low, (low_grad,) = _grads(_packed_reference, gate_up.to(dtype), grad_out=dy)
    assert ours.shape == dy.shape and ours.dtype == dtype and our_grad.shape == gate_up.shape
    assert_within_budget("y", ours, ref, low)
    assert_within_budget("d(gate_up)", our_grad, ref_grad, low_grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_packed_equals_the_gate_on_its_halves_and_writes_in_place(dtype):
    """Bit for bit what `silu_mul` gives on the two halves (the same arithmetic per element); with
    `backward_in_place` the gradient is written over the product; leaves are refused, odd widths too."""
    device = kernel_device()
    torch.manual_seed(5)
    gate_up0, dy = torch.randn(4, 9, 2 * 333, device=device, dtype=dtype), torch.randn(4, 9, 333, device=device)

    def run(packed, in_place):
        leaf = gate_up0.clone().requires_grad_()
        gate_up = leaf * 1  # a non-leaf product, as the merged w1/w3 product is
        y = (silu_mul_packed(gate_up, backward_in_place=in_place) if packed
             else silu_mul(gate_up[..., :333], gate_up[..., 333:]))
        y.backward(dy.to(dtype))
        return y, gate_up, leaf.grad

    y, gate_up, grad = run(True, True)
    want_y, _, want_grad = run(False, False)
    assert torch.equal(y, want_y) and torch.equal(grad, want_grad)
    assert torch.equal(gate_up, grad)
    with pytest.raises(ValueError, match="backward_in_place=True .* leaf"):
        silu_mul_packed(gate_up0.clone().requires_grad_(), backward_in_place=True)
    with pytest.raises(ValueError, match="last dim must be even"):
        silu_mul_packed(torch.ones(2, 5, device=device))


def test_bad_inputs():
    with pytest.raises(ValueError, match="weight must have shape"):
        rmsnorm(torch.ones(2, 8), torch.ones(4))
    with pytest.raises(ValueError, match="same shape"):
        silu_mul(torch.ones(2, 3), torch.ones(3, 2))
    with pytest.raises(TypeError, match="one floating dtype"):
        silu_mul(torch.ones(2), torch.ones(2, dtype=torch.float64))


def _plain_and_fused(num_layers: int, rope: bool):
    """(plain model, the same weights with our fused kernels, tokens) of the tiny preset at context 24."""
    device = kernel_device()
    cfg = ModelConfig.from_name("tiny", num_layers=num_layers, context_length=24)
    torch.manual_seed(0)
    plain = cfg.build(device=device)
    torch.manual_seed(0)
    fused = apply_fused_kernels(cfg.build(device=device), rope=rope)
    return plain, fused, torch.randint(0, cfg.vocab_size, (2, 24), device=device)


@pytest.mark.parametrize("rope", [False, True])
def test_fused_model_computes_the_same_function(rope):
    plain, fused, tokens = _plain_and_fused(2, rope)
    out_plain, out_fused = plain(tokens), fused(tokens)
    torch.testing.assert_close(out_fused, out_plain, rtol=1e-5, atol=1e-5)
    out_plain.square().mean().backward()
    out_fused.square().mean().backward()
    for (name, p), q in zip(plain.named_parameters(), fused.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert set(fused.state_dict()) == set(plain.state_dict())


@pytest.mark.parametrize("rope, merge", [(True, True), (True, False), (False, True), (False, False)])
def test_fused_forms_are_subclasses_with_no_method_of_their_own_instance(rope, merge):
    """Each module becomes an instance of a fused subclass of its class (torch.compile guards its forward by its type)
    with no forward, project_qkv or rotate_qk bound on the instance (each would be guarded on every compiled call);
    the model pickles, and applying it again changes nothing."""
    import pickle

    from cs336_basics.model import CausalMultiHeadSelfAttention, Linear, RotaryEmbedding, SwiGLU
    from cs336_systems import fused_model

    cfg = ModelConfig.from_name("tiny", num_layers=2, context_length=24)
    model = apply_fused_kernels(cfg.build(device="cpu"), rope=rope, merge_projections=merge)
    assert not any(name in vars(m) for m in model.modules() for name in ("forward", "project_qkv", "rotate_qk"))
    kinds = {RMSNorm: (fused_model.FusedRMSNorm, fused_model.FusedBlockRMSNorm),
             SwiGLU: (fused_model.MergedSwiGLU if merge else fused_model.FusedSwiGLU,),
             Linear: (fused_model.FusedLinear,)}
    for module in model.modules():
        for base, fused in kinds.items():
            if isinstance(module, base):
                assert type(module) in fused, type(module)
        if isinstance(module, RotaryEmbedding):
            assert (type(module) is fused_model.FusedRotaryEmbedding) == rope
        if isinstance(module, CausalMultiHeadSelfAttention):
            assert isinstance(module, fused_model.MergedQKVAttention) == merge
            assert isinstance(module, fused_model.FusedRoPEAttention) == rope
    tokens = torch.randint(0, cfg.vocab_size, (2, 24))
    again = pickle.loads(pickle.dumps(model))
    torch.testing.assert_close(again(tokens), model(tokens), rtol=0, atol=0)
    classes = [type(m) for m in model.modules()]
    assert [type(m) for m in apply_fused_kernels(model, rope=rope, merge_projections=merge).modules()] == classes


class _ProductCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the matrix products (aten mm / addmm / bmm) dispatched inside it."""

    def __enter__(self):
        self.products = 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.products += 1
        return func(*args, **(kwargs or {}))


def _fused_pair(merge: bool, num_layers: int = 2):
    device = kernel_device()
    cfg = ModelConfig.from_name("tiny", num_layers=num_layers, context_length=24)
    torch.manual_seed(0)
    model = apply_fused_kernels(cfg.build(device=device), merge_projections=merge)
    return model, torch.randint(0, cfg.vocab_size, (2, 24), device=device)


@pytest.mark.parametrize("autocast", [False, True])
def test_merged_projections_are_one_product_per_group_and_compute_the_same_function(autocast):
    """`merge_projections` (the default): each block's Q, K, V projections are one product in the forward and one
    each for the input's and the weights' gradients in the backward (2 + 4 products fewer per block), and so are its
    SwiGLU's w1 and w3 (1 + 2 fewer); the merged weights are row blocks of one storage and stay their own Parameters
    (names and state dict unchanged), and the model computes what the unmerged one does, in fp32 and under bf16
    autocast (its casts now once per group, not per projection)."""
    results = {}
    for merge in (False, True):
        model, tokens = _fused_pair(merge)
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=autocast), _ProductCounter() as count:
            out = model(tokens)
            forward_products = count.products
            out.float().square().mean().backward()
        results[merge] = (out.float(), {n: p.grad for n, p in model.named_parameters()}, forward_products,
                          count.products - forward_products, model)
    (out_plain, grads_plain, fwd_plain, bwd_plain, _), (out, grads, fwd, bwd, model) = results[False], results[True]
    layers = len(model.layers)
    assert (fwd_plain - fwd, bwd_plain - bwd) == ((2 + 1) * layers, (4 + 2) * layers)
    tolerance = dict(rtol=2e-2, atol=2e-3) if autocast else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out, out_plain, **tolerance)
    assert grads.keys() == grads_plain.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, grads_plain[name], **tolerance, msg=name)
    attn, ffn = model.layers[0].attn, model.layers[0].ffn
    for group in ((attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight), (ffn.w1.weight, ffn.w3.weight)):
        assert all(isinstance(w, torch.nn.Parameter) for w in group)
        assert len({w.untyped_storage().data_ptr() for w in group}) == 1
        for first, second in zip(group, group[1:]):
            assert second.data_ptr() == first.data_ptr() + first.numel() * first.element_size()


def test_merged_projections_save_less_under_autocast_and_no_more_without():
    """A merged product saves no more than the separate projections: V is a copy of its own, so the attention's
    saved V keeps no Q and K columns alive, and the gate saves the w1/w3 product (the two halves it saved before).
    Under autocast the block norms store bf16 themselves, so neither form casts (and saves) its input again: the
    same bytes either way (before that, each projection saved a cast of its own, the merged product one)."""
    from cs336_systems.memory.saved_tensors import SavedTensorLog

    saved = {}
    for merge in (False, True):
        for autocast in (False, True):
            model, tokens = _fused_pair(merge)
            with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=autocast), \
                    SavedTensorLog(model) as log:
                model(tokens)
            saved[merge, autocast] = log.total_bytes
    assert saved[True, False] == saved[False, False]
    assert saved[True, True] == saved[False, True]


def test_merged_projections_fall_back_to_a_copy_where_the_weights_moved_apart():
    """Where a weight got storage of its own after `apply_fused_kernels` (as `.to()` gives every parameter) the merged
    product concatenates the weights instead: the same results."""
    from cs336_systems.fused_model import _consecutive_rows

    merged, tokens = _fused_pair(True)
    plain, _ = _fused_pair(False)
    attn, ffn = merged.layers[0].attn, merged.layers[0].ffn
    attn.k_proj.weight.data = attn.k_proj.weight.detach().clone()
    ffn.w3.weight.data = ffn.w3.weight.detach().clone()
    assert _consecutive_rows((attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)) is None
    assert _consecutive_rows((ffn.w1.weight, ffn.w3.weight)) is None
    torch.testing.assert_close(merged(tokens), plain(tokens))
    merged(tokens).square().mean().backward()
    plain(tokens).square().mean().backward()
    for (name, p), q in zip(plain.named_parameters(), merged.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


def test_fused_model_checks_its_positions_once_and_makes_no_arange_per_layer(monkeypatch):
    """With the fused RoPE every layer takes its positions from one cached arange: RoPE's on-device range check
    runs once over two steps of a 3-layer model (the model made a new arange, and so a new check, in each layer),
    and the forward makes no arange; a new length gets its own. Outputs are those of the unfused model."""
    import cs336_systems.kernels.rope as rope_module
    from cs336_systems.fused_model import _cached_positions

    plain, fused, tokens = _plain_and_fused(3, rope=True)
    _cached_positions.cache_clear()
    monkeypatch.setattr(rope_module, "_last_checked", None)
    checks, aranges = [], []
    real_assert, real_arange = torch._assert_async, torch.arange
    monkeypatch.setattr(torch, "_assert_async", lambda *a: checks.append(1) or real_assert(*a))
    with use_attention("triton"):  # (an attention that builds no mask: the model path the suites run)
        fused(tokens)  # (the first call makes the cached positions)
        monkeypatch.setattr(torch, "arange", lambda *a, **k: aranges.append(a) or real_arange(*a, **k))
        for _ in range(2):
            fused(tokens).square().mean().backward()
        assert len(checks) == 1 and aranges == []
        fused(tokens[:, :10])
        assert len(checks) == 2 and aranges == [(10,)]
        monkeypatch.setattr(torch, "arange", real_arange)
        torch.testing.assert_close(fused(tokens), plain(tokens), rtol=1e-5, atol=1e-5)


def test_fused_model_copies_no_weight_gradient():
    """With the fused path the weights' gradients come out of the products in their own layout, so
    AccumulateGrad does not copy them (the plain model's einsum gradients are transposed: one copy each)."""
    from tests._support import CopyCounter

    device = kernel_device()
    cfg = ModelConfig.from_name("tiny", num_layers=2, context_length=24)
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), device=device)
    copies = {}
    for name, model in (("plain", cfg.build(device=device)), ("fused", apply_fused_kernels(cfg.build(device=device)))):
        weights = {tuple(p.shape) for n, p in model.named_parameters() if "layers" in n and p.dim() == 2}
        with CopyCounter() as counter:  # grads are None, as after zero_grad(set_to_none=True) in a step
            model(tokens).square().mean().backward()
        copies[name] = counter.of_shape(*weights)
    assert copies["fused"] == []
    assert len(copies["plain"]) >= 7 * cfg.num_layers  # the einsum's layout: the copies this removes


def test_fused_model_saves_less():
    from cs336_systems.memory.saved_tensors import SavedTensorLog

    device = kernel_device()
    cfg = ModelConfig.from_name("tiny", num_layers=1, context_length=16)
    model = cfg.build(device=device)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), device=device)
    with SavedTensorLog(model) as plain_log:
        model(tokens)
    fused = apply_fused_kernels(model)  # (moves the merged weights into one buffer each: before the log reads them)
    with SavedTensorLog(fused) as fused_log:
        fused(tokens)
    assert fused_log.total_bytes < plain_log.total_bytes


@pytest.mark.parametrize("policy", ["ffn", "partial:1", "every-block"])
def test_checkpointing_keeps_the_fused_kernels(policy, monkeypatch):
    import cs336_systems.fused_model as fused_model
    from cs336_systems.memory.checkpointing import apply_checkpointing

    device = kernel_device()
    cfg = ModelConfig.from_name("tiny", num_layers=2, context_length=16)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), device=device)

    def grads(policy_name):
        torch.manual_seed(0)
        model = apply_checkpointing(apply_fused_kernels(cfg.build(device=device)), policy_name)
        model(tokens).square().mean().backward()
        return [p.grad for p in model.parameters()]

    plain = grads("none")
    calls = []
    real = fused_model.silu_mul_packed  # (the gate over the merged w1/w3 product: the default)
    monkeypatch.setattr(fused_model, "silu_mul_packed", lambda x, **options: calls.append(1) or real(x, **options))
    checkpointed = grads(policy)
    for a, b in zip(plain, checkpointed):
        assert torch.equal(a, b)
    assert len(calls) > cfg.num_layers  # forward and the recomputation both ran our fused gate


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,positions", [((2, 3, 17, 16), "arange"), ((1, 5, 8), "offset"),
                                             ((4, 33, 64), "random"), ((2, 3, 9, 48), "per-head"),
                                             ((2, 2, 3, 5, 8), "arange")])
def test_rope_matches_reference(shape, positions, dtype):
    from cs336_basics.model import RotaryEmbedding
    from cs336_systems.kernels.rope import rope, rope_reference

    device = kernel_device()
    torch.manual_seed(2)
    seq, dim = shape[-2], shape[-1]
    cache = RotaryEmbedding(64, dim)._freq_cis_cache.to(device)
    pos = {"arange": torch.arange(seq), "offset": torch.arange(seq) + 50,
           "random": torch.randint(0, 64, (shape[0], seq)),
           "per-head": torch.randint(0, 64, shape[:-1])}[positions].to(device)  # no head shares positions
    x, dy = torch.randn(shape, device=device), torch.randn(shape, device=device)
    ref, (ref_dx,) = _grads(lambda a: rope_reference(a, pos, cache.double()), x.double(), grad_out=dy.double())
    ours, (dx,) = _grads(lambda a: rope(a, pos, cache.to(dtype)), x.to(dtype), grad_out=dy)
    low, (low_dx,) = _grads(lambda a: rope_reference(a, pos, cache.to(dtype)), x.to(dtype), grad_out=dy)
    assert ours.dtype == dtype and ours.shape == x.shape
    assert_within_budget("y", ours, ref, low)
    assert_within_budget("dx", dx, ref_dx, low_dx)


@pytest.mark.parametrize("positions", ["shared", "per-head"])
@pytest.mark.parametrize("min_programs", [1, 4, 528])
def test_rope_splits_heads_over_programs_where_positions_alone_are_too_few(min_programs, positions, monkeypatch):
    """Five heads, two (batch, position block) programs: with MIN_PROGRAMS 1 each program walks all five heads,
    with 4 the heads split 3 + 2 over two groups (the last group short), with 528 one head a program; every head
    is rotated exactly once, forward and backward."""
    from cs336_basics.model import RotaryEmbedding
    from cs336_systems.kernels import rope as rope_module

    monkeypatch.setattr(rope_module, "MIN_PROGRAMS", min_programs)
    device = kernel_device()
    torch.manual_seed(5)
    shape = (2, 5, 17, 16)
    cache = RotaryEmbedding(64, shape[-1])._freq_cis_cache.to(device)
    pos = torch.arange(shape[-2])[None, None] if positions == "shared" else torch.randint(0, 64, shape[:-1])
    pos = pos.to(device)
    x, dy = torch.randn(shape, device=device), torch.randn(shape, device=device)
    ref, (ref_dx,) = _grads(lambda a: rope_module.rope_reference(a, pos, cache.double()), x.double(),
                            grad_out=dy.double())
    ours, (dx,) = _grads(lambda a: rope_module.rope(a, pos, cache), x, grad_out=dy)
    torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx.double(), ref_dx, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["one product", "apart"])
@pytest.mark.parametrize("positions", ["arange", "random", "per-head"])
@pytest.mark.parametrize("min_programs", [1, 4, 528])
def test_rope_pair_rotates_q_and_k_as_rope_does_each(min_programs, positions, layout, dtype, monkeypatch):
    """rope_pair(q, k) against the fp64 reference of each, forward and both gradients: Q and K as column blocks of
    one product (one launch: the kernel's second half of head groups takes K; with MIN_PROGRAMS 4 five heads split
    3 + 2 per tensor, the last group short), or of different layouts (one contiguous, one a strided view: a launch
    each)."""
    from cs336_basics.model import RotaryEmbedding
    from cs336_systems.kernels import rope as rope_module

    monkeypatch.setattr(rope_module, "MIN_PROGRAMS", min_programs)
    device = kernel_device()
    torch.manual_seed(6)
    batch, heads, seq, dim = 2, 5, 17, 16
    cache = RotaryEmbedding(64, dim)._freq_cis_cache.to(device)
    pos = {"arange": torch.arange(seq), "random": torch.randint(0, 64, (batch, 1, seq)),
           "per-head": torch.randint(0, 64, (batch, heads, seq))}[positions].to(device)
    product = torch.randn(batch, seq, 3 * heads * dim, device=device).to(dtype)  # Q | K | V columns
    q, k, _ = (t.unflatten(-1, (heads, dim)).transpose(1, 2) for t in product.split(heads * dim, dim=-1))
    if layout == "apart":
        k = k.contiguous()
    dq, dk = torch.randn(2, batch, heads, seq, dim, device=device)
    leaves = [t.detach().requires_grad_() for t in (q, k)]  # (detach: a view of the same layout)
    ours = rope_module.rope_pair(*leaves, pos, cache.to(dtype))
    torch.autograd.backward(ours, (dq.to(dtype), dk.to(dtype)))
    for name, x, out, grad_in, leaf in (("q", q, ours[0], dq, leaves[0]), ("k", k, ours[1], dk, leaves[1])):
        ref, (ref_dx,) = _grads(lambda a: rope_module.rope_reference(a, pos, cache.double()), x.double(),
                                grad_out=grad_in.double())
        low, (low_dx,) = _grads(lambda a: rope_module.rope_reference(a, pos, cache.to(dtype)), x, grad_out=grad_in)
        order = [sorted(range(4), key=lambda i: -t.stride(i)) for t in (out, x)]  # dense, in x's order of dims
        assert out.dtype == dtype and out.shape == x.shape and order[0] == order[1]
        assert out.stride(order[0][0]) * out.shape[order[0][0]] == out.numel()
        assert_within_budget(f"{name}: y", out, ref, low)
        assert_within_budget(f"{name}: dx", leaf.grad, ref_dx, low_dx)


def test_rope_pair_refuses_q_and_k_of_different_shapes():
    from cs336_systems.kernels.rope import rope_pair

    with pytest.raises(ValueError, match=r"rope_pair: q and k must have one shape, got \(2, 3, 4, 8\) and "):
        rope_pair(torch.ones(2, 3, 4, 8), torch.ones(2, 1, 4, 8), torch.arange(4), torch.ones(2, 16, 4))
    with pytest.raises(ValueError, match="rope_pair: cache must be"):
        rope_pair(torch.ones(2, 3, 4, 8), torch.ones(2, 3, 4, 8), torch.arange(4), torch.ones(2, 16, 3))


def test_rope_reads_the_models_head_view_in_place_and_keeps_its_layout():
    """The model rotates a (batch, heads, seq, d) view of the (batch, seq, heads x d) projection: no copy
    in, the output in the same layout (so the attention and the gradient's way back are copy-free)."""
    from cs336_basics.model import RotaryEmbedding
    from cs336_systems.kernels.rope import rope, rope_reference

    device = kernel_device()
    torch.manual_seed(4)
    batch, seq, heads, dim = 2, 19, 3, 32
    cache = RotaryEmbedding(64, dim)._freq_cis_cache.to(device)
    projection = torch.randn(batch, seq, heads * dim, device=device, requires_grad=True)
    view = projection.view(batch, seq, heads, dim).transpose(1, 2)  # as einops' rearrange makes it
    pos = torch.arange(seq, device=device)[None, :]
    out = rope(view, pos, cache)
    assert out.stride() == view.stride()
    torch.testing.assert_close(out, rope_reference(view, pos, cache), rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(out)
    out.backward(dy)
    leaf = projection.detach().requires_grad_()
    rope_reference(leaf.view(batch, seq, heads, dim).transpose(1, 2), pos, cache).backward(dy)
    torch.testing.assert_close(projection.grad, leaf.grad, rtol=1e-5, atol=1e-5)
    # More leading dims, permuted: whatever the layout, the values are the rotation's.
    five = torch.randn(2, seq, 3, 2, dim, device=device).permute(0, 2, 3, 1, 4)  # (2, 3, 2, seq, dim)
    torch.testing.assert_close(rope(five, pos, cache), rope_reference(five, pos, cache), rtol=1e-5, atol=1e-5)


def test_rope_bad_inputs():
    from cs336_systems.kernels.rope import rope

    with pytest.raises(ValueError, match="cache must be"):
        rope(torch.ones(2, 4, 8), torch.arange(4), torch.ones(2, 16, 3))
    with pytest.raises(TypeError, match="integers"):
        rope(torch.ones(2, 4, 8), torch.arange(4.0), torch.ones(2, 16, 4))


def test_rope_checks_each_positions_tensor_once(monkeypatch):
    """Positions are checked on the device once per tensor and version (the model rotates Q and K by one
    tensor); a new tensor, an in-place change or another cache length is checked again, and bad positions
    still raise (on the CPU, _assert_async raises at once)."""
    import cs336_systems.kernels.rope as rope_module

    checks = []
    real = torch._assert_async
    monkeypatch.setattr(torch, "_assert_async", lambda *a: checks.append(1) or real(*a))
    monkeypatch.setattr(rope_module, "_last_checked", None)
    cache = torch.ones(2, 16, 4)
    x = torch.randn(2, 3, 5, 8)
    positions = torch.arange(5)[None]
    rope_module.rope(x, positions, cache)
    rope_module.rope(x, positions, cache)
    assert len(checks) == 1
    positions.add_(1)  # in place: a new version
    rope_module.rope(x, positions, cache)
    rope_module.rope(x, positions.clone(), cache)  # another tensor
    rope_module.rope(x, positions, torch.ones(2, 8, 4))  # another context
    assert len(checks) == 4
    with pytest.raises(RuntimeError, match=r"positions must be in \[0, 16\)"):
        rope_module.rope(x, positions + 20, cache)
    # Views of one tensor (each layer of a fused model views one cached arange): told by base and geometry.
    base = torch.arange(8)
    checks.clear()
    rope_module.rope(x, base[:5].unsqueeze(0), cache)
    rope_module.rope(x, base[:5].unsqueeze(0), cache)  # a new view object, the same positions
    assert len(checks) == 1
    rope_module.rope(x, base[1:6].unsqueeze(0), cache)  # another offset
    base.mul_(1)  # in place through the base: a new version for every view of it
    rope_module.rope(x, base[1:6].unsqueeze(0), cache)
    assert len(checks) == 3


def test_pointwise_kernels_compile_for_hopper_without_spills():
    """scripts/pointwise_sass_check.py builds what our launchers launch -- RoPE (the Q/K pair in one launch, and one
    tensor) and RMSNorm forward and backward -- for sm_90 on any machine, at every head dim and width of the presets,
    and finds no local memory in any: what ptxas makes of the kernels where no GPU runs them."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(root), os.environ.get("PYTHONPATH"))))
    done = subprocess.run([sys.executable, str(root / "scripts" / "pointwise_sass_check.py")], capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert sum(line.startswith("rope d ") and "Q and K: rope_kernel" in line for line in lines) >= 2  # one launch
    assert sum(line.startswith("rmsnorm backward width 768") for line in lines) == 1
    assert sum(line.startswith("add_rmsnorm backward width 768") for line in lines) == 1
    assert all(line.endswith("no local memory") for line in lines), done.stdout
