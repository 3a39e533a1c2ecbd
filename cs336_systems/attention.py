"""Choosing the attention the model runs, by an explicit name.

Every implementation has the signature of `cs336_basics.model.scaled_dot_product_attention`
(Q, K, V, mask=None) and is installed by swapping that module global, so the model stays
ignorant of it. Unknown names raise and list the valid ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import cs336_basics.model as basics_model

AttentionFn = Callable[..., object]

_REFERENCE = basics_model.scaled_dot_product_attention


def _registry() -> dict[str, Callable[[], AttentionFn]]:
    """Name -> factory (factories import lazily, so a CPU-only install never imports Triton here)."""
    return {"reference": lambda: _REFERENCE}


def attention_names() -> list[str]:
    return list(_registry())


def get_attention(name: str) -> AttentionFn:
    registry = _registry()
    if name not in registry:
        raise ValueError(f"unknown attention implementation {name!r}; valid: {', '.join(registry)}")
    return registry[name]()


@contextlib.contextmanager
def use_attention(name: str) -> Iterator[AttentionFn]:
    """Run the model with attention `name` inside the block; the previous function is restored after."""
    fn = get_attention(name)
    previous = basics_model.scaled_dot_product_attention
    basics_model.scaled_dot_product_attention = fn
    try:
        yield fn
    finally:
        basics_model.scaled_dot_product_attention = previous
