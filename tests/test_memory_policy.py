"""memory/policy.py: a checkpointing policy string is parsed once into a CheckpointPolicy, refused with a message
naming it where it is not one, and printed back as the string it stands for."""

import re

import pytest

from cs336_systems.memory.policy import POLICY_FORMS, CheckpointPolicy

P = CheckpointPolicy.parse


def test_policy_parsing():
    assert P("every-k:4") == CheckpointPolicy("every-k", 4)
    assert P("partial:0") == CheckpointPolicy("partial", 0)
    with pytest.raises(ValueError, match="block count"):
        P("partial:x")
    assert P("sqrt").group_size(32) == 6 and P("every-k:64").group_size(32) == 32 and P("nested").group_size(8) is None
    with pytest.raises(ValueError, match="unknown checkpoint policy 'all'; valid: none, every-block"):
        P("all")
    with pytest.raises(ValueError, match="positive group size"):
        P("every-k:0")


def test_keep_attn_parsing():
    assert P("partial:3+keep-attn") == CheckpointPolicy("partial", 3, keep_attention=True)
    assert P("every-k:2+keep-attn").keep_attention and not P("every-k:2").keep_attention
    with pytest.raises(ValueError, match=r"\+keep-attn applies to every-block, every-k, partial, sqrt; got it on"):
        P("nested+keep-attn")
    with pytest.raises(ValueError, match="every-k needs a positive group size"):
        P("every-k:0+keep-attn")


def test_selective_parsing():
    assert P("selective") == CheckpointPolicy("partial", 0, selective_rest=True)
    assert (P("partial:3+keep-attn+selective").scheme, P("partial:3+keep-attn+selective").size) == ("partial", 3)
    assert P("partial:3+keep-attn+selective").keep_attention and P("partial:3+keep-attn+selective").selective_rest
    assert not P("partial:3+keep-attn").selective_rest and not P("partial:3+selective").keep_attention
    with pytest.raises(ValueError, match=r"\+selective applies to partial:M"):
        P("every-block+selective")
    with pytest.raises(ValueError, match=r"\+selective applies to partial:M"):
        P("selective+selective")
    with pytest.raises(ValueError, match=r"write \+keep-attn before \+selective"):
        P("partial:3+selective+keep-attn")


@pytest.mark.parametrize("text", ["none", "every-block", "every-k:4", "partial:0", "partial:7", "sqrt", "nested",
                                  "ffn", "attn", "selective", "every-block+keep-attn", "sqrt+keep-attn",
                                  "partial:7+keep-attn", "partial:7+selective", "partial:7+keep-attn+selective"])
def test_str_round_trips(text):
    policy = P(text)
    assert str(policy) == text and P(str(policy)) == policy
    assert CheckpointPolicy.of(policy) is policy and CheckpointPolicy.of(text) == policy


@pytest.mark.parametrize("text", ["", "none:1", "every-k", "every-k:-1", "partial:", "sqrt:2", "ffn+keep-attn",
                                  "selective+keep-attn", "partial:2+selective+selective", "every_block"])
def test_bad_policies_are_refused_naming_the_string(text):
    with pytest.raises(ValueError, match="checkpoint policy.*" + re.escape(repr(text))):
        P(text)


def test_the_object_checks_itself_too():
    with pytest.raises(ValueError, match="keep-attn applies to"):
        CheckpointPolicy("nested", keep_attention=True)
    with pytest.raises(ValueError, match="unknown checkpoint policy"):
        CheckpointPolicy("ffn", 3)
    assert "every-k:K" in POLICY_FORMS and "selective" in POLICY_FORMS
