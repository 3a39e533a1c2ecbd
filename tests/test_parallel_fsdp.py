"""FSDP on gloo: exact mode bitwise against single-process training, the fast mode close to it,
fp16 compute against a single-process fp16-compute model, checkpointing without extra gathers."""

import copy

import pytest
import torch
import torch.distributed as dist
from einops import einsum
from torch.utils.checkpoint import checkpoint

from cs336_basics.model import BasicsTransformerLM, Embedding, Linear
from cs336_basics.nn_utils import cross_entropy
from cs336_systems.parallel.fsdp import FSDP, fsdp_gather_full_params
from tests._distributed import local_rows, run_on_ranks

pytestmark = pytest.mark.distributed  # spawns gloo ranks

CONFIG = dict(vocab_size=64, context_length=16, d_model=32, num_layers=2, num_heads=4, d_ff=48)


def _batches(steps, batch=4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 64, (batch, 16), generator=g), torch.randint(0, 64, (batch, 16), generator=g))
            for _ in range(steps)]


def _train(fsdp_kwargs, compare, rank, world_size, steps=3, reference_transform=None, wrap=None,
           optimizer=lambda params: torch.optim.SGD(params, lr=0.1), prepare=None):
    torch.manual_seed(0)
    model = BasicsTransformerLM(**CONFIG)
    if prepare:  # (applied to both, before FSDP)
        prepare(model)
    reference = copy.deepcopy(model)
    if reference_transform:
        reference_transform(reference)
    fsdp = FSDP(model, **fsdp_kwargs)
    if wrap:
        wrap(fsdp.module)
    opt = optimizer(fsdp.parameters())
    ref_opt = optimizer(reference.parameters())
    for x, y in _batches(steps):
        opt.zero_grad()
        loss = cross_entropy(fsdp(local_rows(x, rank, world_size)).float(), local_rows(y, rank, world_size))
        loss.backward()
        fsdp.finish_gradient_synchronization()
        opt.step()
        ref_opt.zero_grad()
        cross_entropy(reference(x).float(), y).backward()
        ref_opt.step()
        full = fsdp_gather_full_params(fsdp)
        assert list(full) == [n for n, _ in reference.named_parameters()]
        for name, p in reference.named_parameters():
            compare(full[name], p.detach(), name)
    return fsdp


def _bitwise(a, b, name):
    assert torch.equal(a, b), f"{name}: max diff {(a - b).abs().max().item():.3e}"


def _close(a, b, name):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def _exact_and_fast(rank, world_size):
    fsdp = _train(dict(exact_gradients=True), _bitwise, rank, world_size)
    _train({}, _close, rank, world_size)
    # Layout: the shard is `weight` on the original modules; parameters() lists each master once.
    names = dict(fsdp.module.named_modules())
    q_proj = names["layers.0.attn.q_proj"]
    assert isinstance(q_proj, Linear) and q_proj.weight.shape == (32 // world_size, 32)
    assert isinstance(names["token_embeddings"], Embedding) and names["token_embeddings"].weight.shape[0] == 32
    assert names["ln_final"].weight.shape == (32,)  # replicated
    ids = [id(p) for p in fsdp.parameters()]
    assert len(ids) == len(set(ids)) == len(list(fsdp.module.parameters()))
    for p in fsdp.parameters():
        assert p.grad is not None and p.grad.shape == p.shape and p.grad.dtype == torch.float32
    # Replicated gradients are bitwise equal on every rank.
    g = fsdp.module.ln_final.weight.grad
    gathered = [torch.empty_like(g) for _ in range(world_size)]
    dist.all_gather(gathered, g)
    assert all(torch.equal(gathered[0], t) for t in gathered)


def test_fsdp_exact_mode_is_bitwise_and_fast_mode_is_close():
    run_on_ranks(_exact_and_fast, 2)


def _adamw_on_shards(rank, world_size):
    from cs336_basics.optimizer import AdamW

    # Elementwise updates on the shards equal the unsharded update, so exact mode stays bitwise.
    _train(dict(exact_gradients=True), _bitwise, rank, world_size, optimizer=lambda ps: AdamW(ps, lr=1e-2))
    _train({}, _close, rank, world_size, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))


def test_fsdp_with_our_adamw_and_torch_adamw():
    run_on_ranks(_adamw_on_shards, 2)


def _fp16_reference(model):
    """Single-process fp16 compute: Linear/Embedding weights cast to fp16 at use, masters fp32."""
    for mod in model.modules():
        if isinstance(mod, Linear):
            mod.forward = lambda x, m=mod: einsum(x.half(), m.weight.half(), "... d_in, d_out d_in -> ... d_out")
        elif isinstance(mod, Embedding):
            mod.forward = lambda ids, m=mod: m.weight.half()[ids, :]


def _fp16_compute(rank, world_size):
    fsdp = _train(dict(compute_dtype=torch.float16), lambda a, b, n: torch.testing.assert_close(
        a, b, rtol=1e-4, atol=1e-4, msg=n), rank, world_size, reference_transform=_fp16_reference)
    for p in fsdp.parameters():
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32


def test_fsdp_fp16_compute_matches_single_process_fp16():
    run_on_ranks(_fp16_compute, 2)


def _checkpoint_blocks(model):
    for block in model.layers:
        block.forward = lambda x, b=block: checkpoint(type(b).forward, b, x, use_reentrant=False)


def _checkpointing(rank, world_size, unit):
    counts = []

    def counting(fsdp):
        original = fsdp._start_gather

        def start(group, force=False):
            if group.handle is None and (force or not group.gathered):
                counts[-1] += 1
            original(group, force)
        fsdp._start_gather = start

    for wrap in (None, _checkpoint_blocks):
        torch.manual_seed(0)
        model = BasicsTransformerLM(**CONFIG)
        fsdp = FSDP(model, exact_gradients=True, unit=unit)
        if wrap:
            wrap(fsdp.module)
        counting(fsdp)
        grads = []
        for x, y in _batches(2):
            counts.append(0)
            for p in fsdp.parameters():
                p.grad = None
            cross_entropy(fsdp(local_rows(x, rank, world_size)), local_rows(y, rank, world_size)).backward()
            fsdp.finish_gradient_synchronization()
            grads.append([p.grad.clone() for p in fsdp.parameters()])
        if wrap is None:
            plain = grads
        else:
            for a, b in zip(plain[-1], grads[-1]):
                assert torch.equal(a, b)  # checkpointing changes nothing in exact mode
    # Embedding and head, then per block 7 Linears gathered one by one ("layer") or together ("block").
    n_gathers = 2 + CONFIG["num_layers"] * (7 if unit == "layer" else 1)
    # Every unit gathered once in forward and once in backward; recomputation adds none.
    assert counts == [2 * n_gathers] * 4, counts


@pytest.mark.parametrize("unit", ["block", "layer"])
def test_fsdp_with_activation_checkpointing_gathers_each_unit_twice(unit):
    run_on_ranks(_checkpointing, 2, unit)


def _layer_units(rank, world_size):
    _train(dict(exact_gradients=True, unit="layer"), _bitwise, rank, world_size, steps=2)
    _train(dict(unit="layer"), _close, rank, world_size, steps=2)


def test_fsdp_one_gather_per_weight_is_bitwise_too():
    run_on_ranks(_layer_units, 2)


def _fused_model(rank, world_size):
    from cs336_systems.fused_model import apply_fused_kernels

    _train({}, _close, rank, world_size, steps=2, prepare=apply_fused_kernels)


def test_fsdp_over_our_fused_model_with_merged_projections():
    """Our fused kernels (the Q/K/V and w1/w3 products merged, by default) under FSDP: the Linears' forwards gather
    their shards, the merged products step aside for them, and training matches the fused model alone."""
    run_on_ranks(_fused_model, 2)


def test_fsdp_unit_is_validated():
    with pytest.raises(ValueError, match="unit must be 'block' or 'layer'"):
        FSDP(torch.nn.Linear(2, 2), unit="module")


def _world_size_one(rank, world_size):
    _train(dict(exact_gradients=True), _bitwise, rank, world_size, steps=2)


def test_fsdp_world_size_one():
    run_on_ranks(_world_size_one, 1)


def _skip_ffn(model):
    """Block 1's SwiGLU is bypassed: its three weights (trainable) get no gradient in a step."""
    model.layers[1].ffn.forward = lambda x: torch.zeros_like(x)


def _frozen_and_unused(rank, world_size):
    def freeze(model):
        model.layers[0].attn.k_proj.weight.requires_grad_(False)

    def prepare(reference):
        freeze(reference)
        _skip_ffn(reference)

    torch.manual_seed(0)
    model = BasicsTransformerLM(**CONFIG)
    reference = copy.deepcopy(model)
    prepare(reference)
    freeze(model)
    fsdp = FSDP(model)
    _skip_ffn(fsdp.module)
    opt = torch.optim.SGD([p for p in fsdp.parameters() if p.requires_grad], lr=0.1)
    ref_opt = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.1)
    for x, y in _batches(2):
        opt.zero_grad()
        cross_entropy(fsdp(local_rows(x, rank, world_size)), local_rows(y, rank, world_size)).backward()
        fsdp.finish_gradient_synchronization()
        opt.step()
        ref_opt.zero_grad()
        cross_entropy(reference(x), y).backward()
        ref_opt.step()
    full = fsdp_gather_full_params(fsdp)
    for name, p in reference.named_parameters():
        _close(full[name], p.detach(), name)
    assert not any(g for g in (u.group.grads for u in fsdp._units))  # every queued gradient was reduced


def test_fsdp_groups_with_frozen_and_gradient_less_weights():
    run_on_ranks(_frozen_and_unused, 2)
