"""Model presets."""

import pytest

from cs336_systems.config import PRESETS, ModelConfig

TABLE1 = {"small": (768, 3072, 12, 12), "medium": (1024, 4096, 24, 16), "large": (1280, 5120, 36, 20),
          "xl": (2560, 10240, 32, 32), "10B": (4608, 12288, 50, 36)}


@pytest.mark.parametrize("name", list(TABLE1))
def test_table1_presets(name):
    cfg = ModelConfig.from_name(name)
    assert (cfg.d_model, cfg.d_ff, cfg.num_layers, cfg.num_heads) == TABLE1[name]
    assert (cfg.vocab_size, cfg.context_length) == (10_000, 512)


def test_leaderboard_preset():
    cfg = ModelConfig.from_name("leaderboard-8b")
    assert (cfg.vocab_size, cfg.d_model, cfg.d_ff, cfg.num_layers, cfg.num_heads, cfg.context_length) == (
        151_936, 4096, 11008, 34, 32, 32_768)


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ValueError, match="unknown model preset 'huge'.*tiny.*leaderboard-8b"):
        ModelConfig.from_name("huge")


def test_overrides_and_validation():
    assert ModelConfig.from_name("xl", context_length=2048).context_length == 2048
    with pytest.raises(ValueError, match="divisible"):
        ModelConfig.from_name("tiny", num_heads=5)
    with pytest.raises(ValueError, match="num_layers"):
        ModelConfig.from_name("tiny", num_layers=0)


def test_tiny_builds_and_runs():
    import torch

    model = PRESETS["tiny"].build()
    assert model(torch.zeros(1, 8, dtype=torch.long)).shape == (1, 8, PRESETS["tiny"].vocab_size)


def test_parameter_count_is_the_built_models():
    from cs336_systems.config import ModelConfig

    for cfg in (ModelConfig.from_name("tiny"), ModelConfig(vocab_size=50, context_length=8, d_model=24, num_layers=3,
                                                          num_heads=2, d_ff=40)):
        assert cfg.parameter_count == sum(p.numel() for p in cfg.build().parameters())
