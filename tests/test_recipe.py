"""recipe.py: one place builds our stack, in one order, for every suite."""

import re
from pathlib import Path

import pytest
import torch

from cs336_basics.optimizer import AdamW
from cs336_systems.config import ModelConfig
from cs336_systems.memory.policy import CheckpointPolicy
from cs336_systems.recipe import Recipe, attention_context, build_model, build_optimizer, forward_of

TINY = ModelConfig.from_name("tiny")


def test_default_recipe_is_the_plain_model_and_the_same_for_the_same_seed():
    one, two = build_model(TINY, Recipe(), "cpu"), build_model(TINY, Recipe(), "cpu")
    assert all(torch.equal(a, b) for a, b in zip(one.state_dict().values(), two.state_dict().values()))
    assert isinstance(build_optimizer(one, Recipe()), AdamW) and forward_of(one, Recipe()) is one
    plain = TINY.build(device="cpu")
    assert type(plain) is type(one) and plain.state_dict().keys() == one.state_dict().keys()


def test_checkpointing_dtype_and_compile_are_applied():
    model = build_model(TINY, Recipe(checkpoint=CheckpointPolicy.parse("every-block"), param_dtype=torch.float64),
                        "cpu")
    assert all(p.dtype == torch.float64 for p in model.parameters())
    assert all("forward" in vars(block) for block in model.layers)  # each block's forward is the checkpointed one
    x = torch.randint(0, TINY.vocab_size, (2, 16))
    reference = build_model(TINY, Recipe(param_dtype=torch.float64), "cpu")
    with attention_context(Recipe()):
        assert torch.allclose(model(x), reference(x))  # checkpointing changes memory, not results
    compiled = forward_of(build_model(TINY, Recipe(compile="model"), "cpu"), Recipe(compile="model"))
    assert isinstance(compiled, torch._dynamo.eval_frame.OptimizedModule)
    blocks = build_model(TINY, Recipe(compile="block"), "cpu")
    assert all(block._compiled_call_impl is not None for block in blocks.layers)


def test_fused_recipe_merges_the_projections_unless_told_not_to():
    """Recipe(fused=True) hands `merge_projections` to apply_fused_kernels: w1 and w3 (and Q, K, V) share one
    buffer by default, and keep their own storage with merge_projections=False."""
    for merge in (True, False):
        layer = build_model(TINY, Recipe(fused=True, merge_projections=merge), "cpu").layers[0]
        for group in ((layer.ffn.w1, layer.ffn.w3), (layer.attn.q_proj, layer.attn.k_proj, layer.attn.v_proj)):
            storages = {linear.weight.untyped_storage().data_ptr() for linear in group}
            assert (len(storages) == 1) == merge


@pytest.mark.parametrize("kwargs, message", [
    (dict(compile="yes"), "compile must be one of off, model, block, got 'yes'"),
    (dict(optimizer="sgd"), "optimizer must be one of cs336, fused, got 'sgd'"),
    (dict(fused_rope=True), "fused_rope needs fused"),
    (dict(checkpoint="every-block"), r"checkpoint must be a CheckpointPolicy \(CheckpointPolicy.parse\(text\)\)"),
])
def test_bad_recipes_are_refused(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        Recipe(**kwargs)


def test_no_suite_assembles_our_stack_itself():
    """The suites build "ours" through the recipe: none builds a model, installs kernels or checkpointing, or
    makes our optimizer by itself."""
    bench = Path(__file__).resolve().parents[1] / "cs336_systems" / "bench"
    pattern = re.compile(r"\bcfg\.build\(|apply_fused_kernels\(|apply_checkpointing\(|FusedAdamW\(|[^.]AdamW\(")
    offenders = [f"{path.name}:{number}" for path in sorted(bench.glob("*.py"))
                 for number, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == []


def test_compiled_blocks_keep_guards_on_the_attention_but_not_on_our_packages_globals(monkeypatch):
    """Our compiled blocks run without dynamo's guards on our own modules' globals (constants and helpers nothing
    rebinds: rebinding one here does not recompile), and with those on torch's and cs336_basics' (the attention a
    context installs: swapping it recompiles, so a block never runs the attention it was not compiled with)."""
    import cs336_systems.kernels.rmsnorm as rmsnorm_module
    from cs336_systems.recipe import skip_guards_on_our_globals

    class Entry:
        def __init__(self, name, is_global=True):
            self.name, self.is_global = name, is_global

    assert skip_guards_on_our_globals([Entry("G['__import_cs336_systems_dot_kernels_dot_rmsnorm'].MAX_D"),
                                       Entry("G['scaled_dot_product_attention']"), Entry("L['x']", False)]) == [
        False, True, True]
    torch._dynamo.reset()
    cfg = ModelConfig.from_name("tiny", context_length=16, num_layers=2)
    recipe = Recipe(attention="triton", fused=True, fused_rope=True, compile="block")
    model = build_model(cfg, recipe, "cpu")
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    frames = torch._dynamo.utils.counters["stats"]

    def compiles_after(run) -> int:
        before = frames["unique_graphs"]
        run()
        return frames["unique_graphs"] - before

    with attention_context(recipe):
        assert compiles_after(lambda: model(tokens)) >= 1
        assert compiles_after(lambda: model(tokens)) == 0
        monkeypatch.setattr(rmsnorm_module, "MAX_D", rmsnorm_module.MAX_D + 1)  # read in our traced wrapper
        assert compiles_after(lambda: model(tokens)) == 0
    with attention_context(Recipe(attention="reference")):
        assert compiles_after(lambda: model(tokens)) >= 1
    torch._dynamo.reset()
