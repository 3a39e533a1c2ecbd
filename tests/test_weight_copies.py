"""The Linear weights' compute-dtype copies (cs336_systems.weight_copies): read by the products under autocast only,
written by FusedAdamW in its update pass, re-copied when a weight is written elsewhere, and the model's loss and
gradients as without them."""

import pytest
import torch

from cs336_basics.nn_utils import cross_entropy
from cs336_systems.config import ModelConfig
from cs336_systems.kernels.adamw import FusedAdamW
from cs336_systems.recipe import Recipe, build_model, build_optimizer, hidden_states, lm_head_loss
from cs336_systems.weight_copies import attach_weight_copies, refresh_weight_copies
from tests._support import kernel_device

CFG = ModelConfig.from_name("tiny", context_length=24, num_layers=2)


@pytest.fixture
def cpu_maths(monkeypatch):
    """The model's operators in their torch maths on the CPU (the interpreter is for the kernel tests)."""
    import cs336_systems.kernels._triton_utils as utils
    import cs336_systems.kernels.flash_attention.function  # noqa: F401  (its autotune configs are read at import)

    monkeypatch.setattr(utils, "interpreting", lambda: False)


def _recipe(copies: bool) -> Recipe:
    return Recipe(fused=True, optimizer="fused", weight_copy_dtype=torch.bfloat16 if copies else None)


def _tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (2, 24), generator=torch.Generator().manual_seed(seed))


def _train(copies: bool, steps: int = 3):
    """`steps` steps under bf16 autocast; the model, each step's loss and the last step's gradients."""
    recipe = _recipe(copies)
    model = build_model(CFG, recipe, "cpu")
    optimizer = build_optimizer(model, recipe)
    losses, grads = [], {}
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", torch.bfloat16):
            loss = cross_entropy(model(_tokens(step)).float(), _tokens(step))
        loss.backward()
        losses.append(loss.item())
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        optimizer.step()
    return model, losses, grads


def test_copies_follow_the_merged_layout_and_leave_the_state_dict_alone(cpu_maths):
    model = build_model(CFG, _recipe(True), "cpu")
    plain = build_model(CFG, _recipe(False), "cpu")
    assert model.state_dict().keys() == plain.state_dict().keys()
    attention, ffn = model.layers[0].attn, model.layers[0].ffn
    qkv = attention.merged_weight_copy
    assert qkv.dtype == torch.bfloat16 and qkv.shape == (3 * CFG.d_model, CFG.d_model)
    for row, linear in enumerate((attention.q_proj, attention.k_proj, attention.v_proj)):  # row blocks of one buffer
        assert linear.weight_copy.data_ptr() == qkv.data_ptr() + row * linear.weight_copy.numel() * 2
        assert linear.weight.compute_copy is linear.weight_copy
        assert torch.equal(linear.weight_copy, linear.weight.detach().to(torch.bfloat16))
    assert ffn.merged_weight_copy.shape == (2 * CFG.d_ff, CFG.d_model)
    assert model.lm_head.weight_copy.shape == model.lm_head.weight.shape
    assert len(model._weight_copy_pairs) == sum(isinstance(m, type(model.lm_head)) for m in model.modules())


def test_products_read_the_copies_under_autocast_only(cpu_maths):
    model = build_model(CFG, _recipe(True), "cpu")
    plain = build_model(CFG, _recipe(False), "cpu")  # same seed: the same weights
    tokens = _tokens()
    with torch.no_grad():
        with torch.autocast("cpu", torch.bfloat16):
            torch.testing.assert_close(model(tokens), plain(tokens), rtol=0, atol=0)
            for _, copy in model._weight_copy_pairs:
                copy.data.mul_(0.5)  # behind the version counters' back: nothing re-copies it
            halved = model(tokens)
        assert not torch.allclose(halved, plain(tokens).to(halved.dtype), atol=1e-2)  # (it read the copies)
        torch.testing.assert_close(model(tokens), plain(tokens), rtol=0, atol=0)  # fp32, no autocast: the weights
        assert refresh_weight_copies(model, force=True) == len(model._weight_copy_pairs)


def test_loss_and_gradients_match_the_model_without_copies(cpu_maths):
    """Three steps with FusedAdamW (its torch update on the CPU): the same losses and gradients (the products read
    bf16 values equal to autocast's casts), and each copy equals its updated weight cast."""
    with_copies, losses, grads = _train(True)
    plain, plain_losses, plain_grads = _train(False)
    assert losses == plain_losses
    for name, grad in plain_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=name)
    for weight, copy in with_copies._weight_copy_pairs:
        refresh_weight_copies(with_copies)  # (the eager update bumps the weights' versions: the pre-hook's work)
        assert torch.equal(copy, weight.detach().to(torch.bfloat16))


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("copies", [True, False])
def test_the_fused_loss_matches_the_logits_loss_and_gives_the_head_weight_its_gradient(copies, cpu_maths):
    """The recipe's fused loss (`lm_head_loss` on `hidden_states`) under bf16 autocast: the product reads the head's
    bf16 copy (or a cast of the weight), as the plain head does, so the loss is the logits path's up to the order of
    fp32 sums; every gradient within bf16's rounding of the logits' gradient; the fp32 weight gets its gradient in
    fp32, the copy none."""
    model = build_model(CFG, _recipe(copies), "cpu")
    tokens, targets = _tokens(0), _tokens(1)
    results = []
    for fused in (True, False):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", torch.bfloat16):
            loss = (lm_head_loss(model, hidden_states(model, tokens), targets) if fused
                    else cross_entropy(model(tokens).float(), targets))
        loss.backward()
        results.append((loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}))
    (fused_loss, fused_grads), (plain_loss, plain_grads) = results
    torch.testing.assert_close(fused_loss, plain_loss, rtol=1e-5, atol=0)
    assert fused_grads.keys() == plain_grads.keys()
    for name, grad in plain_grads.items():
        assert fused_grads[name].dtype == torch.float32
        assert _relative_error(fused_grads[name], grad) < 2e-2, name
    if copies:
        assert model.lm_head.weight_copy.grad is None


def test_the_fused_loss_reads_copies_kept_current_without_the_models_forward(cpu_maths):
    """`hidden_states` bypasses the model's forward (and its pre-hook): it re-copies moved weights itself."""
    model = build_model(CFG, _recipe(True), "cpu")
    other = build_model(CFG, _recipe(False), "cpu", seed=1)
    model.load_state_dict(other.state_dict())  # the versions move; no forward of `model` runs after this
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        losses = [lm_head_loss(m, hidden_states(m, _tokens()), _tokens(1)) for m in (model, other)]
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)


def test_a_weight_written_outside_the_optimizer_is_recopied_before_the_forward(cpu_maths):
    model = build_model(CFG, _recipe(True), "cpu")
    other = build_model(CFG, _recipe(False), "cpu", seed=1)
    model.load_state_dict(other.state_dict())  # copy_ under no_grad: the versions move
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        torch.testing.assert_close(model(_tokens()), other(_tokens()), rtol=0, atol=0)
    assert refresh_weight_copies(model) == 0  # the pre-hook did it
    model.lm_head.weight.data.zero_()  # invisible to the version counter
    assert refresh_weight_copies(model) == 0
    assert refresh_weight_copies(model, force=True) == len(model._weight_copy_pairs)
    assert not model.lm_head.weight_copy.any()


def test_another_optimizer_leaves_the_copies_to_the_pre_hook(cpu_maths):
    """cs336_basics' AdamW writes the weights in place under no_grad: their versions move, and the next forward reads
    fresh copies (the same losses as the model without copies)."""
    from cs336_basics.optimizer import AdamW

    losses = []
    for copies in (True, False):
        model = build_model(CFG, _recipe(False), "cpu")
        if copies:
            attach_weight_copies(model)
        optimizer = AdamW(model.parameters(), lr=1e-2)
        losses.append([])
        for step in range(3):
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", torch.bfloat16):
                loss = cross_entropy(model(_tokens(step)).float(), _tokens(step))
            loss.backward()
            optimizer.step()
            losses[-1].append(loss.item())
    assert losses[0] == losses[1]


def _eager_and_compiled_gradients(copies: bool, device: str):
    """One step's gradients under bf16 autocast, eagerly and then with each block compiled with fullgraph=True
    (as the recipe's block scope compiles them); dynamo's graph breaks asserted none."""
    model = build_model(CFG, _recipe(copies), device)
    tokens = _tokens().to(device)
    results = []
    for compiled in (False, True):
        if compiled:
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            for block in model.layers:
                block.compile(fullgraph=True)
        model.zero_grad(set_to_none=True)
        with torch.autocast(device, torch.bfloat16):
            cross_entropy(model(tokens).float(), tokens).backward()
        results.append({name: p.grad.clone() for name, p in model.named_parameters()})
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    return results


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_blocks_with_copies_compile_without_breaks(cpu_maths, device):
    """The products with copies (our autograd Function) trace without a graph break, and the compiled gradients
    differ from the eager ones by no more than the model without copies' do (inductor rounds its fused bf16
    pointwise work once where eager rounds each op: about 1 % here). On CUDA the weight gradients come out of the
    product in fp32 (`mm` with out_dtype), which dynamo and inductor must trace too."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    budget = _eager_and_compiled_gradients(False, device)
    ours = _eager_and_compiled_gradients(True, device)
    for name, grad in ours[0].items():
        error = (ours[1][name] - grad).norm() / grad.norm()
        allowed = (budget[1][name] - budget[0][name]).norm() / budget[0][name].norm()
        assert error <= 1.5 * allowed + 1e-6, (name, error.item(), allowed.item())


def test_fused_adamw_writes_each_copy_from_the_updated_weight():
    """The kernel (CUDA, or the interpreter on the CPU) writes bf16(p) into a parameter's `compute_copy` in its
    update pass; the update itself is bit for bit the one without copies; a parameter without a copy is skipped
    (the third: nothing of it is written anywhere but itself)."""
    device = kernel_device()
    kw = dict(lr=1e-2, weight_decay=0.1)
    runs = []
    for copies in (False, True):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(shape, device=device)) for shape in ((37,), (5, 300), (2049,))]
        if copies:
            for p in params[:2]:
                p.compute_copy = torch.zeros(p.shape, dtype=torch.bfloat16, device=device)
        optimizer = FusedAdamW(params, **kw)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g).to(device)
            optimizer.step()
        runs.append(params)
    for plain, with_copy in zip(*runs):
        assert torch.equal(plain, with_copy)
    for p in runs[1][:2]:
        if device == "cuda":  # the conversion rounds to nearest even, as torch's cast
            assert torch.equal(p.compute_copy, p.detach().to(torch.bfloat16))
        else:  # Triton 3.6's interpreter truncates fp32 to bf16: within one bf16 step, never past the value
            torch.testing.assert_close(p.compute_copy.float(), p.detach(), rtol=2**-7, atol=0)
            assert (p.compute_copy.float().abs() <= p.detach().abs()).all()


def test_bad_copies_are_refused():
    with pytest.raises(ValueError, match="weight_copy_dtype must be bfloat16 or float16, with fused, the fused "
                                         "optimizer"):
        Recipe(fused=True, optimizer="cs336", weight_copy_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dtype must be bfloat16 or float16, got torch.float32"):
        attach_weight_copies(torch.nn.Linear(2, 2), torch.float32)
    p = torch.nn.Parameter(torch.ones(4))
    p.compute_copy = torch.zeros(3, dtype=torch.bfloat16)
    p.grad = torch.ones(4)
    with pytest.raises(ValueError, match=r"compute_copy must match it \(shape \(4,\)"):
        FusedAdamW([p]).step()


@pytest.mark.gpu
@pytest.mark.parametrize("compile_mode", ["eager", "reduce-overhead"])
def test_training_on_the_gpu_keeps_the_copies_current_without_the_hook(compile_mode):
    """Five steps on CUDA with the FusedAdamW kernel, eagerly and with each block replayed as CUDA graphs: after each
    step every copy equals its weight's bf16 cast with nothing left for the pre-hook to re-copy (the kernel wrote
    them), and the losses follow the model without copies' (the fp32 weight gradients differ from its bf16 ones
    by rounding only)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from cs336_systems.recipe import attention_context

    losses = {}
    for copies in (True, False):
        recipe = Recipe(attention="triton", fused=True, fused_rope=True, optimizer="fused",
                        weight_copy_dtype=torch.bfloat16 if copies else None,
                        compile="block" if compile_mode != "eager" else "off",
                        compile_mode=compile_mode if compile_mode != "eager" else "default")
        torch._dynamo.reset()
        model = build_model(CFG, recipe, "cuda")
        optimizer = build_optimizer(model, recipe)
        losses[copies] = []
        with attention_context(recipe):
            for step in range(5):
                tokens = _tokens(step).cuda()
                if compile_mode == "reduce-overhead":
                    torch.compiler.cudagraph_mark_step_begin()
                optimizer.zero_grad(set_to_none=True)
                with torch.autocast("cuda", torch.bfloat16):
                    loss = cross_entropy(model(tokens).float(), tokens)
                loss.backward()
                losses[copies].append(loss.item())
                optimizer.step()
                if copies:
                    assert refresh_weight_copies(model) == 0
                    for weight, copy in model._weight_copy_pairs:
                        assert torch.equal(copy, weight.detach().to(torch.bfloat16))
    torch.testing.assert_close(torch.tensor(losses[True]), torch.tensor(losses[False]), rtol=2e-3, atol=0)
