"""Staff-checkpoint parity: a model saved in the staff layout loads into ours by name and
gives the same logits, loss, gradients and AdamW step as an independent functional
re-statement of the staff model (fp32, within 1e-5)."""

import json

import torch

from cs336_basics.model import BasicsTransformerLM
from cs336_basics.nn_utils import cross_entropy
from cs336_basics.optimizer import AdamW
from tests.reference_lm import lm_forward

CONFIG = dict(vocab_size=97, context_length=24, d_model=48, num_layers=3, num_heads=4, d_ff=80, rope_theta=10000.0)


def _save_staff_layout(tmp_path, state_dict, prefix=""):
    (tmp_path / "model_config.json").write_text(json.dumps(CONFIG))
    torch.save({prefix + k: v for k, v in state_dict.items()}, tmp_path / "model.pt")


def test_staff_checkpoint_parity(tmp_path):
    torch.manual_seed(0)
    # The staff state dict: random weights under the staff names (norm weights too, not ones).
    staff_sd = {k: torch.randn_like(v) * 0.2 for k, v in BasicsTransformerLM(**CONFIG).state_dict().items()}
    _save_staff_layout(tmp_path, staff_sd, prefix="_orig_mod.")  # as saved from a compiled model
    ours = BasicsTransformerLM.from_pretrained(tmp_path)

    tokens = torch.randint(0, 97, (3, 24))
    targets = torch.randint(0, 97, (3, 24))
    ref_params = {k: v.clone().requires_grad_(True) for k, v in staff_sd.items()}
    ref_logits = lm_forward(ref_params, CONFIG, tokens)
    logits = ours(tokens)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)

    ref_loss = torch.nn.functional.cross_entropy(ref_logits.flatten(0, 1), targets.flatten())
    loss = cross_entropy(logits, targets)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)

    ref_loss.backward()
    loss.backward()
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, ref_params[name].grad, rtol=1e-5, atol=1e-5, msg=name)

    # One AdamW step on both, from the same gradients.
    AdamW(ours.parameters(), lr=1e-3, weight_decay=0.01).step()
    AdamW(ref_params.values(), lr=1e-3, weight_decay=0.01).step()
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.detach(), ref_params[name].detach(), rtol=1e-5, atol=1e-5, msg=name)


def test_round_trip_through_staff_layout(tmp_path):
    torch.manual_seed(1)
    model = BasicsTransformerLM(**CONFIG)
    _save_staff_layout(tmp_path, model.state_dict())
    loaded = BasicsTransformerLM.from_pretrained(tmp_path)
    tokens = torch.randint(0, 97, (2, 10))
    assert torch.equal(model(tokens), loaded(tokens))
